"""Whole tensors of sharded state, outside the compiled step: ``zgraph.gather`` (whole parameters on their device,
for use inside the block), ``zgraph.full_state_dict`` (whole tensors in host memory, for export) and
``zgraph.stream_state_dict`` (the same, one tensor at a time).

All run collectives (gathers): call them on every rank, in the same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from zgraph.ops import host_read
from zgraph.runtime.offload import materialize
from zgraph.runtime.optimizers import unwrap_optimizer
from zgraph.runtime.sharded_state import pad_shard, sharding_of
from zgraph.runtime.stage_state import fetch, holders_by_id


def _whole(t: Tensor) -> Tensor:
    """``t`` whole (gathered where sharded; a shard in host memory, the update on the host's, whole in host memory)."""
    if not isinstance(t, DTensor):
        return t.detach()
    whole = on_mesh_device(t).full_tensor()
    if whole.device == t._local_tensor.device:
        return whole
    with host_read("zgraph.gather: a shard in host memory gathered whole"):
        return whole.to(t._local_tensor.device)


def on_mesh_device(t: DTensor) -> DTensor:
    """``t``, or, where its shard is in host memory and its mesh on a device (the update on the host keeps its
    state there), a copy of the shard on that device: the collectives that gather it run there, one tensor at a
    time."""
    local, device_type = t._local_tensor, t.device_mesh.device_type
    if local.device.type == device_type or device_type == "cpu":
        return t
    return DTensor(local.to(device_type), t._spec, requires_grad=False)


@contextlib.contextmanager
def gather(model: nn.Module) -> Iterator[nn.Module]:
    """Make ``model``'s parameters whole on every rank for the duration of the block.

    Inside, each parameter sharded by a ZeRO-3 step is a plain ``nn.Parameter`` holding the whole tensor, and
    each ``.grad`` a step left sharded (stage ≥ 2) is the whole gradient, so the model can be evaluated,
    inspected or edited like an ordinary module. On exit, parameters and gradients that were changed in the
    block (in place or replaced) are cut back into the shards; edits must be the same on every rank.
    Without zgraph sharding this does nothing. Parameter shards offloaded to files (``offload_params="nvme"``)
    are read back first. A pipelined step's parameters of other ranks' stages are received from the rank holding
    them and dropped again on exit (edits count on that rank: the same on every rank, as said).
    """
    materialize(model)
    found = sharding_of(model)
    if found is None or not found[0].group.distributed:
        yield model
        return
    plan, binding = found
    owned = {id(m) for m in model.modules()}
    swaps = []  # (record, sharded param, whole param, versions at entry)
    grads = []  # (param, sharded grad, whole grad) for whole parameters with sharded grads (stage 2)
    for record in binding.params:
        param = record.tensor
        # a pipelined step's parameters come whole from their holders (_other_stages), except a stage-3 shard held
        # here: gathered as any sharded parameter (and cut back into the shard on exit)
        pipelined = record.index in binding.holders and not (isinstance(param, DTensor) and not param.is_meta)
        if not any(id(module) in owned for module, _ in record.slots) or pipelined:
            continue
        if isinstance(param, DTensor):
            whole = nn.Parameter(_whole(param), requires_grad=param.requires_grad)
            if param.grad is not None:
                whole.grad = _whole(param.grad)
            grad_version = None if whole.grad is None else whole.grad._version
            swaps.append((record, param, whole, whole._version, whole.grad, grad_version))
            for module, attr in record.slots:
                module._parameters[attr] = whole
        elif isinstance(param.grad, DTensor):
            sharded = param.grad
            param.grad = _whole(sharded)
            grads.append((param, sharded, param.grad, param.grad._version))
    try:
        with _other_stages(binding, owned):
            yield model
    finally:
        for record, param, whole, version, grad, grad_version in swaps:
            spec = plan.specs[record.index]
            current = record.slots[0][0]._parameters[record.slots[0][1]]
            if current is not whole or whole._version != version:
                plan.store(param, pad_shard(current.detach(), spec, plan.rank), spec)
            new_grad = current.grad
            if new_grad is not grad or (grad is not None and grad._version != grad_version):
                param.grad = _reshard_grad(plan, spec, new_grad, param.grad)
            for module, attr in record.slots:
                module._parameters[attr] = param
        for param, sharded, whole, version in grads:
            index = binding.param_index(param)
            spec = plan.specs[index]
            if param.grad is whole and whole._version == version:
                param.grad = sharded
            else:
                param.grad = _reshard_grad(plan, spec, param.grad, sharded)


@contextlib.contextmanager
def _other_stages(binding: Any, owned: set[int]) -> Iterator[None]:
    """A pipelined step's parameters of other ranks' stages whole for the block, received from the ranks holding
    them (which take part with their own), and released again after."""
    elsewhere = []  # (record, released parameter)
    for record in binding.params:
        holder = binding.holders.get(record.index)
        if holder is None or not any(id(module) in owned for module, _ in record.slots):
            continue
        param = record.tensor
        value = fetch(param, holder, binding)
        if param.is_meta:
            elsewhere.append((record, param))
            for module, attr in record.slots:
                module._parameters[attr] = nn.Parameter(value, requires_grad=param.requires_grad)
    try:
        yield
    finally:
        for record, param in elsewhere:
            for module, attr in record.slots:
                module._parameters[attr] = param


def _reshard_grad(plan: Any, spec: Any, whole: Tensor | None, current: Tensor | None) -> Tensor | None:
    if whole is None:
        return None
    if plan.stage < 2:
        return whole.detach()
    return plan.store(current, pad_shard(whole.detach(), spec, plan.rank), spec)


def stream_state_dict(model: nn.Module, *, rank0_only: bool = False) -> Iterator[tuple[str, Any]]:
    """``model.state_dict()`` one entry at a time, each tensor whole, plain and in host memory: yields
    ``(key, value)`` in ``state_dict()`` order, gathering a sharded tensor only when its turn comes, so that a
    caller that drops each value before taking the next holds one whole tensor at a time (``full_state_dict``
    keeps them all).

    Every rank must iterate it to the end, in step (each sharded tensor is a collective). ``rank0_only=True``:
    each sharded tensor is gathered to rank 0 alone (the other ranks send their shard and hold nothing more), and
    the other ranks get ``(key, None)`` for every entry. Host tensors that are whole already are yielded as they
    are (sharing memory, like ``state_dict()``).
    """
    materialize(model)  # offloaded parameter shards (model.state_dict() would too, by its hook)
    whole = entry_on_host(model, rank0_only=rank0_only)
    for key, value in model.state_dict().items():
        yield key, whole(key, value)


def entry_on_host(model: nn.Module, *, rank0_only: bool = False) -> Callable[[str, Any], Any]:
    """``whole(key, value)``: an entry of ``model.state_dict()`` whole on the host (``whole_on_host``; a pipelined
    step's parameter received from the rank holding it). Collective, as ``whole_on_host``."""
    held = _held(model)

    def whole(key: str, value: Any) -> Any:
        return whole_on_host(_from_holder(value, held.get(key), model, rank0_only), rank0_only=rank0_only)

    return whole


def _held(model: nn.Module) -> dict[str, int]:
    """The holder of each parameter (by name) a pipelined step placed; empty without one."""
    found = sharding_of(model)
    by_id = holders_by_id(found[1]) if found is not None else {}
    if not by_id:
        return {}
    named = model.named_parameters(remove_duplicate=False)
    return {name: by_id[id(p)] for name, p in named if id(p) in by_id}


def _from_holder(value: Any, holder: int | None, model: nn.Module, rank0_only: bool) -> Any:
    """``value`` whole from the rank holding it (a pipelined step's parameter or its state): on every rank, or
    with ``rank0_only`` on rank 0 (None elsewhere); as it is without a holder."""
    if holder is None or not isinstance(value, Tensor):
        return value
    found = sharding_of(model)
    assert found is not None
    return fetch(value, holder, found[1], to=0 if rank0_only else None)


def full_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, rank0_only: bool = False
) -> dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]:
    """``model.state_dict()`` with every tensor whole, plain (not a DTensor) and in host memory, for export or
    comparison; with an ``optimizer``, also ``optimizer.state_dict()`` likewise: ``(model_state, optimizer_state)``.

    The result has the keys and layout of the eager model's and optimizer's own ``state_dict()``. Tensors are
    streamed (``stream_state_dict``): each sharded one is gathered whole on its device, copied to the host and
    freed before the next, so the device holds one whole tensor beyond the state at a time. Host tensors that are
    whole already are returned as they are (sharing memory, like ``state_dict()``); everything else is a new host
    tensor.

    ``rank0_only=True`` (as ``torch.distributed.checkpoint.state_dict``'s ``StateDictOptions(full_state_dict=True,
    cpu_offload=True)``): only rank 0 keeps the host copies; every other rank returns empty dicts — ``{}``, or
    ``({}, {})`` with an ``optimizer`` — and holds no more than its own shard of the tensor being gathered. Every
    rank must still call it (the gathers are collectives).
    """
    keep = not rank0_only or _rank() == 0
    model_state = {key: value for key, value in stream_state_dict(model, rank0_only=rank0_only) if keep}
    if optimizer is None:
        return model_state
    # a wrapper's is the wrapped optimizer's, the one a zgraph step binds (zgraph.runtime.optimizers)
    opt = unwrap_optimizer(optimizer)
    optim_state = opt.state_dict()
    found = sharding_of(model)
    by_id = holders_by_id(found[1]) if found is not None else {}
    params = [p for group in opt.param_groups for p in group["params"]]  # state_dict()'s numbering
    state: dict[Any, dict[str, Any]] = {}
    for index, fields in optim_state["state"].items():
        state[index] = {}
        holder = by_id.get(id(params[index]))
        for key, v in fields.items():
            whole = whole_on_host(_from_holder(v, holder, model, rank0_only), rank0_only=rank0_only)
            if keep:
                state[index][key] = whole
    if not keep:
        return model_state, {}
    optim_state["state"] = state
    return model_state, optim_state


def whole_on_host(value: Any, *, rank0_only: bool = False) -> Any:
    """``value`` whole on the host: a sharded tensor gathered (a collective: every rank calls it), then copied to
    the host if on a device; a whole host tensor as it is. ``rank0_only``: a ``Shard(0)`` tensor is gathered to
    rank 0 alone, and every other rank gets None."""
    keep = not rank0_only or _rank() == 0
    if not isinstance(value, Tensor):
        return value if keep else None
    if isinstance(value, DTensor):
        value = on_mesh_device(value)
        whole = _gathered_to_rank0(value) if rank0_only else _NOT_SHARD0
        if whole is _NOT_SHARD0:
            whole = value.full_tensor()
    else:
        whole = value.detach()
    if not keep or whole is None:
        return None
    if whole.device.type == "cpu":
        return whole
    with host_read("full_state_dict: a whole tensor copied to the host"):
        return whole.to("cpu")


_NOT_SHARD0: Any = object()


def _gathered_to_rank0(t: DTensor) -> Tensor | None:
    """``t`` whole on global rank 0 (None elsewhere), by a gather of the ranks' row blocks padded to equal size
    (hybrid sharding's ``(Replicate(), Shard(0))``: within rank 0's shard group; the other groups hold copies);
    ``_NOT_SHARD0`` when ``t`` is not cut that way (not ``Shard(0)`` on a 1-D mesh holding rank 0)."""
    mesh = t.device_mesh
    if mesh.ndim == 2 and tuple(t.placements) == (Replicate(), Shard(0)):
        group = mesh.get_group(1)
        if 0 not in dist.get_process_group_ranks(group):
            return None  # a copy of what rank 0's shard group gathers
    elif mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        return _NOT_SHARD0
    else:
        group = mesh.get_group()
    ranks = dist.get_process_group_ranks(group)
    if 0 not in ranks:
        return _NOT_SHARD0
    world, shape = len(ranks), tuple(t.shape)
    rows = -(-shape[0] // world)  # torch.chunk's cut, and zgraph's ShardSpec
    local = t._local_tensor.detach()
    if rows == 0:
        return local.new_empty(shape) if _rank() == 0 else None
    block = local.contiguous()
    if local.shape[0] != rows:
        block = local.new_zeros((rows, *shape[1:]))
        block[: local.shape[0]].copy_(local)
    if _rank() != 0:
        dist.gather(block, None, group=group, group_dst=ranks.index(0))
        return None
    out = local.new_empty((world * rows, *shape[1:]))
    dist.gather(block, list(out.chunk(world)), group=group, group_dst=ranks.index(0))
    return out[: shape[0]]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
