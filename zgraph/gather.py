"""Whole tensors of sharded state, outside the compiled step: ``zgraph.gather`` and ``zgraph.full_state_dict``.

Both run collectives (all-gathers): call them on every rank, in the same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

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
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Tensor] | tuple[dict[str, Tensor], dict[str, Any]]:
    """``model.state_dict()`` with every tensor whole and plain (not a DTensor), for export or comparison;
    with an ``optimizer``, also ``optimizer.state_dict()`` likewise: ``(model_state, optimizer_state)``.

    The result has the keys and layout of the eager model's and optimizer's own ``state_dict()``; like
    ``state_dict()``, tensors that are whole already are returned as they are (sharing memory), gathered ones are
    new.
    """
    materialize(model)  # offloaded parameter shards (model.state_dict() would too, by its hook)
    model_state = {key: _whole(value) for key, value in model.state_dict().items()}
    if optimizer is None:
        return model_state
    optim_state = optimizer.state_dict()
    optim_state["state"] = {
        index: {key: _whole(v) if isinstance(v, Tensor) else v for key, v in state.items()}
        for index, state in optim_state["state"].items()
    }
    return model_state, optim_state
