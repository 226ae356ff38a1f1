"""Partition a transformed joint graph (a split step: forward, then backward from tangent inputs) into a forward
graph and a backward graph.

Backward = every node that depends on a tangent input, or that only they need (a stage-3 gather the backward
reads, the gradient buckets and reduce-scatters); forward = everything the forward's outputs (the step's
returned tensors, updated buffers) need. Saved values are forward nodes and inputs the backward reads: the
forward graph returns them after its own outputs (``GraphOutput`` kind ``saved``), the backward graph receives
them first (``GraphInput`` kind ``saved``), then the tangents (``GraphInput`` kind ``tangent``, index = position
among the tangents). Gradients (``grad``, ``input_grad`` outputs) are the backward's outputs.

Random draws and generator-state reads (``nondeterministic_seeded`` ops) of the forward phase stay in the
forward even where only the backward reads them: ``torch.utils.checkpoint`` reads the generator state before a
block's forward, and its recomputation in the backward sets it back; read in the backward, it would be a later
state.

Nodes that only read inputs and move or reshape them (views, casts, collectives and their waits: a stage-3
all-gather of a parameter) are recomputed in the backward rather than saved, so the backward does not keep the
whole parameters alive between the two calls.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from zgraph.graph import (
    FORWARD,
    INPUT,
    OUTPUTS,
    PHASE,
    VAL,
    GraphInput,
    GraphOutput,
    collective_kind,
    eliminate_dead_code,
    output_node,
)

GRAD_KINDS = ("grad", "input_grad")


@dataclass
class Partition:
    """The two graphs of a split step and what connects them."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    n_saved: int


_MOVES = (
    "wait_tensor",
    "all_gather",
    "view",
    "reshape",
    "aten.t.",
    "convert_element",
    "slice",
    "narrow",
    "split",
    "getitem",
    "permute",
    "transpose",
    "expand",
    "_to_copy",
)


def _recomputable(node: fx.Node, cheap: set[fx.Node]) -> bool:
    """A node the backward may recompute from inputs instead of saving: a view, cast, collective or wait whose
    arguments are inputs or such nodes."""
    if node.op != "call_function":
        return False
    name = str(node.target)
    movable = collective_kind(node) is not None or any(key in name for key in _MOVES)
    return movable and all(arg in cheap for arg in node.all_input_nodes)


def partition(gm: fx.GraphModule, tangents: set[int]) -> Partition:
    """Cut ``gm``; ``tangents``: argument-leaf indices of its tangent inputs (``GraphInput`` kind ``input``)."""
    nodes = list(gm.graph.nodes)
    out = output_node(gm)
    roles: list[GraphOutput] = out.meta[OUTPUTS]
    values = list(out.args[0])
    tangent_nodes = [n for n in nodes if n.op == "placeholder" and _is_tangent(n, tangents)]
    after_tangent: set[fx.Node] = set(tangent_nodes)
    for node in nodes:
        if node.op != "placeholder" and any(a in after_tangent for a in node.all_input_nodes):
            after_tangent.add(node)
    forward_outs = [(v, r) for v, r in zip(values, roles) if r.kind not in GRAD_KINDS]
    backward_outs = [(v, r) for v, r in zip(values, roles) if r.kind in GRAD_KINDS]
    for value, role in forward_outs:
        if isinstance(value, fx.Node) and value in after_tangent:
            raise AssertionError(f"split step: output {role.name} ({role.kind}) depends on a tangent")
    forward_set: set[fx.Node] = set()
    stack = [v for v, _ in forward_outs if isinstance(v, fx.Node)]
    stack += [n for n in nodes if _drawn_in_forward(n) and n not in after_tangent]
    while stack:
        node = stack.pop()
        if node in forward_set:
            continue
        forward_set.add(node)
        stack.extend(node.all_input_nodes)
    for node in nodes:  # inputs that feed no forward node still belong to the forward (it reads them)
        if node.op == "placeholder" and node not in after_tangent:
            forward_set.add(node)
    cheap = {n for n in nodes if n.op == "placeholder" and n not in after_tangent}
    for node in nodes:
        if node not in after_tangent and _recomputable(node, cheap):
            cheap.add(node)
    in_backward = {n for n in nodes if n.op not in ("placeholder", "output") and n not in forward_set}
    stack = list(in_backward)
    while stack:  # recompute what only moves inputs instead of saving it
        for arg in stack.pop().all_input_nodes:
            if arg in cheap and arg.op != "placeholder" and arg not in in_backward:
                in_backward.add(arg)
                stack.append(arg)
    for node in list(in_backward):  # an element of a forward op's tuple (layer norm's mean): saved, not the tuple
        if node.target is operator.getitem and node.args[0] not in in_backward:
            in_backward.discard(node)
            forward_set.add(node)
    backward_set = [n for n in nodes if n in in_backward]
    saved: list[fx.Node] = []
    for node in backward_set:
        for arg in node.all_input_nodes:
            if arg not in in_backward and arg not in tangent_nodes and arg not in saved:
                saved.append(arg)
    for value, _ in backward_outs:
        if isinstance(value, fx.Node) and value not in in_backward and value not in saved:
            saved.append(value)  # a gradient the forward already knows (zeros): passed through
    saved.sort(key=nodes.index)
    forward = _forward_graph(gm, nodes, forward_set, forward_outs, saved)
    backward = _backward_graph(gm, backward_set, saved, tangent_nodes, backward_outs, tangents)
    return Partition(forward, backward, len(saved))


def _drawn_in_forward(node: fx.Node) -> bool:
    """A random draw or generator-state operation of the forward phase (it must run when the forward does)."""
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in tags and node.meta.get(PHASE) == FORWARD


def _is_tangent(node: fx.Node, tangents: set[int]) -> bool:
    spec = node.meta.get(INPUT)
    return spec is not None and spec.kind == "input" and spec.index in tangents


def _forward_graph(
    gm: fx.GraphModule, nodes: list[fx.Node], keep: set[fx.Node], outs: list, saved: list[fx.Node]
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node in keep:
            env[node] = graph.node_copy(node, lambda n: env[n])
    saved_roles = [GraphOutput("saved", n.name, i) for i, n in enumerate(saved)]
    results = [env[v] if isinstance(v, fx.Node) else v for v, _ in outs] + [env[n] for n in saved]
    output = graph.output(results)
    output.meta[OUTPUTS] = [r for _, r in outs] + saved_roles
    return _module(gm, graph)


def _backward_graph(
    gm: fx.GraphModule,
    body: list[fx.Node],
    saved: list[fx.Node],
    tangent_nodes: list[fx.Node],
    outs: list,
    tangents: set[int],
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(saved):
        env[node] = graph.placeholder(f"saved_{node.name}")
        env[node].meta = {VAL: node.meta.get(VAL), INPUT: GraphInput("saved", node.name, i)}
    order = sorted(tangents)
    for node in tangent_nodes:
        position = order.index(node.meta[INPUT].index)
        env[node] = graph.placeholder(f"tangents_{position}")
        env[node].meta = {VAL: node.meta.get(VAL), INPUT: GraphInput("tangent", node.meta[INPUT].name, position)}
    for node in body:
        env[node] = graph.node_copy(node, lambda n: env[n])
    output = graph.output([env[v] if isinstance(v, fx.Node) else v for v, _ in outs])
    output.meta[OUTPUTS] = [r for _, r in outs]
    return _module(gm, graph)


def _module(gm: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    eliminate_dead_code(graph)
    new = _LazyGraphModule(gm, graph)
    new.meta = copy.copy(getattr(gm, "meta", {}))
    new.meta.pop("zgraph_updated_inputs", None)
    return new
