"""``zgraph.materialize``: a model built on the meta device given its state, laid out as a step of the same
config lays it out (each rank allocates only its shards), outside a step.

A zgraph step does this by itself on its first call; ``materialize`` is for users who want the state before
that (to load weights, inspect or edit it). The step that runs next with the same config finds the state laid
out and keeps it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from zgraph.binding.setup import lay_out, step_groups
from zgraph.config import Config
from zgraph.runtime.agreement import Channel
from zgraph.runtime.devices import allocation_device
from zgraph.runtime.meta_init import has_meta_state
from zgraph.runtime.process_group import ensure_process_group, timed_group
from zgraph.runtime.state import Binding


def materialize(
    model: nn.Module, config: Config | None = None, *, init: bool = True, process_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Give ``model``'s meta-device parameters and buffers storage on the compute device (the rank's CUDA device
    under NCCL, else the host), each rank only its shards where ``config`` (stage 3) shards a parameter, and
    values from the model's own initialisation: ``model.init_weights()`` (Hugging Face, torchtitan) where it has
    one, else each module's ``reset_parameters()`` in module order; buffers by the modules that compute them
    (``init_buffers()``; Hugging Face's rotary tables by ``_init_weights``). The values equal what that
    initialisation gives the unsharded model from rank 0's random state (sent to every rank), and a rank holds
    its shards plus one module's parameters at a time (a model-level ``init_weights()`` that is not Hugging
    Face's holds them all while it runs). ``init=False`` allocates without initialising parameters (for
    weights loaded next: ``zgraph.load_pretrained``). Parameters and buffers already real are left as they are
    (a model with nothing on the meta device on any rank is returned untouched).

    Collective: every rank of the group calls it at the same point. Returns ``model``. Raises
    ``MetaInitError`` (a ``ZGraphError``), changing nothing, for a meta module with no way to initialise it.
    """
    config = config or Config()
    group = ensure_process_group(process_group, lambda: allocation_device(None))
    values = "init" if init else "empty"
    binding = Binding([("model", model)], [])
    if not group.distributed:
        if has_meta_state(binding):
            lay_out(config, group, None, binding, values)
        return model
    label = "zgraph.materialize"
    channel = Channel(group, config.collective_timeout)
    channel.enter(label)
    try:
        flags = channel.exchange(f"{label}: any meta-device state?", b"1" if has_meta_state(binding) else b"0")
        if b"1" not in flags:
            return model  # nothing to make real on any rank: the model is left as it is
        group = timed_group(group, config.collective_timeout, lambda: channel.exchange(f"{label} (set-up)"))
        group = step_groups(group, config)
        lay_out(config, group, channel, binding, values)
    except Exception as error:
        channel.record_failure(label, error)  # the other ranks raise naming it instead of waiting
        raise
    return model
