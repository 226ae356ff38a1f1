"""``token_count``: the graph that counts a pipelined token mean's tokens from the step's inputs alone, before any
micro-batch runs.

A ``cross_entropy`` token mean over micro-batches (``zgraph.passes.micro_batch_loss``) is divided by the whole
batch's count of labels not ``ignore_index`` (``nll_loss_forward``'s ``total_weight``). Each micro-batch's backward
is seeded with its share of it, so the count must be known before the first backward, while a schedule runs most
micro-batches' forwards after it. The labels are read from the batch (and shifted, padded or reshaped on the way):
this graph is those ops of the stage's forward, followed by the count ``nll_loss_forward`` makes of them (the
labels not ignored, or with class weights the sum of their weights), in its dtype. None where the labels or the
weights depend on anything but the step's inputs and buffers (an activation, a parameter): the runtime then divides
the summed gradients by the count once every micro-batch has run, as it does without a share.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from zgraph.graph import INPUT, OUTPUTS, GraphOutput, output_node, output_roles

aten = torch.ops.aten
_READABLE = ("input", "buffer")  # placeholders the count may read: the micro-batch and the step's buffers


def count_graph(forward: fx.GraphModule) -> fx.GraphModule | None:
    """The graph of ``forward``'s ``loss_count`` output from its inputs alone (placeholders with their
    ``GraphInput``); None where it has none or the count reads anything else."""
    returned = zip(output_node(forward).args[0], output_roles(forward))
    counts = [v for v, r in returned if r.kind == "loss_count"]
    if len(counts) != 1 or not _is_count(counts[0]):
        return None
    loss = counts[0].args[0]
    target, weight, ignore = loss.args[1], loss.args[2], loss.args[4]
    needed = _ancestors([a for a in (target, weight) if isinstance(a, fx.Node)])
    if any(n.op == "placeholder" and n.meta[INPUT].kind not in _READABLE for n in needed):
        return None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in forward.graph.nodes:
        if node in needed:
            env[node] = graph.node_copy(node, env.__getitem__)
            if node.op == "placeholder":
                env[node].meta[INPUT] = node.meta[INPUT]
    dtype = loss.meta["val"][1].dtype
    labels = env[target]
    kept = graph.call_function(aten.ne.Scalar, (labels, ignore))
    if weight is not None:
        safe = graph.call_function(aten.where.ScalarOther, (kept, labels, 0))
        weights = graph.call_function(aten.index.Tensor, (env[weight], [safe]))
        kept = graph.call_function(aten.mul.Tensor, (weights, kept))
    out = graph.output((graph.call_function(aten.sum.default, (kept,), {"dtype": dtype}),))
    out.meta[OUTPUTS] = [GraphOutput("loss_count", "count", 0)]
    graph.eliminate_dead_code()
    return fx.GraphModule(forward, graph)


def _is_count(node: object) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.target is operator.getitem
        and node.args[1] == 1
        and getattr(node.args[0], "target", None) is aten.nll_loss_forward.default
    )


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen
