"""``zgraph.shard_sequence``: this rank's slice of every sequence of a batch, for ``Config.sequence_parallel``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zgraph.tree import map_leaves


def shard_sequence(batch: Any, sequence_parallel: int, *, dim: int = 1, rank: int | None = None) -> Any:
    """``batch`` (a tensor, or a list / tuple / dict of them) with every tensor of more than ``dim`` dimensions cut
    along ``dim`` (the sequence; default 1, as ``(batch, seq, ...)``) into ``sequence_parallel`` equal slices, and
    slice ``rank % sequence_parallel`` kept (contiguous): the rank's place in its sequence group (groups of
    ``sequence_parallel`` consecutive ranks; ``rank``: default this process's rank in the default group). Split the
    batch across data-parallel ranks (``rank // sequence_parallel``) as without it. ``ValueError`` where a
    sequence's length does not divide by ``sequence_parallel``."""
    if isinstance(sequence_parallel, bool) or not isinstance(sequence_parallel, int) or sequence_parallel < 1:
        raise ValueError(f"shard_sequence: sequence_parallel must be a positive int, got {sequence_parallel!r}")
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    index = rank % sequence_parallel

    def cut(path: str, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() <= dim:
            return t
        length = t.shape[dim]
        if length % sequence_parallel:
            raise ValueError(
                f"shard_sequence: a sequence of length {length} (dim {dim} of a tensor of shape {tuple(t.shape)}) "
                f"does not divide into sequence_parallel={sequence_parallel} equal slices; pad it to a multiple of "
                f"{sequence_parallel}"
            )
        return t.chunk(sequence_parallel, dim=dim)[index].contiguous()  # a copy: models `.view` their labels

    return map_leaves(batch, cut)
