"""A step graph cut by ``stage_cut`` taken apart: for each pipeline stage, the graphs its actions run.

For stage ``s`` (``StageGraphs``):

- ``forward`` (F, per micro-batch): reads the activations stage ``s - 1`` sends (``GraphInput`` kind
  ``activation``, index = position), the stage's parameters and the step's arguments (the micro-batch's slice);
  returns the activations stage ``s + 1`` reads (``GraphOutput`` kind ``activation``), the values its backward
  reads (kind ``saved``) and the step's results it makes (kind ``user``, one per micro-batch).
- ``backward`` (B, per micro-batch): reads ``saved`` and the gradients stage ``s + 1`` sends (kind
  ``activation_grad``); returns the gradients stage ``s - 1`` reads (kind ``activation_grad``) and each
  parameter's gradient contribution (kind ``grad_contribution``, index = parameter), summed over micro-batches:
  what the step graph's marker (``zgraph::grad_contribution``, the identity) marked; the marker itself is left out.
- ``input_grad`` (I) and ``weight_grad`` (W): the backward split for zero-bubble schedules. I makes what stage
  ``s - 1`` waits for; W (the rest: the parameters' gradients) reads what I leaves it (kind ``partial``).
- ``update`` (once per step): reads each parameter's gradient, averaged over the micro-batches (kind ``grad_mean``:
  the gradient of the whole batch's mean loss), and the stage's state; returns the new state.

A value one stage makes and a later stage reads is passed on by each stage in between (each stage's boundary is
one list of tensors). Nodes ``stage_cut`` left free are copied into every graph that reads them.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from zgraph.errors import PassError
from zgraph.graph import INPUT, OUTPUTS, VAL, GraphInput, GraphOutput, eliminate_dead_code, output_node
from zgraph.ops import GRAD_CONTRIBUTION
from zgraph.passes.stage_cut import PER_MICRO_BATCH_RESULTS, STAGE, STAGE_PLAN, Placement

PER_MICRO_BATCH = ("forward", "backward")


@dataclass
class StageGraphs:
    """The graphs of one pipeline stage (see the module's docstring)."""

    stage: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    input_grad: fx.GraphModule
    weight_grad: fx.GraphModule
    update: fx.GraphModule


@dataclass
class _Flow:
    """What crosses each boundary: ``activations[k]`` from stage k to k + 1, ``grads[k]`` from k + 1 to k."""

    activations: list[list[fx.Node]]
    grads: list[list[fx.Node]]
    saved: list[list[fx.Node]]


def stage_graphs(gm: fx.GraphModule) -> list[StageGraphs]:
    """The graphs of every stage of ``gm``, a graph ``stage_cut`` stamped."""
    stages = gm.meta[STAGE_PLAN].stages
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    where: dict[fx.Node, Placement | None] = {n: n.meta[STAGE] for n in nodes}
    flow = _flow(nodes, where, stages)
    out_node = output_node(gm)
    results = list(zip(out_node.args[0], out_node.meta[OUTPUTS]))
    return [_stage(gm, s, nodes, where, flow, results) for s in range(stages)]


def _flow(nodes: list[fx.Node], where: dict, stages: int) -> _Flow:
    flow = _Flow([[] for _ in range(stages)], [[] for _ in range(stages)], [[] for _ in range(stages)])
    for node in nodes:
        placed = where[node]
        if placed is None or placed.part == "update":
            continue
        readers = [where[u] for u in node.users if where.get(u) is not None]
        if placed.part == "forward":
            last = max([r.stage for r in readers], default=placed.stage)
            for k in range(placed.stage, last):
                flow.activations[k].append(node)
            for s in sorted({r.stage for r in readers if r.part == "backward"}):
                flow.saved[s].append(node)
        else:
            first = min([r.stage for r in readers if r.part == "backward"], default=placed.stage)
            for k in range(first, placed.stage):
                flow.grads[k].append(node)
    for kind, lists in (("activation", flow.activations), ("gradient", flow.grads), ("saved", flow.saved)):
        for k, values in enumerate(lists):
            for value in values:
                if not isinstance(value.meta.get(VAL), torch.Tensor):
                    raise PassError(f"the {kind} {value.name} crosses stage {k}'s boundary but is not a tensor")
    return flow


def _stage(gm: fx.GraphModule, s: int, nodes: list[fx.Node], where: dict, flow: _Flow, results: list) -> StageGraphs:
    mine = {part: [n for n in nodes if where[n] == Placement(s, part)] for part in ("forward", "backward", "update")}
    received = flow.activations[s - 1] if s else []
    forward_out = [(v, GraphOutput("activation", v.name, i)) for i, v in enumerate(flow.activations[s])]
    forward_out += [(v, GraphOutput("saved", v.name, i)) for i, v in enumerate(flow.saved[s])]
    forward_out += [(v, r) for v, r in results if _made(v, r, where, Placement(s, "forward"))]
    forward = build_graph(gm, mine["forward"], _inputs("activation", received), forward_out)
    grads_in = _inputs("activation_grad", flow.grads[s])
    saved_in = _inputs("saved", flow.saved[s])
    sent = [(v, GraphOutput("activation_grad", v.name, i)) for i, v in enumerate(flow.grads[s - 1] if s else [])]
    sent += [(v, r) for v, r in results if _made(v, r, where, Placement(s, "backward"))]
    markers = [n for n in mine["backward"] if n.target is GRAD_CONTRIBUTION]
    # a marker is the identity (its kernel a copy): the graph returns what it marks, the output's kind says the rest
    contributions = [(m.args[0], GraphOutput("grad_contribution", m.name, m.args[1])) for m in markers]
    backward = build_graph(gm, mine["backward"], saved_in + grads_in, sent + contributions)
    input_grad, weight_grad = _split_backward(gm, mine["backward"], saved_in + grads_in, sent, contributions)
    grad_means = [(m, GraphInput("grad_mean", m.name, m.args[1])) for m in markers]
    state_out = [(v, r) for v, r in results if not _per_micro_batch(v, r, where) and _in_update(v, s, where, r)]
    update = build_graph(gm, mine["update"], grad_means, state_out)
    return StageGraphs(s, forward, backward, input_grad, weight_grad, update)


def _inputs(kind: str, values: list[fx.Node]) -> list[tuple[fx.Node, GraphInput]]:
    return [(v, GraphInput(kind, v.name, i)) for i, v in enumerate(values)]


def _made(value: object, role: GraphOutput, where: dict, placed: Placement) -> bool:
    """Whether a result made per micro-batch comes from ``placed``."""
    return role.kind in PER_MICRO_BATCH_RESULTS and isinstance(value, fx.Node) and where.get(value) == placed


def _per_micro_batch(value: object, role: GraphOutput, where: dict) -> bool:
    return (
        role.kind in PER_MICRO_BATCH_RESULTS
        and isinstance(value, fx.Node)
        and getattr(where.get(value), "part", "") in PER_MICRO_BATCH
    )


def _in_update(value: object, s: int, where: dict, role: GraphOutput) -> bool:
    """Whether stage ``s``'s update returns this result: one it computes, or state it holds passed through."""
    if isinstance(value, fx.Node) and value.op == "call_function":
        if where.get(value) is None and role.kind == "loss_scale":  # made from a total: every stage has it
            return True
        return where.get(value) == Placement(s, "update")
    owner = role.kind != "user" and getattr(value, "op", "") == "placeholder"
    return owner and _holds(value, s, where)


def _holds(placeholder: fx.Node, s: int, where: dict) -> bool:
    """Whether stage ``s`` holds a state placeholder (its nodes read it), or stage 0 one nobody reads."""
    stages = {where[u].stage for u in placeholder.users if where.get(u) is not None}
    return s in stages or (not stages and s == 0)


def _split_backward(
    gm: fx.GraphModule, body: list[fx.Node], inputs: list, sent: list, contributions: list
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """I: what the values sent down (and results) need; W: the rest, reading what I made (kind ``partial``)."""
    needed: set[fx.Node] = set()
    stack = [v for v, _ in sent if isinstance(v, fx.Node)]
    inside = set(body)
    while stack:
        node = stack.pop()
        if node in inside and node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    # W reads a multi-output node's elements (its getitems run in I): a graph returns tensors, not tuples
    tuples = {n for n in needed if isinstance(n.meta.get(VAL), (tuple, list))}
    needed |= {u for n in tuples for u in n.users if u in inside and u.target is operator.getitem}
    first = [n for n in body if n in needed]
    rest = [n for n in body if n not in needed]
    partial = [n for n in first if any(u in rest for u in n.users)]
    partial_io = [(n, GraphInput("partial", n.name, i)) for i, n in enumerate(partial)]
    handed = [(n, GraphOutput("partial", n.name, i)) for i, n in enumerate(partial)]
    return build_graph(gm, first, inputs, sent + handed), build_graph(gm, rest, inputs + partial_io, contributions)


def build_graph(
    gm: fx.GraphModule,
    body: list[fx.Node],
    boundary: list[tuple[fx.Node, GraphInput]],
    outputs: list[tuple[object, GraphOutput]],
) -> fx.GraphModule:
    """A graph of ``body`` (in order): ``boundary`` values become its first inputs, the original graph's inputs
    it reads come next, free nodes it reads are copied in; it returns ``outputs``."""
    inside, given = set(body), {v for v, _ in boundary}
    copied: list[fx.Node] = []
    reads: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(node: fx.Node) -> None:
        if node in seen or node in inside or node in given:
            return
        seen.add(node)
        if node.op == "placeholder":
            reads.append(node)
            return
        if node.meta.get(STAGE) is not None:
            raise AssertionError(f"stage graph: {node.name} ({node.meta[STAGE]}) is read but not received")
        for a in node.all_input_nodes:
            visit(a)
        copied.append(node)

    for node in body:
        for a in node.all_input_nodes:
            visit(a)
    for value, _ in outputs:
        if isinstance(value, fx.Node):
            visit(value)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value, spec in boundary:
        env[value] = graph.placeholder(f"{spec.kind}_{value.name}")
        env[value].meta = {VAL: value.meta.get(VAL), INPUT: spec}
    for node in sorted(reads, key=order.__getitem__):
        env[node] = graph.placeholder(node.name)
        env[node].meta = {VAL: node.meta.get(VAL), INPUT: node.meta[INPUT]}
    for node in sorted([*copied, *body], key=order.__getitem__):
        env[node] = graph.node_copy(node, lambda n: env[n])
    result = graph.output(tuple(env[v] if isinstance(v, fx.Node) else v for v, _ in outputs))
    result.meta[OUTPUTS] = [role for _, role in outputs]
    eliminate_dead_code(graph)
    module = _LazyGraphModule(gm, graph)
    module.meta = {k: v for k, v in copy.copy(getattr(gm, "meta", {})).items() if k != "zgraph_updated_inputs"}
    return module
