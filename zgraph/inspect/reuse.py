"""An estimate of a call the step has captured already: the step's own capture, copied, stands in for a new
trace on stand-ins (``zgraph.inspect.estimate.prepare``).

A step's variant is captured once per guard key (sizes, dtypes, structure, the state's layout, grad and autocast
modes) and kept untransformed (``CompiledStep.captured``); an estimate of a call with that key would trace the same
graph on meta stand-ins. It is reused where nothing the trace reads differs: the config fields the capture reads
(``CAPTURE_FIELDS``, and whether modules' blocks are marked), the device type, the dims traced as symbols; and the
bound state has the same names, where the capture has static sizes (a symbolic capture's ShapeEnv is the step's,
which an estimate's passes must not add guards to), no state updated on the host and no pipeline's released state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zgraph.capture.captured import CapturedGraph
from zgraph.config import Config
from zgraph.graph_copy import copy_graph_module
from zgraph.runtime.state import Binding

CAPTURE_FIELDS = (  # the Config fields the capture reads (zgraph.capture: tests/test_estimate.py checks the list)
    "autocast_dtype",
    "param_dtype",
    "keep_fp32_modules",
    "master_dtype",
    "optimizer_state_dtype",
    "loss_scale",
    "max_grad_norm",
    "offload_optimizer",
    "offload_fraction",
    "pipeline_parallel",
)


@dataclass(frozen=True)
class HeldCapture:
    """The step's capture of the variant a call would run, with what it was captured under."""

    captured: CapturedGraph
    config: Config  # the config the step captured with
    binding: Binding  # the step's bound state
    dims: Mapping[str, Any]  # the dims it traced as symbols, by argument path (``DynamicDims.of``)


def reused(
    held: HeldCapture | None, config: Config, binding: Binding, device: torch.device, dims: Mapping[str, Any]
) -> CapturedGraph | None:
    """A copy of ``held``'s capture where an estimate of ``config`` on the stand-ins ``binding`` for ``device``,
    tracing ``dims`` as symbols, would capture the same graph (module docstring); else None."""
    if held is None or not _same_trace(held, config, binding, device, dims):
        return None
    return dataclasses.replace(held.captured, gm=copy_graph_module(held.captured.graph))


def _same_trace(held: HeldCapture, config: Config, binding: Binding, device: torch.device, dims: Mapping) -> bool:
    step, captured = held.binding, held.captured
    if captured.size_guards is not None or held.dims or dims or step.host_params or step.holders:
        return False
    changed = [f for f in CAPTURE_FIELDS if getattr(held.config, f) != getattr(config, f)]
    if changed or _marks(held.config) != _marks(config):
        return False
    if step.device.type != device.type or (device.type == "cuda" and not torch.cuda.is_available()):
        return False
    return _names(step) == _names(binding)


def _marks(config: Config) -> bool:
    """Whether the capture marks the modules' blocks (``zgraph.capture.blocks``: what remat and stage cuts read)."""
    return config.remat is not None or config.pipeline_parallel is not None


def _names(binding: Binding) -> tuple:
    return (
        tuple(r.name for r in binding.params),
        tuple(r.name for r in binding.buffers),
        tuple(o.name for o in binding.optimizers),
    )
