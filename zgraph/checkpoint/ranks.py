"""The ranks' side of a collective checkpoint call (``save``, ``load``): this rank and the world size, and every
rank's outcome of each part, exchanged as JSON through the store (no pickles), so that all ranks raise if one
failed."""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from zgraph.errors import CheckpointError, RankFailedError
from zgraph.runtime.agreement import Channel


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_results(
    channel: Channel | None, label: str, payload: dict[str, Any], error: BaseException | None
) -> list[dict]:
    """Every rank's JSON ``payload`` (through the store, no pickles), in rank order; raises on every rank if one
    failed: its own error where it happened, a ``CheckpointError`` naming the failing rank elsewhere."""
    if channel is None:
        if error is not None:
            raise error
        return [payload]
    body = {"error": f"{type(error).__name__}: {error}"} if error is not None else {"ok": payload}
    try:
        results = channel.exchange(label, json.dumps(body, allow_nan=False).encode())
    except RankFailedError as failed:
        if error is not None:
            raise error from failed
        raise CheckpointError(str(failed)) from failed
    if error is not None:
        raise error
    out = []
    for r, raw in enumerate(results):
        value = json.loads(raw)
        if "error" in value:
            raise CheckpointError(f"rank {r} failed in {label}: {value['error']}")
        out.append(value["ok"])
    return out
