"""Stages 1 and 2 with the update on the host, on several ranks: stage 3's layout, as DeepSpeed's ZeRO-Offload keeps
its fp32 master partitioned on the host.

With the update on the host (``Config.offload_update``) the device holds no parameter between steps at any stage:
the forward copies each one there. What stages 1 and 2 would add is the whole master on every rank's host, and an
updated shard all-gathered in fp32 through the device and copied back whole (9.2 bytes per parameter crossed at 2
ranks, fp16 parameters, where stage 3's layout copies 2.1: ``tests/test_device_path.py``). So a step of stage 1 or 2
whose update runs on the host on several ranks runs as stage 3 with ``max_reuse_distance`` covering the model — each
parameter gathered once per step, in its compute dtype, and kept for the backward, as stages 1 and 2 keep it whole
through the step — and each rank's host holds its shard of the master, gradient and states. Results are the step's
as before (a reduce-scatter instead of an all-reduce and a slice); parameters are sharded tensors between steps, as
at stage 3 (``zgraph.full_state_dict`` gathers them). ``explain()`` says so (``layout_lines``).
"""

from __future__ import annotations

import torch

from zgraph.binding.setup import host_runnable
from zgraph.config import Config
from zgraph.runtime.host_state import host_parameters
from zgraph.runtime.process_group import ProcessGroupInfo
from zgraph.runtime.state import Binding


def host_layout(config: Config, group: ProcessGroupInfo, device: torch.device, binding: Binding) -> Config:
    """The config a step of ``config`` runs with the state of ``binding`` (not laid out yet) on ``device`` over
    ``group``: stage 3 gathering once per step where stage 1 or 2 would update on the host on several ranks
    (module docstring); else ``config``. Raises ``OffloadError`` where ``offload_update="host"`` cannot be honoured
    (nothing has changed)."""
    if config.stage not in (1, 2) or not group.distributed or group.shard_axis.size < 2:
        return config
    host, _ = host_parameters(config, binding, device, host_runnable)
    if not host:
        return config
    every = sum(r.tensor.numel() for r in binding.params)
    return config.replace(stage=3, max_reuse_distance=max(every, config.max_reuse_distance))


def layout_lines(asked: Config | None, runs: Config) -> list[str]:
    """``explain()``'s line where ``host_layout`` made the config that runs of the one ``asked`` (None: it did
    not)."""
    if asked is None:
        return []
    return [
        f"stage {asked.stage} with the update on the host on several ranks runs stage {runs.stage}'s layout "
        "(ZeRO-Offload's): each rank's host keeps its shard of the master, gradient and optimizer states; each "
        "parameter is gathered once per step in its compute dtype and kept for the backward "
        f"(max_reuse_distance={runs.max_reuse_distance})"
    ]
