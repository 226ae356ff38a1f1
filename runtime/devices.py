"""Devices: where a step's training state lives, which backend serves it, and how the host reads from it.

- ``state_device``: the one device every parameter, buffer and optimizer state tensor of a step is on (a model
  spread over several devices is refused, naming two of them).
- ``backend_devices`` / ``served_backend``: what a ``torch.distributed`` backend string serves, per device type:
  ``"gloo"`` serves ``cpu`` (and ``cuda`` in CUDA builds), ``"nccl"`` ``cuda``, a mixed ``"cpu:gloo,cuda:nccl"``
  group gloo for host tensors and NCCL for device tensors, a backend registered with
  ``dist.Backend.register_backend(..., devices=[...])`` its devices. The passes plan for the backend that serves
  the state's device (NCCL's reduce-scatter, gloo's all-to-all).
- ``default_backend``: the backend zgraph starts a group with, from the state's device (a CPU model gets gloo
  even where CUDA exists).
- ``control_device``: where zgraph's own small tensors that cross ranks (graph fingerprints) are put: the host
  where the group's backend serves it, else the state's device (NCCL serves no host tensor).
- (``zgraph.ops.host_read`` marks zgraph's deliberate device-to-host reads; see there.)
- ``synchronize``: wait for the device's queued work (CUDA); the host's work is already done.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from zgraph.errors import ZGraphError

HOME = "_zgraph_home"  # a tensor kept in host memory for a device's step (the update on the host): that device


class DeviceError(ZGraphError, ValueError):
    """The training state's device and the process group's backend do not fit together."""


def state_device(tensors: Iterable[Tensor], meta_is_device: bool = False) -> torch.device:
    """The device of ``tensors`` (DTensors by their local tensor's; a tensor kept in host memory for a device's
    step, the update on the host's, by that device: ``HOME``); CPU when there are none; ``meta`` when all
    are meta (a meta tensor beside real ones is about to be made real there, unless ``meta_is_device``: a test's
    stand-in accelerator). Raises ``DeviceError`` naming two devices when they are on several."""
    found: torch.device | None = None
    meta = False
    for t in tensors:
        device = getattr(t, HOME, None) or getattr(t, "_local_tensor", t).device
        if device.type == "meta" and not meta_is_device:
            meta = True
        elif found is None:
            found = device
        elif device != found:
            raise DeviceError(
                f"zgraph: the step's parameters, buffers and optimizer states are on several devices ({found} and "
                f"{device}); zgraph shards a model that lives on one device per rank. Move it there first "
                "(model.to(device) before the optimizer is built, or before its first step)."
            )
    return found or torch.device("meta" if meta else "cpu")


def allocation_device(backend: str | None) -> torch.device:
    """Where a meta-device model's state is made real: the rank's CUDA device (``LOCAL_RANK``, else the current
    one) for a group NCCL serves, or with no group where CUDA is available; else the host."""
    served = backend_devices(backend)
    if served.get("cuda") == "nccl" or (not served and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def backend_devices(backend: str | None) -> dict[str, str]:
    """``{device type: backend name}`` a ``torch.distributed`` backend string serves (empty for None)."""
    if not backend:
        return {}
    if ":" in backend:
        pairs = (item.split(":", 1) for item in backend.split(","))
        return {device.strip().lower(): name.strip().lower() for device, name in pairs}
    name = backend.lower()
    devices = dist.Backend.backend_capability.get(name, []) if dist.is_available() else []
    return {device: name for device in devices}


def served_backend(backend: str | None, device_type: str) -> str | None:
    """The backend name that serves ``device_type`` in the backend string ``backend``; None if none does."""
    return backend_devices(backend).get(device_type)


def default_backend(device: torch.device) -> str:
    """The backend zgraph starts the default group with for state on ``device``: gloo for host memory, NCCL
    for CUDA. Raises ``DeviceError`` for a device neither serves."""
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise DeviceError("zgraph: the model is on CUDA but this torch build has no NCCL backend")
        return "nccl"
    raise DeviceError(
        f"zgraph: the model is on {device}; zgraph starts process groups for cpu (gloo) and cuda (NCCL) models. "
        "Initialise torch.distributed yourself with a backend for this device before the first step."
    )


def check_served(backend: str | None, device: torch.device) -> None:
    """Raise ``DeviceError`` when the group's ``backend`` cannot run collectives on tensors of ``device``."""
    if backend is None or served_backend(backend, device.type) is not None:
        return
    served = ", ".join(f"{d} ({b})" for d, b in backend_devices(backend).items()) or "no device zgraph knows"
    hint = "gloo" if device.type == "cpu" else "nccl" if device.type == "cuda" else f"a backend for {device.type}"
    raise DeviceError(
        f"zgraph: the model is on {device}, but the process group's backend {backend!r} serves {served}. Move the "
        f"model to a device the backend serves, or initialise the group with {hint} for {device.type} "
        f"(e.g. init_process_group('cpu:gloo,cuda:nccl') serves both)."
    )


def control_device(backend: str | None, state: torch.device | None = None) -> torch.device:
    """Where zgraph's small tensors that cross ranks go for a group of ``backend``: the host where the backend
    serves it, else ``state`` (the training state's device) when it serves that, else its first device."""
    served = backend_devices(backend)
    if not served or "cpu" in served:
        return torch.device("cpu")
    if state is not None and state.type in served:
        return state
    first = next(iter(served))
    if first == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(first)


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device`` is done (CUDA streams); nothing to wait for elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
