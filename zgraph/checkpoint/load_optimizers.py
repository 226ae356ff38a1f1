"""What ``load`` puts into the optimizers: the hyper-parameters, non-tensor state and loss scale decoded from
the manifest, checked before anything is changed, and at commit the staged state put where torch.optim keeps it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zgraph.checkpoint.state import LOSS_SCALE_ATTR, Staged, keeps_on_host, optimizer_params, split_state_key
from zgraph.errors import CheckpointError


def check_optimizer_values(
    optimizers: list[torch.optim.Optimizer],
    names: dict[int, str],
    values: list[Any],
    new_states: list[dict[Tensor, dict[str, Any]]],
) -> list[tuple[list[dict], dict | None]]:
    """Check the decoded hyper-parameters, non-tensor state and loss scale of each optimizer; put the state into
    ``new_states``; returns ``(hyper, loss_scale)`` per optimizer."""
    out = []
    for i, (opt, (hyper, state_values, loss_scale)) in enumerate(zip(optimizers, values)):
        if (
            not isinstance(hyper, list)
            or len(hyper) != len(opt.param_groups)
            or not all(isinstance(g, dict) and "params" not in g for g in hyper)
            or not isinstance(state_values, dict)
            or not (loss_scale is None or isinstance(loss_scale, dict))
        ):
            raise CheckpointError(f"malformed state of optimizer {i} in the checkpoint's manifest")
        by_name = {names[id(p)]: p for p in optimizer_params(opt)}
        prefix = f"optim.{i}.state."
        for key, value in state_values.items():
            fqn, field = split_state_key(key[len(prefix) :], set(by_name))
            new_states[i].setdefault(by_name[fqn], {})[field] = value
        out.append((hyper, loss_scale))
    return out


def commit_optimizers(
    optimizers: list[torch.optim.Optimizer],
    new_states: list[dict[Tensor, dict[str, Any]]],
    optimizer_values: list[tuple[list[dict], dict | None]],
) -> None:
    """Commit of ``load``, per optimizer: the saved hyper-parameters into its param groups, the staged state into
    ``optimizer.state`` (each tensor where torch.optim keeps it), the loss-scale state."""
    for opt, new_state, (hyper, loss_scale) in zip(optimizers, new_states, optimizer_values):
        for group, saved in zip(opt.param_groups, hyper):
            group.update(saved)  # first: `capturable` / `fused` say where `step` goes, as in torch.optim
        for group in opt.param_groups:
            for param in group["params"]:
                current = opt.state.pop(param, None) or {}
                if param not in new_state:
                    continue
                opt.state[param] = {
                    field: value.live(current.pop(field, None), keeps_on_host(field, group))
                    if isinstance(value, Staged)
                    else value
                    for field, value in new_state.pop(param).items()
                }
        if loss_scale is not None:
            restore_loss_scale(opt, loss_scale)


def restore_loss_scale(opt: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """Put the saved loss-scale state into the dict a zgraph step reads it from (in place: the step's binding
    shares it; only the fields the step's ``Config.loss_scale`` has, on the device it keeps them on); before any
    step, leave it on the optimizer for the first step to start from."""
    current = getattr(opt, LOSS_SCALE_ATTR, None)
    if isinstance(current, dict):
        for key, value in loaded.items():
            if key in current:
                here = current[key]
                on_device = isinstance(value, Tensor) and isinstance(here, Tensor)
                current[key] = value.to(here.device) if on_device else value
    else:
        setattr(opt, LOSS_SCALE_ATTR, dict(loaded))
