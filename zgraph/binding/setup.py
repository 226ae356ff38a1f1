"""Binding a step's state, once per set of modules and optimizers: check, then lay it out.

``bind_state`` first checks everything that could refuse the state — its device against the group's backend and
the offload tiers, the layout other steps gave its modules, one GPU per rank under NCCL — so that a refusal
leaves the model and optimizers as they were. Only then does it change them: master dtype, loss-scale state (on
the state's device), rank 0's initial parameters and buffers on every rank, the sharding plan applied, the
offload store opened, and the collective cost model fitted (a collective on every rank, before any user code
runs, so a failing capture cannot skip it).
"""

from __future__ import annotations

from typing import Any

import torch

from zgraph.capture.precision import initial_loss_scale_state
from zgraph.config import Config
from zgraph.runtime.agreement import Channel
from zgraph.runtime.cost_model import fit_cost_model
from zgraph.runtime.devices import check_served, served_backend, state_device
from zgraph.runtime.host_memory import keep_freed_host_memory
from zgraph.runtime.offload import check_offload_device, open_store
from zgraph.runtime.process_group import ProcessGroupInfo, check_one_device_per_rank
from zgraph.runtime.sharded_state import (
    apply_plan,
    broadcast_initial_state,
    check_owners,
    convert_master_dtype,
    make_plan,
)
from zgraph.runtime.state import Binding, state_tensors


def bind_state(
    config: Config, group: ProcessGroupInfo, channel: Channel | None, modules: list, optimizers: list
) -> Binding:
    """The binding of ``modules`` and ``optimizers`` for a step of ``config`` on ``group`` (module docstring).
    Collective (every rank of ``group`` calls it at the same point) where ``channel`` is given."""
    binding = Binding(modules, optimizers)
    device = state_device(state_tensors(binding))
    check_served(group.backend, device)
    check_offload_device(config, device)
    check_owners(config.stage, group, binding)
    if channel is not None:
        check_one_device_per_rank(channel, group.backend, device)
    binding.device, binding.backend = device, served_backend(group.backend, device.type)
    convert_master_dtype(binding, config.master_dtype, config.optimizer_state_dtype)
    binding.loss_scale_state = _loss_scale_state(config, optimizers, device)
    broadcast_initial_state(binding, group)
    binding.plan = make_plan(config.stage, group, binding, config.param_persistence_threshold)
    apply_plan(binding.plan, binding)  # may replace parameters (stage 3)
    binding.offload = open_store(config, device)
    if binding.offload is not None:
        binding.offload.watch([o.optimizer for o in binding.optimizers], [m for _, m in binding.modules])
    if config.keep_host_memory and device.type == "cpu":
        keep_freed_host_memory()
    binding.cost_model = fit_cost_model(group, device, config.measure_collectives, channel)
    return binding


def _loss_scale_state(config: Config, optimizers: list[tuple[str, Any]], device: torch.device) -> dict:
    """The loss-scale state the step starts from, on ``device``: the config's initial one, updated from what
    ``zgraph.load`` left on an optimizer before the first step; shared with every optimizer, whose
    ``_zgraph_loss_scale`` ``zgraph.save`` / ``load`` read and write."""
    state = initial_loss_scale_state(config, device)
    for _, opt in optimizers:
        loaded = getattr(opt, "_zgraph_loss_scale", None) or {}
        state.update((k, v.to(device)) for k, v in loaded.items() if k in state)
        opt._zgraph_loss_scale = state
    return state
