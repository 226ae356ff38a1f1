"""Whole tensors of sharded state, outside the compiled step: ``zgraph.gather`` (whole parameters on their device,
for use inside the block) and ``zgraph.full_state_dict`` (whole tensors in host memory, for export).

Both run collectives (all-gathers): call them on every rank, in the same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zgraph.ops import host_read
from zgraph.runtime.offload import materialize
from zgraph.runtime.sharded_state import pad_shard, sharding_of


def _whole(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


@contextlib.contextmanager
def gather(model: nn.Module) -> Iterator[nn.Module]:
    """Make ``model``'s parameters whole on every rank for the duration of the block.

    Inside, each parameter sharded by a ZeRO-3 step is a plain ``nn.Parameter`` holding the whole tensor, and
    each ``.grad`` a step left sharded (stage ≥ 2) is the whole gradient, so the model can be evaluated,
    inspected or edited like an ordinary module. On exit, parameters and gradients that were changed in the
    block (in place or replaced) are cut back into the shards; edits must be the same on every rank.
    Without zgraph sharding this does nothing. Parameter shards offloaded to files (``offload_params="nvme"``)
    are read back first.
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
        if not any(id(module) in owned for module, _ in record.slots):
            continue
        param = record.tensor
        if isinstance(param, DTensor):
            whole = nn.Parameter(param.full_tensor(), requires_grad=param.requires_grad)
            if param.grad is not None:
                whole.grad = _whole(param.grad)
            grad_version = None if whole.grad is None else whole.grad._version
            swaps.append((record, param, whole, whole._version, whole.grad, grad_version))
            for module, attr in record.slots:
                module._parameters[attr] = whole
        elif isinstance(param.grad, DTensor):
            sharded = param.grad
            param.grad = sharded.full_tensor()
            grads.append((param, sharded, param.grad, param.grad._version))
    try:
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


def _reshard_grad(plan: Any, spec: Any, whole: Tensor | None, current: Tensor | None) -> Tensor | None:
    if whole is None:
        return None
    if plan.stage < 2:
        return whole.detach()
    return plan.store(current, pad_shard(whole.detach(), spec, plan.rank), spec)


def full_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, rank0_only: bool = False
) -> dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]:
    """``model.state_dict()`` with every tensor whole, plain (not a DTensor) and in host memory, for export or
    comparison; with an ``optimizer``, also ``optimizer.state_dict()`` likewise: ``(model_state, optimizer_state)``.

    The result has the keys and layout of the eager model's and optimizer's own ``state_dict()``. Tensors are
    streamed: each sharded one is gathered whole on its device, copied to the host and freed before the next,
    so the device holds one whole tensor beyond the state at a time. Host tensors that are whole already are
    returned as they are (sharing memory, like ``state_dict()``); everything else is a new host tensor.

    ``rank0_only=True`` (as ``torch.distributed.checkpoint.state_dict``'s ``StateDictOptions(full_state_dict=True,
    cpu_offload=True)``): only rank 0 keeps the host copies; every other rank returns empty dicts — ``{}``, or
    ``({}, {})`` with an ``optimizer`` — and holds no more than the one tensor being gathered. Every rank must
    still call it (the gathers are collectives).
    """
    materialize(model)  # offloaded parameter shards (model.state_dict() would too, by its hook)
    keep = not rank0_only or _rank() == 0
    model_state = {}
    for key, value in model.state_dict().items():
        whole = _on_host(value, keep)
        if keep:
            model_state[key] = whole
    if optimizer is None:
        return model_state
    optim_state = optimizer.state_dict()
    state: dict[Any, dict[str, Any]] = {}
    for index, fields in optim_state["state"].items():
        state[index] = {}
        for key, v in fields.items():
            whole = _on_host(v, keep)
            if keep:
                state[index][key] = whole
    if not keep:
        return model_state, {}
    optim_state["state"] = state
    return model_state, optim_state


def _on_host(value: Any, keep: bool) -> Any:
    """``value`` whole on the host (a tensor gathered if sharded, then copied if on a device); None where
    ``keep`` is false (a sharded tensor is still gathered: every rank takes part)."""
    if not isinstance(value, Tensor):
        return value if keep else None
    whole = value.full_tensor() if isinstance(value, DTensor) else value.detach()
    if not keep:
        return None
    if whole.device.type == "cpu":
        return whole
    with host_read("full_state_dict: a whole tensor copied to the host"):
        return whole.to("cpu")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
