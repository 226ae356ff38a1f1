"""``cse``: merge nodes that compute the same pure op on the same inputs; drop ``detach`` and ``alias``.

The captured step repeats work that eager PyTorch does in Python floats or once per parameter: the optimizer
kernels compute ``1 - beta1``, ``1 - beta2``... for every parameter, views like ``t(weight)`` are taken in
forward and again in backward. Only ops whose schema mutates nothing and that are not random
(``nondeterministic_seeded``) are merged; collectives, waits and zgraph's markers are never merged.

``detach`` and ``alias`` are identities in a graph that runs without autograd (its backward is explicit ops);
capture leaves many (every ``.grad`` read, ``.detach()`` in user code), and they would pin later passes'
placement decisions (a gradient's first reader would be its ``detach``), so they are removed.

Provides nothing new; keeps every property (the graph computes the same values with fewer nodes).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx as fx

from zgraph.graph import eliminate_dead_code

_IDENTITIES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _mergeable(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return _pure(target)


@functools.cache
def _pure(target: torch._ops.OpOverload) -> bool:
    """An aten op that mutates nothing and is deterministic (read once per op: schemas and tags are slow)."""
    if target.namespace != "aten":
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not any(torch.Tag.nondeterministic_bitwise == t for t in target.tags)


def _key(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return ("node", value)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, float) and value != value:  # NaN never equals itself
        return ("nan",)
    return (type(value).__name__, value)


def eliminate_common_subexpressions(gm: fx.GraphModule, ctx: object) -> fx.GraphModule:
    """Merge repeated pure computations (same op, same inputs) into one node."""
    seen: dict[Any, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.target in _IDENTITIES:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            continue
        if not _mergeable(node):
            continue
        key = (node.target, _key(node.args), _key(node.kwargs))
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        node.replace_all_uses_with(first)
        gm.graph.erase_node(node)
    eliminate_dead_code(gm.graph)
    return gm
