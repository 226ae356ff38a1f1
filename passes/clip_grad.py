"""``clip_grad``: norms of sharded gradients from the shards, with one all-reduce.

Capture records every norm of a parameter's gradient (what ``torch.nn.utils.clip_grad_norm_`` computes, in the
user's step or for ``Config.max_grad_norm``) as ``zgraph::grad_norm(g, ord)``. Where the gradient is sharded
(stage ≥ 2: the norm reads ``unshard`` of a reduce-scatter), this pass computes it from this rank's shard — zero
padding adds nothing — and ``combine``s the partial results over ranks: sum of ``|x|^ord`` (then the root) for
finite orders, max of ``|x|`` for the infinity norm — all of one order with a single all-reduce. Norms of
whole gradients (stage ≤ 1, or one process) stay as they are and are computed exactly as eager does.

Afterwards no ``grad_norm`` reads a gathered gradient (tested in ``tests/test_pass_units.py``).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from zgraph.graph import PHASE, eliminate_dead_code, fake_mode, insert
from zgraph.ops import COMBINE, GRAD_NORM, REDUCE, REDUCE_SHARD, UNSHARD
from zgraph.passes.pass_list import PassContext

aten = torch.ops.aten


def sharded_gradient(node: fx.Node) -> fx.Node | None:
    """The reduce-scattered shard behind a gathered gradient, maybe cast (its padding is zero), or None."""
    if node.target is not UNSHARD:
        return None
    shard = node.args[0]
    source = shard
    while (source.target is aten._to_copy.default and set(source.kwargs) == {"dtype"}) or source.target is REDUCE:
        source = source.args[0]  # a cast, or hybrid sharding's all-reduce of the shard across groups
    return shard if source.target is REDUCE_SHARD else None


def clip_grad(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Compute norms of sharded gradients from shards plus one all-reduce of partial sums."""
    if not ctx.distributed:
        return gm
    mode = fake_mode(gm)
    by_order: dict[tuple, list[tuple[fx.Node, fx.Node]]] = {}
    for node in gm.graph.nodes:
        if node.target is GRAD_NORM and sharded_gradient(node.args[0]) is not None:
            gathered_over = tuple(node.args[0].args[2:])  # (world size, group) the shards are combined over
            by_order.setdefault((node.args[1], gathered_over), []).append((node, sharded_gradient(node.args[0])))
    for (order, group), norms in by_order.items():
        partials = [_partial(gm, node, shard, order, mode) for node, shard in norms]
        combined = _combine_all(gm, partials, [n for n, _ in norms], order, group, mode)
        for (node, _), value in zip(norms, combined):
            if not math.isinf(order):
                value = insert(gm, aten.pow.Tensor_Scalar, (value, 1.0 / order), after=value, mode=mode)
            dtype = node.meta["val"].dtype
            if value.meta["val"].dtype != dtype:
                value = insert(gm, aten._to_copy.default, (value,), {"dtype": dtype}, after=value, mode=mode)
            node.replace_all_uses_with(value)
            gm.graph.erase_node(node)
    eliminate_dead_code(gm.graph)
    return gm


def _partial(gm: fx.GraphModule, node: fx.Node, shard: fx.Node, order: float, mode: object) -> fx.Node:
    """This rank's share of the norm: ``max |x|`` (infinity norm) or ``sum |x|^ord`` in float32."""
    at = dict(before=node, phase=node.meta.get(PHASE), mode=mode)
    magnitude = insert(gm, aten.abs.default, (shard,), **at)
    wide = insert(gm, aten._to_copy.default, (magnitude,), {"dtype": torch.float32}, **at)
    if math.isinf(order):
        return insert(gm, aten.amax.default, (wide, []), **at)
    powered = insert(gm, aten.pow.Tensor_Scalar, (wide, order), **at)
    return insert(gm, aten.sum.default, (powered,), **at)


def _combine_all(
    gm: fx.GraphModule, partials: list[fx.Node], norms: list[fx.Node], order: float, group: tuple, mode: object
) -> list[fx.Node]:
    """The partials of the ranks of ``group`` (world size, name: those the shards are cut across; with hybrid
    sharding the shard group, whose shards every group holds alike) combined (sum, or max for the infinity norm):
    one all-reduce of them all, placed after the last partial, when that is before every reader of the norms;
    else one per norm."""
    op = "max" if math.isinf(order) else "sum"
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    last = max(partials, key=position.__getitem__)
    first_reader = min((u for n in norms for u in n.users), key=position.__getitem__)
    if position[last] > position[first_reader]:
        return [insert(gm, COMBINE, (p, op, *group), after=p, phase=p.meta.get(PHASE), mode=mode) for p in partials]
    at = dict(after=last, phase=last.meta.get(PHASE), mode=mode)
    stacked = insert(gm, aten.stack.default, (partials,), **at)
    total = insert(gm, COMBINE, (stacked, op, *group), after=stacked, phase=stacked.meta.get(PHASE), mode=mode)
    values = []
    anchor = total
    for i in range(len(partials)):
        anchor = insert(gm, aten.select.int, (total, 0, i), after=anchor, phase=total.meta.get(PHASE), mode=mode)
        values.append(anchor)
    return values
