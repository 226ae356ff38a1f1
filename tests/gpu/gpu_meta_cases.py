"""The ranks' side of the GPU checks, continued: the ``meta`` check (issue 27) — a model built on the meta device
made real by zgraph where the group computes (the rank's GPU under NCCL), its values against the same model
built on that device from the same seed (the device's own generator, rank 0's state sent to every rank)."""

from __future__ import annotations

from typing import Any

import torch
from gpu_cases import SMALL, config

import zgraph
from zgraph.demos.models import GPT


def meta(rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """Where a meta GPT's stage-3 shards live after ``zgraph.materialize``, and the largest difference of its
    whole state from the eager GPT built there with the same seed (0 expected: bitwise)."""
    with torch.device("meta"):
        model = GPT(SMALL)
    torch.manual_seed(0)  # every generator, the GPUs' too
    zgraph.materialize(model, config(3))
    param = next(model.parameters())
    where = getattr(param, "_local_tensor", param).device
    torch.manual_seed(0)
    with torch.device(where):
        eager = GPT(SMALL)
    got = zgraph.full_state_dict(model)
    diff = max(float((got[k].to(v.device) - v).abs().max()) for k, v in eager.state_dict().items())
    return {"device": str(where), "max_abs_diff": diff, "sharded": type(param).__name__}
