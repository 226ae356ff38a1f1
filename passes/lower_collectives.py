"""``lower_collectives``: replace zgraph's layout operators by functional collectives and views.

- ``shard(x)`` → a dim-0 slice of ``x`` (a view, no copy), padded with zero rows only on the ranks whose rows
  run past the end;
- ``unshard(x)`` → ``all_gather_into_tensor`` + ``wait_tensor``, then a slice dropping the padding rows;
- ``reduce(x)`` → ``all_reduce(avg)`` + ``wait_tensor`` (also for 0-d tensors, which are never sharded);
- ``reduce_shard(x)`` → ``reduce_scatter_tensor(avg)`` + ``wait_tensor``, the input packed (zero-padded to
  whole shards, made contiguous) by ``aten._chunk_cat`` in one copy where needed. On gloo
  (``reduce_scatter_by_all_to_all``) the reduce-scatter is ``all_to_all_single`` + ``wait_tensor``, then the sum of
  the W received chunks divided by W: the same values (bit for bit on 2 ranks) for half the bytes gloo's
  reduce-scatter moves.

Buckets: an ``unshard`` bucket becomes one ``all_gather_into_tensor_coalesced`` (each shard gathered straight
into its whole tensor: no copy in, no copy out); ``reduce_shard`` and ``reduce`` buckets pack their gradients
into one flat buffer with ``aten._chunk_cat`` (one copy, which also pads and transposes; 0-d members enter as
views of shape ``[1]``) and reduce it in one collective, each result a view of the output with the member's
shape (``()`` for 0-d members).

Collectives are ``torch.ops._c10d_functional`` ops, so the graph stays functional, traceable and
inductor-compilable. Every collective is followed directly by its wait; the ``schedule`` pass may move waits.

``grad_norm`` and ``nonfinite`` become the aten ops they stand for, and ``combine`` an all-reduce. Sequence
parallelism's ``seq_to_heads`` / ``heads_to_seq`` become one packing copy, ``all_to_all_single`` and views.

Provides ``collectives_lowered``: no zgraph operator is left; collective nodes carry
``meta[COLLECTIVE]`` (kind and what it moves) for inspection and for bucketing.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from zgraph.graph import ALL_TO_ALL, COLLECTIVE, PHASE, fake_mode, insert, reduce_scatter_by_all_to_all, shard_rows
from zgraph.ops import (
    COMBINE,
    GRAD_NORM,
    LAYOUT_OPS,
    NONFINITE,
    REDUCE,
    REDUCE_BUCKET,
    REDUCE_SHARD,
    REDUCE_SHARD_BUCKET,
    SHARD,
    UNSHARD,
    UNSHARD_BUCKET,
)
from zgraph.passes.pass_list import PassContext
from zgraph.sequence_ops import SEQ_TO_HEADS, SEQUENCE_OPS

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _collective(gm: fx.GraphModule, target: object, args: tuple, moves: tuple, at: dict) -> fx.Node:
    """Issue a functional collective (``meta[COLLECTIVE]``: its kind and what it moves) and wait for it."""
    issued = insert(gm, target, args, **at)
    issued.meta[COLLECTIVE] = moves
    return insert(gm, c10d.wait_tensor.default, (issued,), **at)


def _reduce_scatter(
    gm: fx.GraphModule, source: fx.Node, world: int, group: str, moves: tuple, at: dict, by_all_to_all: bool
) -> fx.Node:
    """The averaged rank's chunk (dim 0) of ``source``, a contiguous tensor of ``world`` equal chunks, waited for:
    ``reduce_scatter_tensor``, or (``by_all_to_all``) every rank's copy of this rank's chunk by one
    ``all_to_all_single``, summed and divided by ``world``."""
    if not by_all_to_all:
        return _collective(gm, c10d.reduce_scatter_tensor.default, (source, "avg", world, group), moves, at)
    shape = list(source.meta["val"].shape)
    splits = [shape[0] // world] * world
    received = _collective(gm, c10d.all_to_all_single.default, (source, splits, splits, group), moves, at)
    table = insert(gm, aten.view.default, (received, [world, shape[0] // world, *shape[1:]]), **at)
    total = insert(gm, aten.sum.dim_IntList, (table, [0]), **at)
    return insert(gm, aten.div.Tensor, (total, world), **at)


def _pad_arg(ndim: int, extra_rows: int) -> list[int]:
    # constant_pad_nd pads from the last dim backwards: (last_lo, last_hi, ..., dim0_lo, dim0_hi)
    return [0, 0] * (ndim - 1) + [0, extra_rows]


def _contiguous(gm: fx.GraphModule, x: fx.Node, before: fx.Node, mode: object, phase: str) -> fx.Node:
    if x.meta["val"].is_contiguous():
        return x
    return insert(gm, aten.clone.default, (x,), {"memory_format": torch.contiguous_format}, before=before, phase=phase)


def lower_collectives_applies(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Whether ``lower_collectives`` changes the graph: only where it has an operator to lower (``Pass.applies``)."""
    lowered = {GRAD_NORM, NONFINITE, *SEQUENCE_OPS, *LAYOUT_OPS}
    return any(node.target in lowered for node in gm.graph.nodes)


def lower_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace shard/unshard/reduce/reduce_shard by slices and functional collectives with their waits."""
    mode = fake_mode(gm)
    by_all_to_all = reduce_scatter_by_all_to_all(ctx.backend)
    for node in list(gm.graph.nodes):
        if node.target in (GRAD_NORM, NONFINITE):
            _lower_reduction(gm, node, mode)
            continue
        if node.target in SEQUENCE_OPS:
            _lower_all_to_all(gm, node, mode)
            continue
        if node.target not in LAYOUT_OPS:
            continue
        if node.target in (UNSHARD_BUCKET, REDUCE_SHARD_BUCKET, REDUCE_BUCKET):
            _lower_bucket(gm, node, mode, by_all_to_all)
            continue
        phase = node.meta.get(PHASE)
        at = dict(before=node, phase=phase, mode=mode)
        x = node.args[0]
        val = x.meta["val"]
        if node.target is SHARD:
            _, world, rank = node.args
            rows = shard_rows(val.shape[0], world)
            start = min(rank * rows, val.shape[0])
            stop = min(start + rows, val.shape[0])
            out = insert(gm, aten.slice.Tensor, (x, 0, start, stop), **at)
            if stop - start < rows:
                out = insert(gm, aten.constant_pad_nd.default, (out, _pad_arg(val.dim(), rows - (stop - start))), **at)
            elif any(u.op == "output" for u in node.users):
                # a graph output must not be a view: it would keep the whole tensor alive as its base
                out = insert(gm, aten.clone.default, (out,), **at)
        elif node.target is UNSHARD:
            _, dim0, world, group = node.args
            source = _contiguous(gm, x, node, mode, phase)
            out = _collective(gm, c10d.all_gather_into_tensor.default, (source, world, group), ("all_gather", x), at)
            if out.meta["val"].shape[0] != dim0:
                out = insert(gm, aten.slice.Tensor, (out, 0, 0, dim0), **at)
        elif node.target is COMBINE:
            _, op, world, group = node.args
            source = _contiguous(gm, x, node, mode, phase)
            out = _collective(gm, c10d.all_reduce.default, (source, op, group), ("all_reduce", x), at)
        elif node.target is REDUCE:
            _, world, group = node.args
            source = _contiguous(gm, x, node, mode, phase)
            out = _collective(gm, c10d.all_reduce.default, (source, "avg", group), ("all_reduce", x), at)
        else:
            assert node.target is REDUCE_SHARD
            _, world, rank, group = node.args
            rows = shard_rows(val.shape[0], world)
            if rows * world != val.shape[0] or not val.is_contiguous():
                table = insert(gm, aten._chunk_cat.default, ([x], 0, world), **at)  # pad + pack in one copy
                source = insert(gm, aten.view.default, (table, [rows * world, *val.shape[1:]]), **at)
            else:
                source = x
            out = _reduce_scatter(gm, source, world, group, ("reduce_scatter", x), at, by_all_to_all)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    return gm


def _lower_all_to_all(gm: fx.GraphModule, node: fx.Node, mode: object) -> None:
    """``seq_to_heads`` / ``heads_to_seq`` (``zgraph.sequence_ops``): one copy into the layout the exchange sends
    (each rank's block first), ``all_to_all_single``, and a view of what came back in the layout attention reads."""
    at = dict(before=node, phase=node.meta.get(PHASE), mode=mode)
    x, world, group = node.args
    b, h, s, d = x.meta["val"].shape
    if node.target is SEQ_TO_HEADS:
        blocks, order, back, shape = (
            [b, world, h // world, s, d],
            [1, 0, 2, 3, 4],
            [1, 2, 0, 3, 4],
            [b, h // world, s * world, d],
        )
    else:
        blocks, order, back, shape = (
            [b, h, world, s // world, d],
            [2, 0, 1, 3, 4],
            [1, 0, 2, 3, 4],
            [b, h * world, s // world, d],
        )
    split = insert(gm, aten.reshape.default, (x, blocks), **at)
    moved = insert(gm, aten.permute.default, (split, order), **at)
    packed = insert(gm, aten.clone.default, (moved,), {"memory_format": torch.contiguous_format}, **at)
    splits = [packed.meta["val"].shape[0] // world] * world
    exchange = (packed, splits, splits, group)
    received = _collective(gm, c10d.all_to_all_single.default, exchange, (ALL_TO_ALL, x), at)
    arranged = insert(gm, aten.permute.default, (received, back), **at)
    out = insert(gm, aten.reshape.default, (arranged, shape), **at)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def _lower_reduction(gm: fx.GraphModule, node: fx.Node, mode: object) -> None:
    """``grad_norm`` and ``nonfinite`` as the aten ops they stand for."""
    at = dict(before=node, phase=node.meta.get(PHASE), mode=mode)
    if node.target is GRAD_NORM:
        grad, order = node.args
        out = insert(gm, aten.linalg_vector_norm.default, (grad, order), **at)
    else:
        flags = []
        for grad in node.args[0]:
            finite = insert(gm, aten.isfinite.default, (grad,), **at)
            bad = insert(gm, aten.logical_not.default, (finite,), **at)
            flags.append(insert(gm, aten.any.default, (bad,), **at))
        if flags:
            stacked = insert(gm, aten.stack.default, (flags,), **at)
            out = insert(gm, aten.any.default, (stacked,), **at)
        else:
            out = insert(gm, aten.zeros.default, ([],), {"dtype": torch.bool}, **at)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def _numel(val: torch.Tensor) -> int:
    return val.numel()


def _lower_bucket(gm: fx.GraphModule, node: fx.Node, mode: object, by_all_to_all: bool) -> None:
    """One collective for a bucket: a coalesced all-gather (no copies), or a reduction of one flat buffer
    packed by a single ``_chunk_cat`` copy, each member's result a view of it."""
    phase = node.meta.get(PHASE)
    at = dict(before=node, phase=phase, mode=mode)
    xs = node.args[0]
    vals = [x.meta["val"] for x in xs]
    outs: list[fx.Node] = []
    if node.target is UNSHARD_BUCKET:
        # one coalesced all-gather: every shard gathered into its own whole tensor, no packing copies (on gloo
        # this is also faster than a flat buffer; see benchmarks/README.md)
        _, dim0s, world, group = node.args
        sources = [_contiguous(gm, x, node, mode, phase) for x in xs]
        gathered = insert(gm, c10d.all_gather_into_tensor_coalesced.default, (sources, world, group), **at)
        gathered.meta[COLLECTIVE] = ("all_gather", xs)
        for i, dim0 in enumerate(dim0s):
            item = insert(gm, operator.getitem, (gathered, i), **at)
            out = insert(gm, c10d.wait_tensor.default, (item,), **at)
            if out.meta["val"].shape[0] != dim0:
                out = insert(gm, aten.slice.Tensor, (out, 0, 0, dim0), **at)
            outs.append(out)
    elif node.target is REDUCE_SHARD_BUCKET:
        _, world, rank, group = node.args
        # one copy: each gradient's rank-r rows (zero-padded to equal rows) land in row r of the table
        table = insert(gm, aten._chunk_cat.default, (list(xs), 0, world), **at)
        flat = insert(gm, aten.view.default, (table, [-1]), **at)
        done = _reduce_scatter(gm, flat, world, group, ("reduce_scatter", xs), at, by_all_to_all)
        shard_shapes = [(shard_rows(v.shape[0], world), *v.shape[1:]) for v in vals]
        sizes = [_numel(v) // v.shape[0] * s[0] if v.shape[0] else 0 for v, s in zip(vals, shard_shapes)]
        pieces = insert(gm, aten.split_with_sizes.default, (done, sizes), **at)
        for i, shape in enumerate(shard_shapes):
            piece = insert(gm, operator.getitem, (pieces, i), **at)
            outs.append(insert(gm, aten.view.default, (piece, list(shape)), **at))
    else:
        _, world, group = node.args
        # _chunk_cat packs along dim 0: a 0-d member (a learnable scalar) goes in as a view of shape [1]
        xs = [insert(gm, aten.view.default, (x, [1]), **at) if v.dim() == 0 else x for x, v in zip(xs, vals)]
        table = insert(gm, aten._chunk_cat.default, (list(xs), 0, 1), **at)  # one copy, any strides
        flat = insert(gm, aten.view.default, (table, [-1]), **at)
        done = _collective(gm, c10d.all_reduce.default, (flat, "avg", group), ("all_reduce", xs), at)
        pieces = insert(gm, aten.split_with_sizes.default, (done, [_numel(v) for v in vals]), **at)
        for i, val in enumerate(vals):
            piece = insert(gm, operator.getitem, (pieces, i), **at)
            outs.append(insert(gm, aten.view.default, (piece, list(val.shape)), **at))
    for user in list(node.users):
        assert user.target is operator.getitem, f"bucket {node.name} read by {user.target}"
        user.replace_all_uses_with(outs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
