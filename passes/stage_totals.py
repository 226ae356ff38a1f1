"""``stage_totals`` (pipeline parallelism): a value over every stage's gradients, cut into per-stage partials and
one total combined over the pipeline.

Two updates read the gradients of every parameter: ``clip_grad_norm_`` (``Config.max_grad_norm``, or the step's
own) takes the norm of the stacked per-parameter norms (``linalg_vector_norm(stack([grad_norm(g), ...]), ord)``),
and fp16 loss scaling checks every gradient for inf/nan (``zgraph::nonfinite([g, ...])``). ``stage_cut`` places
each update node in the one stage whose state it reads; for these two it calls ``split_across_stages``, which
rewrites them:

- each stage computes its partial from its own gradients (a sum of ``|norm|^ord`` in float32, or the max for the
  infinity norm; its gradients' overflow flag as an int), returned as ``GraphOutput`` kind ``stage_partial``
  (name: the total's, index: the stage);
- the total is a placeholder, ``GraphInput`` kind ``stage_total`` (``field``: ``"sum"`` or ``"max"``), which the
  runtime fills by combining every stage's partial over the pipeline (``zgraph.runtime.pipeline_run``); the norm
  (its ``1/ord`` power) or the flag made from it is a free node, copied into every stage's update that reads it
  (``returned_totals``: what the step returns of them, a copy).

Every stage thus clips by the same global coefficient, and skips (or not) the same step, as eager does.
``split_update`` then cuts a stage's update graph in two: the part its partials need (run first, on every stage),
and the rest, which reads the totals (``GraphInput`` kind ``handed`` for what the first part made and the rest
reads). ``total_inputs`` lists a graph's ``stage_total`` placeholders.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx

from zgraph.graph import (
    INPUT,
    OPTIMIZER,
    OUTPUTS,
    PHASE,
    VAL,
    GraphInput,
    GraphOutput,
    add_input,
    fake_mode,
    insert,
    output_node,
    output_roles,
)
from zgraph.ops import GRAD_CONTRIBUTION, NONFINITE

aten = torch.ops.aten
StageOf = Callable[[fx.Node], int | None]  # the stage of an update node's input (None: not one stage's)
Partials = tuple[list[tuple[fx.Node, int]], list[fx.Node]]  # each partial with its stage; the total and its reads
Split = tuple[dict[fx.Node, int], list[fx.Node]]


def split_across_stages(gm: fx.GraphModule, node: fx.Node, where: Mapping[fx.Node, Any]) -> Split | None:
    """Rewrite ``node``, an update node reading several stages' values (``where``: ``stage_cut``'s placements), as
    per-stage partials and a total (see the module's docstring). Returns each node made for a stage, with its
    stage, and the total and the nodes made to read it (free); None where ``node`` is not one of the two."""

    def stage_of(value: fx.Node) -> int | None:
        placed = where.get(value)
        ours = placed is not None and (placed.part == "update" or value.target is GRAD_CONTRIBUTION)
        return placed.stage if ours else None

    norm = next(iter(node.users)) if len(node.users) == 1 else None
    split: Partials | None = None
    if node.target is NONFINITE:
        split = _overflow(gm, node, stage_of)
    elif node.target is aten.stack.default and norm is not None and _whole_norm(norm, node):
        split = _norm(gm, node, norm, stage_of)
    if split is None:
        return None
    made: dict[fx.Node, int] = {}
    for part, stage in split[0]:
        stack = [part]
        while stack:
            new = stack.pop()
            if new.op == "call_function" and new not in where and new not in made:
                made[new] = stage
                stack.extend(new.all_input_nodes)
    return made, split[1]


def _whole_norm(norm: fx.Node, stacked: fx.Node) -> bool:
    """``linalg_vector_norm(stacked, ord)`` over every element (no ``dim``, ``keepdim`` or ``dtype``)."""
    plain = all(a in (None, False) for a in norm.args[2:]) and not norm.kwargs
    return norm.target is aten.linalg_vector_norm.default and norm.args[:1] == (stacked,) and plain


def _by_stage(values: list, stage_of: StageOf) -> dict[int, list[fx.Node]] | None:
    groups: dict[int, list[fx.Node]] = {}
    for value in values:
        stage = stage_of(value) if isinstance(value, fx.Node) else None
        if stage is None:
            return None
        groups.setdefault(stage, []).append(value)
    return groups if len(groups) > 1 else None  # one stage's: nothing to split


def _norm(gm: fx.GraphModule, stacked: fx.Node, norm: fx.Node, stage_of: StageOf) -> Partials | None:
    """``linalg_vector_norm(stack(norms), ord)``: each stage's ``sum |n|^ord`` (``max |n|``), the total's root."""
    groups = _by_stage(list(stacked.args[0]), stage_of)
    order = float(norm.args[1]) if len(norm.args) > 1 else 2.0
    if groups is None or order <= 0 or any(n.meta[VAL].dim() for g in groups.values() for n in g):
        return None
    mode = fake_mode(gm)
    partials = []
    for stage, values in sorted(groups.items()):
        at = dict(before=stacked, phase=stacked.meta.get(PHASE), mode=mode)
        part = insert(gm, aten.stack.default, (values,), **at)
        part = insert(gm, aten.abs.default, (part,), **at)
        part = insert(gm, aten._to_copy.default, (part,), {"dtype": torch.float32}, **at)
        if math.isinf(order):
            part = insert(gm, aten.amax.default, (part, []), **at)
        else:
            part = insert(gm, aten.sum.default, (insert(gm, aten.pow.Tensor_Scalar, (part, order), **at),), **at)
        partials.append((part, stage))
    op = "max" if math.isinf(order) else "sum"
    total = _total(gm, norm, partials, op)
    at = dict(after=total, phase=norm.meta.get(PHASE), mode=mode)
    value = total if math.isinf(order) else insert(gm, aten.pow.Tensor_Scalar, (total, 1.0 / order), **at)
    if value.meta[VAL].dtype != norm.meta[VAL].dtype:
        value = insert(gm, aten._to_copy.default, (value,), {"dtype": norm.meta[VAL].dtype}, after=value, mode=mode)
    norm.replace_all_uses_with(value)
    gm.graph.erase_node(norm)
    gm.graph.erase_node(stacked)
    return partials, [n for n in gm.graph.nodes if n is total or n is value or n in value.all_input_nodes]


def _overflow(gm: fx.GraphModule, check: fx.Node, stage_of: StageOf) -> Partials | None:
    """``nonfinite(grads)``: each stage's flag of its gradients (an int32), the total their max (as bool)."""
    groups = _by_stage(list(check.args[0]), stage_of)
    if groups is None:
        return None
    mode = fake_mode(gm)
    partials = []
    for stage, grads in sorted(groups.items()):
        at = dict(before=check, phase=check.meta.get(PHASE), mode=mode)
        flag = insert(gm, NONFINITE, (grads,), **at)
        partials.append((insert(gm, aten._to_copy.default, (flag,), {"dtype": torch.int32}, **at), stage))
    total = _total(gm, check, partials, "max")
    flag = insert(gm, aten._to_copy.default, (total,), {"dtype": torch.bool}, after=total, mode=mode)
    check.replace_all_uses_with(flag)
    gm.graph.erase_node(check)
    return partials, [total, flag]


def returned_totals(gm: fx.GraphModule, free: set[fx.Node]) -> list[fx.Node]:
    """A value made of totals alone that the step returns as a result (the norm ``clip_grad_norm_`` returns) is
    free, copied into every update that reads it: the step returns a copy of it instead, for one stage to make.
    The copies."""
    out, roles, copies = output_node(gm), output_roles(gm), {}
    for node, role in zip(out.args[0], roles):
        if role.kind == "user" and node in free and node.meta.get(PHASE) == OPTIMIZER and node not in copies:
            with gm.graph.inserting_after(node):
                copies[node] = gm.graph.node_copy(node)
    out.args = (tuple(copies.get(v, v) if r.kind == "user" else v for v, r in zip(out.args[0], roles)),)
    return list(copies.values())


def total_inputs(gm: fx.GraphModule) -> list[fx.Node]:
    """``gm``'s placeholders of values combined across stages (``GraphInput`` kind ``stage_total``), in order."""
    return [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[INPUT].kind == "stage_total"]


def _total(gm: fx.GraphModule, node: fx.Node, partials: list[tuple[fx.Node, int]], op: str) -> fx.Node:
    """The placeholder of the total the partials combine to (``op`` over them), and the partials returned."""
    spec = GraphInput("stage_total", node.name, len(total_inputs(gm)), field=op)
    total = add_input(gm, f"stage_total_{node.name}", spec, partials[0][0].meta[VAL])
    out = output_node(gm)
    roles = [GraphOutput("stage_partial", node.name, stage) for _, stage in partials]
    out.args = ((*out.args[0], *(p for p, _ in partials)),)
    out.meta[OUTPUTS] = [*out.meta[OUTPUTS], *roles]
    return total


def split_update(gm: fx.GraphModule, build: Callable) -> tuple[fx.GraphModule, fx.GraphModule] | None:
    """A stage's update graph with ``stage_partial`` outputs cut in two: what the partials need, returning them and
    what the rest reads of it (kind ``handed``), and the rest, reading those. ``build(gm, body, boundary, outputs)``
    makes a graph (``zgraph.passes.stage_graphs``). None where the graph has no partials."""
    out = output_node(gm)
    results = list(zip(out.args[0], out.meta[OUTPUTS]))
    partials = [(v, r) for v, r in results if r.kind == "stage_partial"]
    if not partials:
        return None
    body = [n for n in gm.graph.nodes if n.op == "call_function"]
    needed: set[fx.Node] = set()
    stack = [v for v, _ in partials]
    while stack:
        node = stack.pop()
        if node.op == "call_function" and node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    tuples = {n for n in needed if isinstance(n.meta.get(VAL), (tuple, list))}
    needed |= {u for n in tuples for u in n.users if u.target is operator.getitem}
    first = [n for n in body if n in needed]
    rest = [n for n in body if n not in needed]
    others = [(v, r) for v, r in results if r.kind != "stage_partial"]
    read_later = {a for n in rest for a in n.all_input_nodes} | {v for v, _ in others if isinstance(v, fx.Node)}
    handed = [n for n in first if n in read_later]
    before = build(gm, first, [], partials + [(n, GraphOutput("handed", n.name, i)) for i, n in enumerate(handed)])
    after = build(gm, rest, [(n, GraphInput("handed", n.name, i)) for i, n in enumerate(handed)], others)
    return before, after
