"""``zgraph.pipeline_batch``: this rank's share of a global batch with ``Config.pipeline_parallel`` over ``P x SP x D``
ranks (``zgraph.runtime.pipeline_groups``: pipelines of ``P`` stage places, each run by ``SP`` consecutive ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zgraph.sequence import shard_sequence
from zgraph.tree import map_leaves


def pipeline_batch(
    batch: Any,
    pipeline_parallel: int,
    *,
    sequence_parallel: int = 1,
    dim: int = 1,
    rank: int | None = None,
    world: int | None = None,
) -> Any:
    """``batch`` (a tensor, or a list / tuple / dict of them) with every tensor cut along dim 0 into ``D = world //
    (pipeline_parallel * sequence_parallel)`` equal slices and slice ``rank // (pipeline_parallel *
    sequence_parallel)`` kept (contiguous): the rows of the rank's pipeline; then, with ``sequence_parallel`` SP >
    1, each sequence (along ``dim``) cut as ``zgraph.shard_sequence`` cuts it, slice ``rank % SP`` kept. Every
    rank of a pipeline with the same slice passes the same values (its first stage reads the inputs, its last the
    labels); the pipelines together see the whole batch, and the step's gradients and 0-d results are those of the
    whole batch. ``rank`` / ``world``: default this process's in the default group. ``ValueError`` where a batch
    does not divide into ``D`` slices, a sequence into ``SP``, or ``P x SP`` does not divide ``world``."""
    for name, value in (("pipeline_parallel", pipeline_parallel), ("sequence_parallel", sequence_parallel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline_batch: {name} must be a positive int, got {value!r}")
    initialized = dist.is_available() and dist.is_initialized()
    rank = rank if rank is not None else dist.get_rank() if initialized else 0
    world = world if world is not None else dist.get_world_size() if initialized else 1
    ranks_per_pipeline = pipeline_parallel * sequence_parallel
    if world % ranks_per_pipeline:
        raise ValueError(
            f"pipeline_batch: pipeline_parallel={pipeline_parallel} x sequence_parallel={sequence_parallel} does not "
            f"divide the world ({world})"
        )
    pipelines = world // ranks_per_pipeline
    index = rank // ranks_per_pipeline

    def cut(path: str, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % pipelines:
            raise ValueError(
                f"pipeline_batch: a batch of {t.shape[0]} rows (a tensor of shape {tuple(t.shape)}) does not divide "
                f"into {pipelines} pipelines' equal shares"
            )
        return t.chunk(pipelines)[index].contiguous()

    rows = map_leaves(batch, cut)
    return shard_sequence(rows, sequence_parallel, dim=dim, rank=rank) if sequence_parallel > 1 else rows
