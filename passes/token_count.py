"""``token_count``: the graph that counts a pipelined token mean's tokens from the step's inputs alone, before any
micro-batch runs (``zgraph.passes.micro_batch_loss``).

A mean over tokens (``cross_entropy`` over the labels not ``ignore_index``; a masked sum over a count of labels, as
``cross_entropy``'s ``label_smoothing`` term) divides by the whole batch's count, while a schedule runs most
micro-batches' forwards after the first backward. The labels are read from the batch (and shifted, padded or
reshaped on the way): this graph is those ops of the step, followed by the count: a count node's own (a ratio's
denominator), or the one ``nll_loss_forward`` makes of its labels (those not ignored, or with class weights the
sum of their weights; in int64 or float64, cast to the count's dtype once summed over the micro-batches). None
where the count depends on anything but the step's inputs and buffers (an activation, a parameter: labels a
teacher's argmax).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zgraph.graph import INPUT, OUTPUTS, VAL, GraphOutput

aten = torch.ops.aten
_READABLE = ("input", "buffer")  # placeholders a count may read: the micro-batch and the step's buffers


def count_graph(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The graph of ``node``'s count from ``gm``'s inputs alone (placeholders keep their ``GraphInput``): an
    ``nll_loss_forward``'s ``total_weight``, or ``node``'s value; None where the count reads anything else."""
    nll = node.target is aten.nll_loss_forward.default
    target, weight = (node.args[1], node.args[2]) if nll else (node, None)
    needed = _ancestors([a for a in (target, weight) if isinstance(a, fx.Node)])
    if any(n.op == "placeholder" and n.meta[INPUT].kind not in _READABLE for n in needed):
        return None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n in needed:
            env[n] = graph.node_copy(n, env.__getitem__)
            if n.op == "placeholder":
                env[n].meta[INPUT] = n.meta[INPUT]
    count = _nll_count(graph, node, env) if nll else env[node]
    out = graph.output((count,))
    out.meta[OUTPUTS] = [GraphOutput("batch_count", node.name, 0)]
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph)


def count_dtype(node: fx.Node) -> torch.dtype:
    """The dtype of ``node``'s count as its graph reads it (``count_graph`` counts wider)."""
    value = node.meta[VAL]
    return value[1].dtype if node.target is aten.nll_loss_forward.default else value.dtype


def _nll_count(graph: fx.Graph, nll: fx.Node, env: dict[fx.Node, fx.Node]) -> fx.Node:
    """``nll_loss_forward``'s count of its labels (``env[target]``) not ``ignore_index``: their number, or with
    class weights their weights' sum."""
    target, weight, ignore = nll.args[1], nll.args[2], nll.args[4]
    labels = env[target]
    kept = graph.call_function(aten.ne.Scalar, (labels, ignore))
    if weight is not None:
        safe = graph.call_function(aten.where.ScalarOther, (kept, labels, 0))
        weights = graph.call_function(aten.index.Tensor, (env[weight], [safe]))
        kept = graph.call_function(aten.mul.Tensor, (weights, kept))
    wide = torch.int64 if weight is None else torch.float64  # summed over micro-batches, cast once at the end
    return graph.call_function(aten.sum.default, (kept,), {"dtype": wide})


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen
