"""Symbolic sizes in a step graph (part of the contract, ``zgraph.graph``).

A graph captured with symbolic sizes (some dims of the step's tensor arguments: the batch, the sequence) carries
backed ``torch.SymInt``s in its values' shapes. Passes decide at the sizes it was captured at (their hints: no
guard is added, so the graph stays valid at every size) and write the symbols, not ints, where the graph computes
with a size; ``bind_sizes`` (run by the pass list after each pass) makes the graph compute a symbol a pass wrote
into an op's arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true

from zgraph.graph import FORWARD, INPUT, PHASE, VAL, placeholders


def size_hint(value: int | torch.SymInt) -> int:
    """A size as an int: a symbolic one's hint (the size it was captured at), without adding a guard. For decisions
    (what to recompute, offload, bucket, prefetch); where the graph computes with the size, keep the symbol."""
    return optimization_hint(value) if isinstance(value, torch.SymInt) else int(value)


def same_size(a: int | torch.SymInt, b: int | torch.SymInt) -> bool:
    """``a == b`` for every value of the size symbols (decided without adding a guard: False when it may not be)."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return statically_known_true(a == b)
    return a == b


def same_shape(a: Sequence[int | torch.SymInt], b: Sequence[int | torch.SymInt]) -> bool:
    """Two shapes equal for every value of the size symbols (``same_size`` of each dimension; no guard)."""
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def symbolic_bytes(value: Any) -> sympy.Expr:
    """Bytes of a tensor (or of the tensors in a list/tuple) as an expression of the size symbols (a number when its
    sizes are static)."""
    if isinstance(value, torch.Tensor):
        numel = value.numel()
        expr = numel.node.expr if isinstance(numel, torch.SymInt) else sympy.Integer(numel)
        return expr * value.element_size()
    if isinstance(value, (list, tuple)):
        return sympy.Add(*(symbolic_bytes(v) for v in value))
    return sympy.Integer(0)


def bind_sizes(gm: fx.GraphModule) -> None:
    """Every symbolic size an op takes as an argument (a pass wrote a symbolic value's ``shape`` into an op's
    arguments: a reshape, a collective's splits, a position's offset) computed by the graph from its inputs' sizes
    (torch's ``Graph.materialize_symints``: ``aten.sym_size.int`` of an input and Python arithmetic, right before
    the op), so the graph runs at every size; a no-op on a graph of static sizes. Run by the pass list after
    each pass."""
    if not _size_sources(gm):
        return
    graph = gm.graph
    known: dict[sympy.Expr, fx.Node] = {}  # nodes computing a size, before the node being looked at
    for node in list(graph.nodes):
        val = node.meta.get(VAL)
        if node.op == "call_function" and isinstance(val, torch.SymInt):
            known.setdefault(val.node.expr, node)
        wanted = _symints(node) if node.op in ("call_function", "output") else []
        if not wanted:
            continue
        new = list({a.node.expr: a for a in wanted if a.node.expr not in known and not a.node.expr.is_number}.values())
        if new:
            first = node.prev
            with graph.inserting_before(node):
                made = graph.materialize_symints(new)
            known.update({a.node.expr: m for a, m in zip(new, made) if isinstance(m, fx.Node)})
            made_node = node.prev
            while made_node is not first:
                made_node.meta.setdefault(PHASE, node.meta.get(PHASE, FORWARD))
                made_node = made_node.prev

        def bound(arg: Any) -> Any:
            if not isinstance(arg, torch.SymInt):
                return arg
            return int(arg.node.expr) if arg.node.expr.is_number else known[arg.node.expr]

        node.args = fx.node.map_aggregate(node.args, bound)
        node.kwargs = fx.node.map_aggregate(node.kwargs, bound)


def _symints(node: fx.Node) -> list[torch.SymInt]:
    found: list[torch.SymInt] = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda a: found.append(a) if isinstance(a, torch.SymInt) else a)
    return found


def size_symbols(gm: fx.GraphModule) -> dict[str, tuple[str, int]]:
    """Each size symbol of the graph's inputs, by name: the input (``GraphInput.name``: an argument's path) and the
    dimension it is the size of."""
    sources = _size_sources(gm).items()
    return {str(symbol): (getattr(node.meta.get(INPUT), "name", node.name), dim) for symbol, (node, dim) in sources}


def input_sizes(gm: fx.GraphModule) -> dict[sympy.Symbol, tuple[int, int]]:
    """Each size symbol that is a dimension of one of the step's tensor arguments (``GraphInput`` kind ``input``):
    the argument's index among them and the dimension (what ``concrete_shape`` reads a call's sizes from)."""
    return {
        symbol: (node.meta[INPUT].index, dim)
        for symbol, (node, dim) in _size_sources(gm).items()
        if node.meta[INPUT].kind == "input"
    }


def concrete_shape(shape: Sequence[int | torch.SymInt], sizes: dict[sympy.Symbol, int]) -> tuple[int, ...]:
    """``shape`` at a call's sizes: each symbolic dimension evaluated with ``sizes`` (a value per size symbol)."""
    return tuple(int(d.node.expr.xreplace(sizes)) if isinstance(d, torch.SymInt) else int(d) for d in shape)


def _size_sources(gm: fx.GraphModule) -> dict[sympy.Symbol, tuple[fx.Node, int]]:
    """Each size symbol that is a dimension of a graph input: the placeholder and the dimension."""
    sources: dict[sympy.Symbol, tuple[fx.Node, int]] = {}
    for node in placeholders(gm):
        val = node.meta.get(VAL)
        if isinstance(val, torch.Tensor):
            for dim, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    sources.setdefault(size.node.expr, (node, dim))
    return sources
