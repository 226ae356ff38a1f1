"""Pipeline parallelism's state: each rank holds only its own stages' parameters, gradients and optimizer state.

Once a pipelined step is compiled (``zgraph.compile.pipeline``), ``Binding.holders`` maps every parameter to the
global rank running its stage in the first pipeline, and every parameter of a stage this rank does not run is
released on this rank: the parameter object stays in its module and optimizer (the same object, shape, dtype and
``requires_grad``) but its storage becomes meta (at ZeRO stage 3, a ``DTensor`` shard: a meta ``DTensor`` of the
same layout), as do its ``.grad`` and its optimizer state tensors. What the step
reads and writes on a rank is its own stages' state, so a rank keeps its stages' share of the model state. Buffers
stay whole on every rank (every stage may read those the step does not update).

Whole tensors outside the step come from their holder (``fetch``: a broadcast, or a send to one rank), for
``zgraph.gather``, ``zgraph.full_state_dict`` and ``zgraph.save_pretrained``; ``zgraph.save`` writes each
parameter's tensors from its holder's rank; ``zgraph.load`` and ``zgraph.load_pretrained`` read on each rank its
own stages' tensors (``held_elsewhere``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zgraph.graph import GraphOutput
from zgraph.runtime.meta_init import swap_storage
from zgraph.runtime.sharded_state import release_shard, sharding_of
from zgraph.runtime.state import Binding


def release_other_stages(binding: Binding, holders: dict[int, int], mine: set[int]) -> None:
    """Record ``holders`` (parameter index -> the global rank that gives its values: its stage's in the first
    pipeline) and release every parameter not in ``mine`` (the indices of this rank's stages): the parameter, its
    ``.grad`` and its optimizer state become meta tensors."""
    binding.holders = dict(holders)
    for index in holders:
        if index in mine:
            continue
        p = binding.params[index].tensor
        if p.grad is not None and not p.grad.is_meta:
            p.grad = _meta_like(p.grad)
        if isinstance(p, DTensor) and not p.is_meta:  # ZeRO stage 3: the shard, as a meta DTensor
            release_shard(binding.plan, p, index)
        elif not p.is_meta:
            swap_storage(p, _meta_like(p))
        for o in binding.optimizers:
            state = o.optimizer.state.get(p)
            for key, value in (state or {}).items():
                if isinstance(value, Tensor) and not value.is_meta:
                    state[key] = _meta_like(value)


def released_state(binding: Binding, written: Iterable[tuple[GraphOutput, torch.Size, torch.dtype]]) -> None:
    """After a step whose other stages' updates leave ``written`` set on the ranks holding them (a ``.grad`` kept by
    ``zero_grad(set_to_none=False)``, optimizer state made in the first step, as SGD's momentum buffers): a meta
    tensor here where there is none, so that every rank binds the same state (the ranks' next graphs then read the
    same state, each its own stages' for real)."""
    for role, shape, dtype in written:
        p = binding.params[role.index].tensor
        if role.kind == "grad" and p.grad is None:
            p.grad = torch.empty(shape, dtype=dtype, device="meta")
        elif role.kind == "opt_state":
            state = binding.optimizers[role.optimizer].optimizer.state[p]
            if role.field not in state:
                state[role.field] = torch.empty(shape, dtype=dtype, device="meta")


def _meta_like(t: Tensor) -> Tensor:
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta


def holders_by_id(binding: Binding) -> dict[int, int]:
    """``id(parameter) -> holder`` of every parameter a pipelined step placed (empty without one)."""
    return {id(binding.params[index].tensor): owner for index, owner in binding.holders.items()}


def fetch(value: Tensor, owner: int, binding: Binding, to: int | None = None) -> Tensor | None:
    """The whole ``value`` (a tensor of a parameter ``owner`` holds: real there, meta elsewhere; at ZeRO stage >= 1
    a ``DTensor`` shard on every rank of its stage's data-parallel group, which gathers it first), received from
    ``owner`` on the binding's device: broadcast to every rank of the step's group (each calls it at the same
    point), or with ``to`` (a global rank), sent to that rank alone (None on the others)."""
    me = dist.get_rank()
    if isinstance(value, DTensor) and not value.is_meta:  # a meta one (released here) has nothing to gather
        value = value.full_tensor()
    if to is not None and me not in (to, owner):
        return None
    group = dist.distributed_c10d._resolve_process_group(binding.plan.group.group_name)
    if me == owner:
        buffer = value.detach().contiguous()
    else:
        buffer = torch.empty(value.shape, dtype=value.dtype, device=binding.device)
    if to is None:
        dist.broadcast(buffer, owner, group=group)
    elif to != owner:
        if me == owner:
            dist.send(buffer, to, group=group)
            return None
        dist.recv(buffer, owner, group=group)
    elif me != to:
        return None
    return buffer


def held_elsewhere(model: nn.Module) -> dict[str, Tensor]:
    """The parameters of ``model`` a pipelined step placed on other ranks (meta here), by name: a load reads
    neither them nor their optimizer state on this rank (their holder does)."""
    found = sharding_of(model)
    if found is None or not found[1].holders:
        return {}
    ids = {id(found[1].params[i].tensor) for i in found[1].holders if found[1].params[i].tensor.is_meta}
    return {name: p for name, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}
