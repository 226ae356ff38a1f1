"""zgraph's sequence-parallel operators (Ulysses): the all-to-alls around attention.

Under ``Config.sequence_parallel=N`` each rank of a sequence group holds a slice of every sequence: slice ``r`` of
``N`` equal slices (dim 2 of an attention input ``(batch, heads, seq, head_dim)``). The ``sequence_parallel``
pass puts ``seq_to_heads`` on attention's query, key and value (and on the gradient of its output), so attention
runs on the whole sequence for ``heads / N`` of the heads (rank ``r``'s: heads ``[r * heads / N, (r + 1) * heads /
N)``), and ``heads_to_seq`` on what it returns. ``lower_collectives`` replaces both by ``all_to_all_single`` and
the permutes around it; the real implementations here run the collective, so every intermediate graph runs.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _exchange(x: Tensor, world_size: int, group: str) -> Tensor:
    """``all_to_all_single`` of ``x`` (contiguous, dim 0 cut in ``world_size`` equal blocks), waited for."""
    c10d = torch.ops._c10d_functional
    splits = [x.shape[0] // world_size] * world_size
    return c10d.wait_tensor(c10d.all_to_all_single(x.contiguous(), splits, splits, group))


def seq_to_heads_layout(x: Tensor, world_size: int) -> Tensor:
    """``(b, h, s, d)`` -> ``(n, b, h / n, s, d)``: the block for each rank (its heads) first, contiguous."""
    b, h, s, d = x.shape
    return x.reshape(b, world_size, h // world_size, s, d).permute(1, 0, 2, 3, 4).contiguous()


def seq_to_heads_result(received: Tensor) -> Tensor:
    """``(n, b, h / n, s, d)``, block ``i`` from rank ``i`` (sequence slice ``i``) -> ``(b, h / n, n * s, d)``."""
    n, b, h, s, d = received.shape
    return received.permute(1, 2, 0, 3, 4).reshape(b, h, n * s, d)


def heads_to_seq_layout(x: Tensor, world_size: int) -> Tensor:
    """``(b, h / n, n * s, d)`` -> ``(n, b, h / n, s, d)``: each rank's sequence slice first, contiguous."""
    b, h, s, d = x.shape
    return x.reshape(b, h, world_size, s // world_size, d).permute(2, 0, 1, 3, 4).contiguous()


def heads_to_seq_result(received: Tensor) -> Tensor:
    """``(n, b, h / n, s, d)``, block ``i`` from rank ``i`` (heads ``i``) -> ``(b, n * h / n, s, d)``."""
    n, b, h, s, d = received.shape
    return received.permute(1, 0, 2, 3, 4).reshape(b, n * h, s, d)


@torch.library.custom_op("zgraph::seq_to_heads", mutates_args=())
def seq_to_heads(x: Tensor, world_size: int, group: str) -> Tensor:
    """This rank's heads of the whole sequence, from every rank's sequence slice of all heads: an all-to-all."""
    return seq_to_heads_result(_exchange(seq_to_heads_layout(x, world_size), world_size, group))


@seq_to_heads.register_fake
def _seq_to_heads_fake(x: Tensor, world_size: int, group: str) -> Tensor:
    b, h, s, d = x.shape
    return x.new_empty((b, h // world_size, s * world_size, d))


@torch.library.custom_op("zgraph::heads_to_seq", mutates_args=())
def heads_to_seq(x: Tensor, world_size: int, group: str) -> Tensor:
    """This rank's sequence slice of all heads, from every rank's heads of the whole sequence: an all-to-all."""
    return heads_to_seq_result(_exchange(heads_to_seq_layout(x, world_size), world_size, group))


@heads_to_seq.register_fake
def _heads_to_seq_fake(x: Tensor, world_size: int, group: str) -> Tensor:
    b, h, s, d = x.shape
    return x.new_empty((b, h * world_size, s // world_size, d))


SEQ_TO_HEADS = torch.ops.zgraph.seq_to_heads.default
HEADS_TO_SEQ = torch.ops.zgraph.heads_to_seq.default
SEQUENCE_OPS = (SEQ_TO_HEADS, HEADS_TO_SEQ)
