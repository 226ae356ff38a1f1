"""A ``cross_entropy`` / ``nll_loss`` mean over tokens rewritten as a sum over another count: what sequence
parallelism (each rank's tokens, divided by the global count) and pipeline parallelism (each micro-batch's sum over
the whole batch's count, counted first; or divided by it after the last micro-batch) share.

``nll_loss_forward`` with reduction mean returns ``(total, count)``: the mean over ``count`` counted tokens (those
whose label is not ``ignore_index``; with class weights, the sum of their weights). Its backward reads ``count`` as
``total_weight``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from zgraph.graph import PHASE, compute_val, insert

aten = torch.ops.aten
MEAN, SUM = 1, 2  # nll_loss's reduction codes


def token_means(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's ``nll_loss_forward`` nodes that take the mean over their counted tokens."""
    return [n for n in gm.graph.nodes if n.target is aten.nll_loss_forward.default and n.args[3] == MEAN]


def count_of(node: fx.Node) -> fx.Node | None:
    """The count (``total_weight``) an ``nll_loss_forward`` node returns, if the graph reads it."""
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == 1), None)


def as_sum_over(
    gm: fx.GraphModule, node: fx.Node, share: Callable[[fx.Node], fx.Node] | None, mode: object
) -> fx.Node | None:
    """``node`` (mean) becomes its sum over ``share(count)``, in the forward and in the backward; with ``share``
    None, the plain sum (the backward that of the sum). Returns the count node (None: the graph reads none)."""
    count = count_of(node)
    if count is None:
        return None
    total = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 0), None)
    node.args = (*node.args[:3], SUM, *node.args[4:])
    backwards = [u for u in count.users if u.target is aten.nll_loss_backward.default and u.args[6] is count]
    if share is None:
        for user in backwards:
            user.args = (*user.args[:4], SUM, *user.args[5:])
        if total is not None:
            compute_val(total, mode)
        return count
    divisor = share(count)
    for user in backwards:
        user.args = (*user.args[:6], divisor)
    if total is not None:
        compute_val(total, mode)
        mean = insert(gm, aten.div.Tensor, (total, divisor), after=divisor, phase=node.meta.get(PHASE), mode=mode)
        total.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)
    return count
