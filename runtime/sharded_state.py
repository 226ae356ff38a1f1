"""Sharded training state: where each parameter, gradient and optimizer-state tensor lives on each rank.

Layout (``ShardSpec``): a tensor of a parameter's shape ``(d0, ...)`` is cut along dim 0 into ``world_size``
shards (hybrid sharding: ``shard_group_size``, every shard group holding the same ones) of ``ceil(d0 /
world_size)`` rows; rank ``r`` holds rows ``[r * rows, (r + 1) * rows)`` of the tensor padded with zero rows. The
graph reads and writes that padded shard (same shape on every rank); the user sees a ``DTensor`` with placement
``Shard(0)`` (hybrid: ``(Replicate(), Shard(0))`` on a 2-D mesh) whose local tensor is the unpadded part, a view
of the padded shard — the same cut ``torch.chunk`` and DTensor make, so ``model.state_dict()`` and
``optimizer.state_dict()`` are ready for ``torch.distributed.checkpoint``.

What is sharded, by ZeRO stage: stage ≥ 1 optimizer state of a parameter's shape; stage ≥ 2 gradients left
in ``.grad``; stage 3 the parameters themselves (replaced, on the modules and in the optimizer, by ``DTensor``
parameters). 0-d parameters, and tensors an optimizer holds that no module owns, stay whole. A pipelined step
cuts them within each stage's data-parallel group (its group's shard axis: ``zgraph.runtime.pipeline_groups``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from zgraph.errors import ShardedParameterError, ZGraphError
from zgraph.graph import ShardSpec
from zgraph.ops import host_read
from zgraph.runtime.meta_init import release, swap_storage
from zgraph.runtime.process_group import ProcessGroupInfo, device_mesh, hybrid_mesh
from zgraph.runtime.state import Binding
from zgraph.runtime.storage_guard import refuse_storage_access

_PADDED = "_zgraph_padded"


def pad_shard(full: Tensor, spec: ShardSpec, rank: int) -> Tensor:
    """This rank's padded shard of a whole tensor (a new tensor)."""
    rows = spec.rows
    local = full.detach()[rank * rows : (rank + 1) * rows]
    padded = full.new_zeros(spec.shard_shape)
    padded[: local.shape[0]].copy_(local)
    return padded


@dataclass
class ShardingPlan:
    """How one binding's state is laid out across ranks; decided on the step's first call.

    Attributes:
        stage: ZeRO stage.
        group: the process group (``SINGLE_PROCESS``: no sharding at all).
        specs: per parameter index, how its gradient and optimizer state (and, unless ``persistent``, the
            parameter itself in stage 3) are cut; None for 0-d parameters and without a process group.
        persistent: per parameter index, True if the parameter itself stays whole in stage 3 (its gradient and
            optimizer state are still sharded).
    """

    stage: int
    group: ProcessGroupInfo
    specs: list[ShardSpec | None] = field(default_factory=list)
    persistent: list[bool] = field(default_factory=list)
    mesh: Any = None

    @property
    def rank(self) -> int:
        """This rank's position among the ranks state is cut across (hybrid sharding: in its shard group)."""
        return self.group.shard_axis.rank

    @property
    def placements(self) -> tuple[Placement, ...]:
        """The user-facing DTensors' placements: ``Shard(0)``; with hybrid sharding ``(Replicate(), Shard(0))``
        on the 2-D mesh (replicate, shard), as FSDP2's HSDP."""
        return (Replicate(), Shard(0)) if self.group.replicate is not None else (Shard(0),)

    def params_sharded(self, index: int) -> bool:
        return self.stage >= 3 and self.specs[index] is not None and not self.persistent[index]

    def state_spec(self, index: int, t: Tensor) -> ShardSpec | None:
        """The spec of an optimizer state / gradient tensor of parameter ``index`` when it is kept sharded."""
        spec = self.specs[index]
        if spec is None or tuple(t.shape) != spec.shape:
            return None
        return spec

    # ----------------------------------------------------------------------------- local <-> user views
    def wrap(self, padded: Tensor, spec: ShardSpec, requires_grad: bool = False) -> DTensor:
        """The user-facing DTensor for a padded shard (its local tensor is a view of ``padded``)."""
        local = padded[: spec.local_rows(self.rank)]
        stride = torch.empty(spec.shape, device="meta").stride()
        # a shard in host memory (the update on the host) stays there: ``from_local`` would copy it to the mesh's
        # device, so its spec is made from a meta stand-in and the DTensor around the host shard (as FSDP2's CPU
        # offload keeps its shards)
        moves = local.device.type != self.mesh.device_type and not local.is_meta
        dt = DTensor.from_local(
            torch.empty(local.shape, dtype=local.dtype, device="meta") if moves else local,
            self.mesh,
            self.placements,
            run_check=False,
            shape=torch.Size(spec.shape),
            stride=stride,
        )
        if moves:
            dt = DTensor(local, dt._spec, requires_grad=False)
        if requires_grad:
            dt = nn.Parameter(dt, requires_grad=True)
        setattr(dt, _PADDED, padded)
        return dt

    def padded(self, t: Tensor, spec: ShardSpec) -> Tensor:
        """The padded local shard of ``t``: a DTensor zgraph made (no copy), another DTensor, or a whole
        tensor (sliced and padded)."""
        if isinstance(t, DTensor):
            padded = getattr(t, _PADDED, None)
            local = t._local_tensor
            if padded is not None and (local.numel() == 0 or local.data_ptr() == padded.data_ptr()):
                return padded
            out = local.new_zeros(spec.shard_shape)
            out[: local.shape[0]].copy_(local.detach())
            return out
        return pad_shard(t, spec, self.rank)

    def store(self, current: Tensor | None, padded: Tensor, spec: ShardSpec, adopt: bool = False) -> DTensor:
        """Point the DTensor ``current`` at a new padded shard, else make a new one. ``current`` is zgraph's or,
        with ``adopt`` (a parameter), laid out as zgraph lays it: ``model.to(device)`` swapped a copy into a
        sharded parameter, and the copy is pointed at the shard, so the update lands in the parameter the module
        holds."""
        if isinstance(current, DTensor) and (
            getattr(current, _PADDED, None) is not None or adopt and self.laid_out(current, spec)
        ):
            current._local_tensor = padded[: spec.local_rows(self.rank)]
            setattr(current, _PADDED, padded)
            return current
        return self.wrap(padded, spec)

    def laid_out(self, t: DTensor, spec: ShardSpec) -> bool:
        """Whether ``t`` is zgraph's DTensor for ``spec``, or one laid out the same way (same mesh, rows)."""
        if getattr(t, _PADDED, None) is not None:
            return True
        return t.device_mesh == self.mesh and tuple(t.placements) == self.placements and tuple(t.shape) == spec.shape


def make_plan(
    stage: int, group: ProcessGroupInfo, binding: Binding, persistence_threshold: int = 0, mesh: bool = True
) -> ShardingPlan:
    """Decide the layout of every parameter's state. In stage 3 a parameter stays whole (persistent) when no
    module owns it or it has at most ``persistence_threshold`` elements. ``mesh=False``: a plan for reading only
    (an estimate's), with no device mesh, so it cannot shard tensors (``apply_plan``) and needs no process group."""
    plan = ShardingPlan(stage, group)
    if group.distributed and mesh:
        if group.replicate is not None:
            plan.mesh = hybrid_mesh(binding.device.type, group)
        elif group.shard is not None:  # a pipelined step's: a stage's data-parallel group
            plan.mesh = device_mesh(binding.device.type, group.shard.size, group.shard.name)
        else:
            plan.mesh = device_mesh(binding.device.type, group.world_size, group.group_name if group.ranks else None)
        refuse_storage_access()
    for record in binding.params:
        t = record.tensor
        spec = ShardSpec(tuple(t.shape), group.shard_axis.size) if group.distributed and t.dim() > 0 else None
        plan.specs.append(spec)
        already_sharded = getattr(t, _PADDED, None) is not None  # by another step's plan (e.g. fwd/bwd only)
        plan.persistent.append(not already_sharded and (not record.slots or t.numel() <= persistence_threshold))
    if stage >= 3 and group.distributed and binding.params:
        if not any(plan.params_sharded(i) for i in range(len(binding.params))):
            largest = max(r.tensor.numel() for r in binding.params)
            warnings.warn(
                f"zgraph: stage 3 shards no parameter of this model: every one has at most "
                f"param_persistence_threshold={persistence_threshold} elements (the largest has {largest}), so each "
                "stays whole on every rank (DeepSpeed's stage3_param_persistence_threshold does the same). Lower "
                "Config.param_persistence_threshold to shard them.",
                RuntimeWarning,
                stacklevel=2,
            )
    return plan


def convert_master_dtype(binding: Binding, master: torch.dtype | None, state: torch.dtype | None) -> None:
    """Store floating parameters (and their ``.grad``) in ``master``, and optimizer state tensors of a parameter's
    shape in ``state`` (else in the master dtype), as ``Config.master_dtype`` / ``optimizer_state_dtype`` say."""
    for record in binding.params:
        p = record.tensor
        if master is not None and p.is_floating_point() and p.dtype != master:
            with torch.no_grad():
                p.data = p.data.to(master)
                if p.grad is not None:
                    p.grad = p.grad.to(master)
    target = state or master
    if target is None:
        return
    for o in binding.optimizers:
        for indices in o.group_params:
            for i in indices:
                param = binding.params[i].tensor
                for key, value in o.optimizer.state.get(param, {}).items():
                    if isinstance(value, Tensor) and value.shape == param.shape and value.dtype != target:
                        o.optimizer.state[param][key] = value.to(target)


# ------------------------------------------------------------------------------------------ sharding in place
_OWNER_ATTR = "_zgraph_owner"


class _Owner:
    """The plan and binding that sharded a module, kept on the module itself.

    On the module (not in a global weak map, whose values would keep their own keys alive): the module, its
    binding and its sharded tensors form one cycle that the garbage collector frees together once the user
    drops the model, and with it the device mesh and process group they reference. Neither copied nor
    pickled: ``copy.deepcopy(model)`` or ``torch.save(model)`` gives a module no step owns, as before.
    """

    __slots__ = ("plan", "binding")

    def __init__(self, plan: ShardingPlan, binding: Binding):
        self.plan = plan
        self.binding = binding

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (_no_owner, ())


def _no_owner() -> None:
    return None


def sharding_of(module: nn.Module) -> tuple[ShardingPlan, Binding] | None:
    """The plan and binding that sharded ``module`` (or one of its ancestors' bindings), if any."""
    owner = module.__dict__.get(_OWNER_ATTR)
    return (owner.plan, owner.binding) if owner is not None else None


def check_owners(stage: int, group: ProcessGroupInfo, binding: Binding) -> None:
    """Raise (changing nothing) when a module of ``binding`` is already laid out by a step of another ZeRO stage
    or process group."""
    for _, root in binding.modules:
        owner = sharding_of(root)
        if owner is not None and (owner[0].stage != stage or owner[0].group != group):
            where = "" if owner[0].group == group else " over another process group"
            raise ZGraphError(
                f"{type(root).__name__} is already sharded by another zgraph step with stage "
                f"{owner[0].stage}{where}; a module can be driven by steps of one stage and one group only"
            )


def apply_plan(plan: ShardingPlan, binding: Binding) -> None:
    """Shard the binding's state in place, as the plan says: parameters (stage 3), gradients (stage ≥ 2) and
    optimizer state (stage ≥ 1). Records which modules are sharded, for ``zgraph.gather``."""
    check_owners(plan.stage, plan.group, binding)
    if plan.group.distributed:
        if plan.stage >= 2:
            _watch_eager_optimizer_steps()
        for record in binding.params:
            if plan.params_sharded(record.index) and not isinstance(record.tensor, DTensor):
                shard_parameter(plan, binding, record.index)
        normalize_state(plan, binding)
    owner = _Owner(plan, binding)
    for _, root in binding.modules:
        for module in root.modules():
            module.__dict__[_OWNER_ATTR] = owner
        if plan.stage >= 3 and plan.group.distributed:
            _guard_outside_use(root)


def broadcast_initial_state(
    binding: Binding, group: ProcessGroupInfo, allocate: Callable[[Tensor], Tensor] | None = None
) -> None:
    """Give every rank rank 0's parameters and buffers, as DDP does when it wraps a model, so ranks built with
    different initial weights train one model. Tensors a step already sharded (``DTensor``), and those of modules
    another step already bound (agreed then; a split output's backward may still need them as they are), are
    left alone.

    One tensor at a time: a parameter the plan shards is cut from the tensor received and its whole storage
    released, so a rank holds its shards plus one whole tensor; a whole tensor is written only where its values
    differ from rank 0's (a model mapped from a file on every rank stays clean). ``allocate`` gives this rank's
    meta tensors storage to receive into (rank 0 alone holds the real model: ``sync_module_states``)."""
    if not group.distributed:
        return
    c10d = torch.ops._c10d_functional
    agreed = {id(t) for _, root in binding.modules if sharding_of(root) for t in (*root.parameters(), *root.buffers())}
    with torch.no_grad():
        tensors = [r.tensor for r in binding.params] + [r.get() for r in binding.buffers]
        for t in tensors:
            if isinstance(t, Tensor) and not isinstance(t, DTensor) and t.numel() and id(t) not in agreed:
                if allocate is not None and t.is_meta:
                    t = allocate(t)
                value = c10d.wait_tensor(c10d.broadcast(t.detach().contiguous(), 0, group.group_name))
                index = binding.param_index(t)
                if index is not None and binding.plan is not None and binding.plan.params_sharded(index):
                    shard_parameter(binding.plan, binding, index, whole=value)
                    release(t)
                elif group.rank != 0 and not _holds(t, value):
                    t.copy_(value)


def _holds(t: Tensor, value: Tensor) -> bool:
    """Whether ``t`` already holds ``value`` (then it is not written: a mapped file's pages stay clean)."""
    if t.is_meta:  # a stand-in device's tensors have no values to compare
        return False
    with host_read("initial broadcast: does this rank already hold rank 0's values?"):
        return torch.equal(t, value)


_REPLACED_BY = "_zgraph_replaced_by"


def current_parameter(t: Tensor) -> Tensor:
    """The parameter that now stands for ``t``: its sharded replacement if a stage-3 binding replaced it (through
    any number of replacements), else ``t``."""
    while getattr(t, _REPLACED_BY, None) is not None:
        t = getattr(t, _REPLACED_BY)
    return t


def adopt_sharded_parameters(optimizers: list[torch.optim.Optimizer]) -> None:
    """Point optimizers at the sharded parameters that replaced the ones they hold.

    A stage-3 step that binds a module but not its optimizer (a forward/backward step of a gradient-accumulation
    loop, with ``opt.step()`` in another step) replaces the module's parameters by sharded ones; the optimizer
    still holds the originals, each of which records its replacement. Their state moves along."""
    for opt in optimizers:
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                new = current_parameter(p)
                if new is not p:
                    group["params"][i] = new
                    if p in opt.state:
                        opt.state[new] = opt.state.pop(p)


def _before_eager_optimizer_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Every eager ``optimizer.step()`` once zgraph shards gradients or parameters: adopt replaced parameters,
    so an optimizer stepped outside zgraph (after a zgraph forward/backward step) updates the sharded
    parameters the module uses, as FSDP2's would (torch's optimizers run on ``DTensor`` shards); refuse whole
    parameters with sharded gradients (stage 2), which an eager optimizer cannot combine."""
    adopt_sharded_parameters([opt])
    for group in opt.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor) and getattr(p.grad, _PADDED, None) is not None:
                raise ZGraphError(
                    f"{type(opt).__name__}.step() outside a zgraph step, but a zgraph stage-2 step left these "
                    "parameters' gradients sharded across ranks. Call opt.step() inside a zgraph step (e.g. "
                    "decorate `def update(opt): opt.step(); opt.zero_grad()` with the same config), or use "
                    "stage 3 (sharded parameters, which eager optimizers can update) or stage <= 1."
                )


@functools.cache
def _watch_eager_optimizer_steps() -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_before_eager_optimizer_step)


def shard_parameter(
    plan: ShardingPlan, binding: Binding, index: int, whole: Tensor | None = None, padded: Tensor | None = None
) -> None:
    """Replace parameter ``index`` by its sharded ``DTensor`` over ``padded`` (else cut from ``whole``, else from
    the parameter), on its modules and in the optimizers, and record the replacement on the old parameter."""
    record = binding.params[index]
    old = record.tensor
    spec = plan.specs[index]
    if padded is None:
        padded = pad_shard(old if whole is None else whole, spec, plan.rank)
    new = plan.wrap(padded, spec, requires_grad=old.requires_grad)
    if not old.requires_grad:
        new.requires_grad_(False)
    if old.grad is not None:
        new.grad = plan.wrap(pad_shard(old.grad, spec, plan.rank), spec) if plan.stage >= 2 else old.grad
    for module, attr in record.slots:
        module._parameters[attr] = new
    setattr(old, _REPLACED_BY, new)  # for optimizers this binding does not know (see adopt_sharded_parameters)
    for o in binding.optimizers:
        opt = o.optimizer
        for group in opt.param_groups:
            group["params"] = [new if p is old else p for p in group["params"]]
        if old in opt.state:
            opt.state[new] = opt.state.pop(old)
    binding.replace_param(index, new)


def release_shard(plan: ShardingPlan, param: DTensor, index: int) -> None:
    """Sharded parameter ``index`` (``param``, a zgraph ``DTensor``) made a meta ``DTensor`` of the same layout in
    place: the same object stays on its modules and in the optimizers; its shard's memory is given back."""
    spec = plan.specs[index]
    assert spec is not None
    meta = plan.wrap(torch.empty(spec.shard_shape, dtype=param.dtype, device="meta"), spec, requires_grad=True)
    padded = getattr(meta, _PADDED)
    swap_storage(param, meta.requires_grad_(param.requires_grad))
    setattr(param, _PADDED, padded)  # swap_storage kept the object's own attributes: the real shard's, until now


def normalize_state(plan: ShardingPlan, binding: Binding) -> None:
    """Store every gradient (stage ≥ 2) and optimizer state tensor (stage ≥ 1) of a parameter's shape as a
    zgraph DTensor over its padded shard (state created or loaded outside the graph is converted here)."""
    if not plan.group.distributed:
        return
    for record in binding.params:
        p = record.tensor
        if plan.stage >= 2 and p.grad is not None:
            spec = plan.state_spec(record.index, p.grad)
            if spec is not None and getattr(p.grad, _PADDED, None) is None:
                p.grad = plan.wrap(plan.padded(p.grad, spec), spec)
    for o in binding.optimizers:
        for indices in o.group_params:
            for i in indices:
                normalize_param_state(plan, binding, o.index, i)


def normalize_param_state(plan: ShardingPlan, binding: Binding, o_index: int, p_index: int) -> None:
    """``normalize_state`` for the optimizer state of one parameter (stage ≥ 1)."""
    if not plan.group.distributed or plan.stage < 1:
        return
    state = binding.optimizer_state(o_index, p_index)
    for key, value in list(state.items()):
        if not isinstance(value, Tensor):
            continue
        spec = plan.state_spec(p_index, value)
        if spec is not None and getattr(value, _PADDED, None) is None:
            state[key] = plan.wrap(plan.padded(value, spec), spec)


def graph_tensor(value: Tensor) -> Tensor:
    """The tensor a step graph reads for a piece of state: a zgraph DTensor's padded shard, else the tensor."""
    return getattr(value, _PADDED, value)


# --------------------------------------------------------------------------------- use outside the step
def _guard_outside_use(root: nn.Module) -> None:
    """Make a forward call of a stage-3 module outside the step (and outside ``zgraph.gather``) a clear error."""
    for module in root.modules():
        if getattr(module, "_zgraph_guarded", False) or not any(
            isinstance(p, DTensor) for p in module._parameters.values()
        ):
            continue
        module.register_forward_pre_hook(_raise_if_sharded)
        module._zgraph_guarded = True


def _raise_if_sharded(module: nn.Module, args: Any) -> None:
    for name, p in module._parameters.items():
        if isinstance(p, DTensor) and getattr(p, _PADDED, None) is not None:
            raise ShardedParameterError(
                f"{type(module).__name__}.{name} is sharded across ranks by a zgraph ZeRO-3 step; outside the "
                "compiled step its parameters are only whole inside `with zgraph.gather(model):`"
            )
