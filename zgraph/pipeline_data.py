"""``zgraph.pipeline_batch``: this rank's share of a global batch with ``Config.pipeline_parallel`` over ``P x D``
ranks (``zgraph.runtime.pipeline_groups``: pipelines of ``P`` consecutive ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zgraph.tree import map_leaves


def pipeline_batch(batch: Any, pipeline_parallel: int, *, rank: int | None = None, world: int | None = None) -> Any:
    """``batch`` (a tensor, or a list / tuple / dict of them) with every tensor cut along dim 0 into ``D = world //
    pipeline_parallel`` equal slices and slice ``rank // pipeline_parallel`` kept (contiguous): the rows of the
    rank's pipeline. Every rank of a pipeline passes the same rows (its first stage reads the inputs, its last the
    labels); the ``D`` pipelines together see the whole batch, and the step's gradients and 0-d results are those
    of the whole batch. ``rank`` / ``world``: default this process's in the default group. ``ValueError`` where a
    batch does not divide into ``D`` slices or ``pipeline_parallel`` does not divide ``world``."""
    if isinstance(pipeline_parallel, bool) or not isinstance(pipeline_parallel, int) or pipeline_parallel < 1:
        raise ValueError(f"pipeline_batch: pipeline_parallel must be a positive int, got {pipeline_parallel!r}")
    initialized = dist.is_available() and dist.is_initialized()
    rank = rank if rank is not None else dist.get_rank() if initialized else 0
    world = world if world is not None else dist.get_world_size() if initialized else 1
    if world % pipeline_parallel:
        raise ValueError(f"pipeline_batch: pipeline_parallel={pipeline_parallel} does not divide the world ({world})")
    pipelines = world // pipeline_parallel
    index = rank // pipeline_parallel

    def cut(path: str, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % pipelines:
            raise ValueError(
                f"pipeline_batch: a batch of {t.shape[0]} rows (a tensor of shape {tuple(t.shape)}) does not divide "
                f"into {pipelines} pipelines' equal shares"
            )
        return t.chunk(pipelines)[index].contiguous()

    return map_leaves(batch, cut)
