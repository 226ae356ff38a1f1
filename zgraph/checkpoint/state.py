"""What a zgraph checkpoint holds, and how it is matched against a model and optimizers: the DCP state dict and
manifest ``save`` writes, the checks ``load`` makes before reading, and the host staging tensors it reads into
(and how each becomes live state where torch.optim keeps it)."""

from __future__ import annotations

import datetime
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from zgraph.checkpoint.data import Encoder, rng_state
from zgraph.errors import CheckpointError
from zgraph.runtime.optimizers import unwrap_optimizer
from zgraph.runtime.sharded_state import sharding_of
from zgraph.runtime.stage_state import holders_by_id
from zgraph.version import __version__

FORMAT = "zgraph-checkpoint"
FORMAT_VERSION = 2

MODEL = "model."
DATA = "zgraph.data"  # tensors of the non-tensor values (extra, scheduler, hyper-parameters...), written by rank 0
RNG = "zgraph.rng."  # ``zgraph.rng.<rank>.<n>``: tensors of each rank's RNG states, written by that rank
# The attribute a zgraph step with ``Config.loss_scale`` keeps its loss-scale state in (zgraph/step.py), per optimizer
LOSS_SCALE_ATTR = "_zgraph_loss_scale"

OptimizerArg = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


# ------------------------------------------------------------------------------------------------ naming
def as_list(optimizer: OptimizerArg) -> list[torch.optim.Optimizer]:
    """The optimizers given, each a wrapper's wrapped optimizer (the one a zgraph step binds)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [unwrap_optimizer(optimizer)]
    return [unwrap_optimizer(opt) for opt in optimizer]


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` (a tied parameter gets its first name, as ``named_parameters()`` gives)."""
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_params(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def group_names(opt: torch.optim.Optimizer, names: dict[int, str], index: int) -> list[list[str]]:
    """The names of the optimizer's parameters, group by group."""
    out = []
    for g, group in enumerate(opt.param_groups):
        fqns = []
        for p_index, p in enumerate(group["params"]):
            if id(p) not in names:
                raise CheckpointError(
                    f"optimizer {index} ({type(opt).__name__}) holds a tensor of shape {tuple(p.shape)} (param_groups"
                    f"[{g}]['params'][{p_index}]) that is not a parameter of the model: checkpoints name optimizer "
                    "state after the model's parameters"
                )
            fqns.append(names[id(p)])
        out.append(fqns)
    return out


# ------------------------------------------------------------------------------------------------ saving
def saved_state(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    scheduler: Any,
    extra: Mapping[str, Any] | None,
    rank: int,
    world: int,
) -> tuple[dict[str, Tensor], dict[str, Any], Any]:
    """``(tensors, manifest, rng)``: the DCP state dict this rank writes, the manifest (rank 0's is written) and
    this rank's RNG states as a tree. Whole tensors are written by rank 0 only (a pipelined step's parameters and
    their state by the rank holding them, whole: gathered first where ZeRO shards them within the stage's
    data-parallel group), ``DTensor`` shards by every rank.
    Raises ``CheckpointError`` for a value that cannot be stored as data, before anything is written."""
    names = parameter_names(model)
    tensors: dict[str, Tensor] = {}
    data = Encoder(DATA, tensors)
    model_state = model.state_dict()
    model_values = {}
    for key, value in model_state.items():
        if isinstance(value, Tensor) and not isinstance(value, DTensor) and type(value) not in (Tensor, nn.Parameter):
            raise CheckpointError(f"cannot save model[{key!r}]: a {type(value).__name__}")
        if isinstance(value, Tensor):
            tensors[MODEL + key] = value
        else:
            model_values[key] = data.encode(value, f"model.state_dict()[{key!r}]")
    optimizers_out = [_saved_optimizer(opt, i, names, tensors, data) for i, opt in enumerate(optimizers)]
    scheduler_tree = data.encode(scheduler.state_dict(), "scheduler.state_dict()") if scheduler is not None else None
    extra_tree = data.encode(dict(extra), "extra") if extra is not None else None
    rng = Encoder(f"{RNG}{rank}", tensors).encode(rng_state(), f"rank {rank}'s RNG state")
    held = _held_keys(model, optimizers, names, tensors)
    # a pipelined step's state sharded within its stage's data-parallel group (ZeRO >= 1): gathered whole there
    tensors = {k: v.full_tensor() if k in held and isinstance(v, DTensor) else v for k, v in tensors.items()}
    tensors = {k: v for k, v in tensors.items() if _writes(k, v, rank, held)}
    found = sharding_of(model)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "zgraph_version": __version__,
        "torch_version": torch.__version__,
        "world_size": world,
        "stage": found[0].stage if found is not None else None,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_keys": list(model_state),
        "model_values": model_values,
        "optimizers": optimizers_out,
        "scheduler": scheduler_tree,
        "extra": extra_tree,
    }
    return tensors, manifest, rng


def _writes(key: str, value: Tensor, rank: int, held: dict[str, int]) -> bool:
    """Whether this rank writes ``key``: a ``DTensor``'s shard, its own RNG states, a pipelined step's
    parameter (and its state) on the rank holding it, any other whole tensor on rank 0 (written once)."""
    if key in held:
        return held[key] == rank
    return rank == 0 or isinstance(value, DTensor) or key.startswith(f"{RNG}{rank}.")


def _held_keys(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], names: dict[int, str], tensors: dict[str, Tensor]
) -> dict[str, int]:
    """The keys of ``tensors`` a pipelined step's parameters hold, with the rank holding each (its stage's)."""
    found = sharding_of(model)
    by_id = holders_by_id(found[1]) if found is not None else {}
    if not by_id:
        return {}
    held = {MODEL + n: by_id[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in by_id}
    for i, opt in enumerate(optimizers):
        by_name = {names[id(p)]: by_id[id(p)] for p in optimizer_params(opt) if id(p) in by_id}
        prefix = f"optim.{i}.state."
        for key in tensors:
            split = split_state_key(key[len(prefix) :], set(by_name)) if key.startswith(prefix) else None
            if split is not None:
                held[key] = by_name[split[0]]
    return held


def _saved_optimizer(
    opt: torch.optim.Optimizer, i: int, names: dict[int, str], tensors: dict[str, Tensor], data: Encoder
) -> dict[str, Any]:
    """Optimizer ``i``'s entry in the manifest; its state tensors go into ``tensors`` (DCP keys by parameter
    name), its other values are encoded as data."""
    fqn_groups = group_names(opt, names, i)
    values = {}
    for param, fqn in zip(optimizer_params(opt), (f for g in fqn_groups for f in g)):
        for field, value in opt.state.get(param, {}).items():
            key = f"optim.{i}.state.{fqn}.{field}"
            if isinstance(value, Tensor):
                tensors[key] = value
            else:
                values[key] = data.encode(value, f"optimizer {i} state[{fqn!r}][{field!r}]")
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
    loss_scale = getattr(opt, LOSS_SCALE_ATTR, None)
    return {
        "class": type(opt).__name__,
        "param_groups": fqn_groups,
        "hyper": data.encode(hyper, f"optimizer {i} param_groups"),
        "state_values": values,
        "loss_scale": data.encode(dict(loss_scale), f"optimizer {i} loss scale") if loss_scale else None,
    }


# ------------------------------------------------------------------------------------------------ checking
def check_model(model_state: dict[str, Any], metadata: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Raise ``CheckpointError`` listing every key of the model the checkpoint lacks, every model key of the
    checkpoint the model lacks, and every key whose shape differs."""
    saved: dict[str, Any] = {key: None for key in manifest.get("model_values", {})}
    saved.update({key[len(MODEL) :]: meta for key, meta in metadata.items() if key.startswith(MODEL)})
    missing = [key for key in model_state if key not in saved]
    unexpected = [key for key in saved if key not in model_state]
    misshaped = []
    for key, value in model_state.items():
        if key not in saved:
            continue
        meta = saved[key]
        if isinstance(value, Tensor) != (meta is not None) or (
            meta is not None and tuple(meta.size) != tuple(value.shape)
        ):
            here = str(tuple(value.shape)) if isinstance(value, Tensor) else "a non-tensor value"
            there = str(tuple(meta.size)) if meta is not None else "a non-tensor value"
            misshaped.append(f"{key}: checkpoint {there}, model {here}")
    if missing or unexpected or misshaped:
        raise CheckpointError(mismatch_message("the model", missing, unexpected, misshaped))


def mismatch_message(what: str, missing: list[str], unexpected: list[str], misshaped: list[str]) -> str:
    lines = [f"the checkpoint does not match {what}; nothing was loaded"]
    if missing:
        lines.append(f"missing in the checkpoint ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        lines.append(f"unexpected (in the checkpoint, not in {what}) ({len(unexpected)}): " + ", ".join(unexpected))
    if misshaped:
        lines.append(f"shape mismatch ({len(misshaped)}):\n  " + "\n  ".join(misshaped))
    return "\n".join(lines)


def check_optimizers(
    optimizers: list[torch.optim.Optimizer], names: dict[int, str], manifest: dict, metadata: dict[str, Any]
) -> None:
    """Raise ``CheckpointError`` if an optimizer's class, parameters or param groups differ from the saved."""
    saved = manifest.get("optimizers", [])
    if len(optimizers) > len(saved):
        raise CheckpointError(f"{len(optimizers)} optimizer(s) given, the checkpoint holds {len(saved)}")
    for i, opt in enumerate(optimizers):
        if saved[i].get("class") != type(opt).__name__:
            raise CheckpointError(
                f"optimizer {i} is a {type(opt).__name__}, the checkpoint holds the state of a "
                f"{saved[i].get('class')}; nothing was loaded"
            )
        groups = group_names(opt, names, i)
        saved_groups = saved[i]["param_groups"]
        if groups != saved_groups:
            here = {f for g in groups for f in g}
            there = {f for g in saved_groups for f in g}
            missing = [f for g in groups for f in g if f not in there]
            unexpected = [f for g in saved_groups for f in g if f not in here]
            detail = mismatch_message(f"optimizer {i}'s parameters", missing, unexpected, [])
            raise CheckpointError(
                f"{detail}\nparam_groups: checkpoint {[len(g) for g in saved_groups]} parameters per group, "
                f"optimizer {[len(g) for g in groups]}"
            )
        prefix = f"optim.{i}.state."
        fqns = {f for g in groups for f in g}
        keys = [key for key in metadata if key.startswith(prefix)] + list(saved[i].get("state_values", {}))
        unexpected = [key for key in keys if split_state_key(key[len(prefix) :], fqns) is None]
        if unexpected:
            raise CheckpointError(mismatch_message(f"optimizer {i}'s parameters", [], unexpected, []))


def split_state_key(rest: str, fqns: set[str]) -> tuple[str, str] | None:
    """``"l1.weight.exp_avg" -> ("l1.weight", "exp_avg")`` for a known parameter name, else None."""
    cut = rest.rfind(".")
    while cut > 0:
        if rest[:cut] in fqns:
            return rest[:cut], rest[cut + 1 :]
        cut = rest.rfind(".", 0, cut)
    return None


# ------------------------------------------------------------------------------------------------ staging
# ``load`` reads into staging tensors in host memory (plain CPU tensors; for a ``DTensor``, a ``DTensor`` of the
# same layout whose local tensor is on the host, so DCP reads this rank's chunks into it) and only at commit
# copies them into the model's and optimizer's tensors on their device, one tensor at a time: the device never
# holds the model and optimizer state twice.
def host_like(t: Tensor) -> Tensor:
    """An empty host tensor to read ``t``'s saved value into: of ``t``'s shape and dtype (for a ``DTensor``, a
    ``DTensor`` with ``t``'s layout over a local tensor on the host). Nothing is allocated on ``t``'s device."""
    if isinstance(t, DTensor):
        return DTensor(torch.empty(t._local_tensor.shape, dtype=t.dtype), t._spec, requires_grad=False)
    return torch.empty(t.shape, dtype=t.dtype)


def _host_dtensor(local: Tensor, mesh: Any, placements: Sequence[Any], shape: Sequence[int]) -> DTensor:
    """A ``DTensor`` of global ``shape`` laid out by ``placements`` over ``mesh`` whose local tensor is ``local``,
    on the host whatever the mesh's device (``DTensor.from_local`` would copy it to the mesh's device)."""
    stride, step = [], 1
    for n in reversed(shape):  # contiguous strides, as the tensor's whole would have
        stride.insert(0, step)
        step *= max(n, 1)
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def model_targets(model_state: dict[str, Any], elsewhere: Collection[str] = ()) -> dict[str, Tensor]:
    """Empty host tensors like the model's (``DTensor`` for a ``DTensor``: same shards), to read into; none for
    the keys ``elsewhere`` (parameters another pipeline stage's rank holds and reads)."""
    return {MODEL + k: host_like(v) for k, v in model_state.items() if isinstance(v, Tensor) and k not in elsewhere}


@dataclass
class Staged:
    """An optimizer state tensor read into host memory, and the layout it takes as live state.

    Attributes:
        host: what DCP reads into: a host tensor, or a ``DTensor`` over host memory.
        device: the parameter's device, where the state goes (but see ``keeps_on_host``).
        plan, spec, padded: for a zgraph shard, the sharding plan and spec, and the padded host shard whose
            first rows ``host``'s local tensor is (the padding rows are zeros).
    """

    host: Tensor
    device: torch.device
    plan: Any = None
    spec: Any = None
    padded: Tensor | None = None

    def live(self, current: Any, on_host: bool) -> Tensor:
        """The state tensor this becomes. On the host (``on_host``, or a host parameter) the staging tensor
        itself; on a device, copied into ``current`` (the optimizer's state tensor now) where it has the same
        layout, else into a new tensor on the device."""
        device = torch.device("cpu") if on_host and not isinstance(self.host, DTensor) else self.device
        if device.type == "cpu":
            return self.plan.wrap(self.padded, self.spec) if self.plan is not None else self.host
        with torch.no_grad():
            if _same_layout(current, self.host, device):
                _local(current).copy_(_local(self.host))
                return current
            if self.plan is not None:
                padded = torch.empty(self.padded.shape, dtype=self.padded.dtype, device=device)
                padded.copy_(self.padded)
                return self.plan.wrap(padded, self.spec)
            if isinstance(self.host, DTensor):
                local = torch.empty(self.host._local_tensor.shape, dtype=self.host.dtype, device=device)
                local.copy_(self.host._local_tensor)
                return DTensor(local, self.host._spec, requires_grad=False)
            return self.host.to(device, copy=True)


def keeps_on_host(field: str, group: Mapping[str, Any]) -> bool:
    """True for the optimizer state torch.optim keeps on the host whatever the parameter's device: ``step``
    (a 0-d CPU tensor), unless the param group is ``capturable`` or ``fused`` (then on the parameter's device) —
    the rule of ``torch.optim.Optimizer.load_state_dict``. Every other field lives on the parameter's device."""
    return field == "step" and not (group.get("capturable") or group.get("fused"))


def _same_layout(current: Any, host: Tensor, device: torch.device) -> bool:
    """Whether ``current`` can take ``host``'s value in place: same kind (``DTensor`` or not), shape, dtype and
    local shape, and on ``device`` (a ``DTensor`` with the same placements)."""
    if not isinstance(current, Tensor) or isinstance(current, DTensor) != isinstance(host, DTensor):
        return False
    if current.shape != host.shape or current.dtype != host.dtype or _local(current).device != device:
        return False
    if isinstance(host, DTensor) and tuple(current.placements) != tuple(host.placements):
        return False
    return _local(current).shape == _local(host).shape


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def state_targets(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    index: int,
    names: dict[int, str],
    metadata: dict[str, Any],
    elsewhere: Collection[int] = (),
) -> tuple[dict[str, Tensor], dict[Tensor, dict[str, Any]]]:
    """``(targets, new_state)``: host tensors to read the optimizer's new state into, and per parameter its
    fields as ``Staged``: for each saved field a zero tensor of the saved shape, in the dtype of the optimizer's
    current state (the saved dtype if it has none yet), laid out as zgraph keeps that state now (a padded shard
    when sharded, else whole). Nothing is allocated on the device: ``Staged.live`` moves them there at commit.
    ``elsewhere``: ``id`` of parameters another pipeline stage's rank holds (their state stays meta here)."""
    found = sharding_of(model)
    bound = found is not None and any(o.optimizer is opt for o in found[1].optimizers)
    prefix = f"optim.{index}.state."
    by_name = {names[id(p)]: p for p in optimizer_params(opt)}
    fqns = set(by_name)
    targets: dict[str, Tensor] = {}
    new_state: dict[Tensor, dict[str, Any]] = {}
    for key, meta in metadata.items():
        if not key.startswith(prefix):
            continue
        fqn, field = split_state_key(key[len(prefix) :], fqns)
        param = by_name[fqn]
        staged = None
        size, dtype = tuple(meta.size), meta.properties.dtype
        live = opt.state[param].get(field) if param in opt.state else None
        if isinstance(live, Tensor) and tuple(live.shape) == size:
            dtype = live.dtype  # the dtype the run keeps this state in (Config.optimizer_state_dtype)
        if id(param) in elsewhere:  # another pipeline stage's parameter: its holder reads the state, here meta
            new_state.setdefault(param, {})[field] = torch.empty(size, dtype=dtype, device="meta")
            continue
        device = _local(param).device
        if bound and size == tuple(param.shape):
            plan, binding = found
            p_index = binding.param_index(param)
            spec = plan.specs[p_index] if p_index is not None else None
            if plan.group.distributed and plan.stage >= 1 and spec is not None and spec.shape == size:
                padded = torch.zeros(spec.shard_shape, dtype=dtype)
                local = padded[: spec.local_rows(plan.rank)]
                host = _host_dtensor(local, plan.mesh, plan.placements, spec.shape)
                staged = Staged(host, device, plan, spec, padded)
        if staged is None and isinstance(param, DTensor) and size == tuple(param.shape):
            local = torch.zeros(param._local_tensor.shape, dtype=dtype)
            staged = Staged(_host_dtensor(local, param.device_mesh, param.placements, size), device)
        if staged is None:
            staged = Staged(torch.zeros(size, dtype=dtype), device)
        targets[key] = staged.host
        new_state.setdefault(param, {})[field] = staged
    return targets, new_state
