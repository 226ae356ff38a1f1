"""Offload tiers for optimizer states (``Config.offload_optimizer``) and stage-3 parameter shards
(``Config.offload_params``): which store serves the graph's ``zgraph::reload`` / ``zgraph::write_back`` nodes.

- ``"nvme"``: files under ``offload_dir`` (``zgraph.runtime.offload_nvme``), for state in host memory.
- ``"cpu"``: on the CPU the identity (the state is in host memory already: no store, no offload nodes); with the
  state on a device, host memory, pinned on CUDA, copied over a stream of its own (``zgraph.runtime.offload_host``).

What every tier does around a graph, and ``materialize`` (read offloaded state back for code outside the graph),
is ``zgraph.runtime.offload_store``'s.
"""

from __future__ import annotations

from typing import Any

import torch

from zgraph.graph import offload_moves
from zgraph.runtime.offload_host import HostStore
from zgraph.runtime.offload_nvme import NvmeStore
from zgraph.runtime.offload_store import DEFAULT_WINDOW, OffloadError, TierStore, materialize

__all__ = ["OffloadError", "TierStore", "check_offload_device", "describe", "materialize", "open_store"]


def check_offload_device(config: Any, device: torch.device) -> None:
    """Raise ``OffloadError`` (before anything in the model changes) for an offload tier ``config`` asks for that
    state on ``device`` cannot use."""
    for name in ("offload_optimizer", "offload_params"):
        tier = getattr(config, name)
        if tier == "nvme" and device.type != "cpu":
            raise OffloadError(
                f'zgraph: Config.{name}="nvme" with the model on {device} is not implemented yet (the files are read '
                'and written from host memory); use "cpu" (pinned host memory, copied to and from the device '
                "around each use) or keep the model on the CPU"
            )


def open_store(config: Any, device: torch.device) -> TierStore | None:
    """The store ``config``'s offload fields ask for with the state on ``device``, or None for none or the
    identity (``"cpu"`` on the CPU); ``check_offload_device`` has accepted them."""
    tiers = {config.offload_optimizer, config.offload_params}
    window = config.prefetch_bytes if isinstance(config.prefetch_bytes, int) else DEFAULT_WINDOW
    if "nvme" in tiers:
        return NvmeStore(config.offload_dir, window, trim=not config.keep_host_memory)
    if offload_moves("cpu", device.type) and "cpu" in tiers:
        return HostStore(device, window)
    return None


def describe(
    optimizer_tier: str | None, params_tier: str | None, store: TierStore | None, hosted: bool = False
) -> list[str]:
    """``explain()``'s lines about offload (``hosted``: the update on the host keeps the state, and says so)."""
    lines = []
    for field, tier, what in (("offload_optimizer", optimizer_tier, "states"), ("offload_params", params_tier, "")):
        if tier == "cpu" and not isinstance(store, HostStore) and not hosted:
            lines.append(f'{field}="cpu": the identity here (the {what or "parameters"} are in host memory already)')
    if store is None:
        return lines
    count = lambda kind: sum(1 for key in store.states if key[0] == kind)
    where = f"files in {store.path}" if isinstance(store, NvmeStore) else _host_memory(store)
    served = lambda tier: tier == "nvme" or (tier == "cpu" and isinstance(store, HostStore))
    if served(optimizer_tier):
        lines.append(
            f'offload_optimizer="{optimizer_tier}": {count("opt_state")} optimizer states '
            f"({store.released_bytes('opt_state')} of {store.bytes_total} optimizer state bytes) live in {where}; "
            "the graph reloads each one right before the optimizer reads it and writes it back right after its "
            "update (the `offload` pass's zgraph.reload / zgraph.write_back nodes)"
        )
    if served(params_tier):
        lines.append(
            f'offload_params="{params_tier}": {count("param")} parameter shards ({store.released_bytes("param")} of '
            f"{store.param_bytes_total} sharded parameter bytes) live in {where}; the graph reloads each one right "
            "before each phase's first read (the forward's all-gather, the backward's re-gather, the update) and "
            "writes it back right after its update (zgraph.reload / zgraph.write_back nodes); parameters whole on "
            "every rank stay in memory"
        )
    if isinstance(store, HostStore) and store.device.type == "cuda":
        lines.append(
            f"the host-memory tier has not yet run on a GPU in zgraph's own checks: untested on {store.device}"
        )
    return lines


def _host_memory(store: HostStore) -> str:
    copies = "copied on a stream of their own" if store.stream is not None else "copied synchronously"
    return f"{'pinned ' if store.pinned else ''}host memory ({copies}, for state on {store.device})"
