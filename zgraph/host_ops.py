"""zgraph's operators of the update on the host (``Config.offload_update="host"``): the copies between host and
device, and the host partitions a host thread runs.

With the optimizer update on the host the ``host_update`` pass places the nodes that read host-resident state
(master parameters, optimizer states) on the host and moves values between the two places only through
``to_host`` (a device value copied to host memory: a gradient after its reduction) and ``to_device`` (a host value
copied to the device: a parameter in its compute dtype for the forward). At lowering the optimizer's host nodes
are cut into partitions (``zgraph.runtime.host_partitions``): each runs on a host thread, started by
``host_submit`` once its inputs are issued, while the graph goes on; ``host_fetch`` waits for a value a device node
needs from one; ``host_release`` marks where the step has read the last host master (with
``Config.offload_overlap="one_step"`` the previous step's update waits for it). The runtime serves them
(``zgraph.runtime.host_update``), installed around each run of the graph with ``host_tier(...)``.

A node the host runs while the state lives on a device carries ``node.meta[PLACE] == HOST`` (its fake value is on
the CPU); values cross between the two places only through ``to_host`` / ``to_device``. A lowered graph's
partitions are ``gm.meta[HOST_PARTS]``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import Tensor

PLACE = "zgraph_place"  # node.meta: HOST for a node the host runs; absent for the device's
HOST = "host"
HOST_PARTS = "zgraph_host_parts"  # gm.meta: the host partitions (GraphModules) its ``host_submit`` nodes start


class HostTier:
    """What serves the host update's operators while a graph runs (the runtime's ``HostRunner``)."""

    def to_host(self, x: Tensor) -> Tensor:
        """A host copy of ``x`` (ready when a partition reads it)."""
        raise NotImplementedError

    def to_device(self, x: Tensor, device: torch.device) -> Tensor:
        """A copy of the host tensor ``x`` on ``device``."""
        raise NotImplementedError

    def submit(self, part: int, inputs: list[Tensor]) -> None:
        """Start host partition ``part`` on ``inputs`` (the values the graph hands it)."""
        raise NotImplementedError

    def fetch(self, part: int, index: int) -> Tensor:
        """Output ``index`` of partition ``part``, once it ran."""
        raise NotImplementedError

    def release(self) -> None:
        """The step read the host masters for the last time."""
        raise NotImplementedError


_HOST: contextvars.ContextVar[HostTier | None] = contextvars.ContextVar("zgraph_host_tier", default=None)


@contextlib.contextmanager
def host_tier(tier: HostTier) -> Iterator[None]:
    """Serve the host update's operators of graphs run inside the block from ``tier``."""
    token = _HOST.set(tier)
    try:
        yield
    finally:
        _HOST.reset(token)


def _host() -> HostTier:
    tier = _HOST.get()
    if tier is None:
        raise RuntimeError("zgraph: a graph with host update nodes ran outside zgraph's runtime (no host tier)")
    return tier


@torch.library.custom_op("zgraph::to_host", mutates_args=())
def to_host(x: Tensor) -> Tensor:
    """A copy of the device value ``x`` in host memory."""
    return _host().to_host(x)


@to_host.register_fake
def _to_host_fake(x: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.custom_op("zgraph::to_device", mutates_args=())
def to_device(x: Tensor, device: str) -> Tensor:
    """A copy of the host value ``x`` on ``device``."""
    return _host().to_device(x, torch.device(device))


@to_device.register_fake
def _to_device_fake(x: Tensor, device: str) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=device)


@torch.library.custom_op("zgraph::host_submit", mutates_args=())
def host_submit(inputs: list[Tensor], part: int) -> Tensor:
    """Start host partition ``part`` on ``inputs``; returns an empty token (what ``host_fetch`` reads)."""
    _host().submit(part, list(inputs))
    return torch.empty(0)


@host_submit.register_fake
def _host_submit_fake(inputs: list[Tensor], part: int) -> Tensor:
    return torch.empty(0)


@torch.library.custom_op("zgraph::host_fetch", mutates_args=())
def host_fetch(token: Tensor, part: int, index: int, size: list[int], dtype: torch.dtype) -> Tensor:
    """Output ``index`` (of ``size`` and ``dtype``, in host memory) of host partition ``part``, once it ran."""
    return _host().fetch(part, index)


@host_fetch.register_fake
def _host_fetch_fake(token: Tensor, part: int, index: int, size: list[int], dtype: torch.dtype) -> Tensor:
    return torch.empty(size, dtype=dtype)


@torch.library.custom_op("zgraph::host_release", mutates_args=())
def host_release(after: list[Tensor]) -> Tensor:
    """The step has read the host masters for the last time (``after``: those reads); returns an empty token."""
    _host().release()
    return torch.empty(0)


@host_release.register_fake
def _host_release_fake(after: list[Tensor]) -> Tensor:
    return torch.empty(0)


TO_HOST = torch.ops.zgraph.to_host.default
TO_DEVICE = torch.ops.zgraph.to_device.default
HOST_SUBMIT = torch.ops.zgraph.host_submit.default
HOST_FETCH = torch.ops.zgraph.host_fetch.default
HOST_RELEASE = torch.ops.zgraph.host_release.default
torch.fx.node.has_side_effect(HOST_SUBMIT)
torch.fx.node.has_side_effect(HOST_RELEASE)
