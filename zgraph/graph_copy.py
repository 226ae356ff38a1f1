"""A step graph's copy, which a pass edits while the pass list keeps the graph it received (part of the contract:
passes, the runtime and inspection copy graphs)."""

from __future__ import annotations

import copy

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose graph can be edited without touching ``gm`` (node meta is shallow-copied).

    The copy is a ``_LazyGraphModule`` (inductor's own): its Python code is generated when it is first called or
    printed, not on every ``recompile()`` — a pass list keeps one graph per pass and most are only inspected. Like
    ``copy.deepcopy``, it carries ``gm``'s create-node and deepcopy hooks (a pass that edits a copy of its graph
    has its nodes stamped by ``run_pass``) and calls the deepcopy hooks with the copy."""
    graph = fx.Graph()
    graph._codegen = copy.copy(gm.graph._codegen)
    value_map: dict[fx.Node, fx.Node] = {}
    out = _copy_nodes(gm.graph, graph, value_map) if _NODES_COPYABLE else graph.graph_copy(gm.graph, value_map)
    old_output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    new_output = graph.output(out)
    new_output.meta = copy.copy(old_output.meta)
    new = _LazyGraphModule(gm, graph)
    new.meta = copy.copy(getattr(gm, "meta", {}))
    new._create_node_hooks = list(getattr(gm, "_create_node_hooks", ()))
    new._deepcopy_hooks = list(getattr(gm, "_deepcopy_hooks", ()))
    for hook in new._deepcopy_hooks:
        hook(new)
    return new


# torch.fx's Graph internals ``_copy_nodes`` appends with (present in torch 2.13); without them, ``graph_copy``
_GRAPH_INTERNALS = ("_graph_namespace", "_insert", "_find_nodes_lookup_table", "_len")
_NODES_COPYABLE = all(hasattr(fx.Graph(), name) for name in _GRAPH_INTERNALS)


def _copy_nodes(source: fx.Graph, graph: fx.Graph, value_map: dict[fx.Node, fx.Node]) -> fx.node.Argument:
    """``graph.graph_copy(source, value_map)`` into an empty graph with no owning module, at half its cost: the
    nodes are appended as ``Graph.create_node`` does (a unique name from the graph's namespace, the lookup table,
    the node count) without its per-node walk of the arguments for raw symbolic values, which a copy of a graph that
    passed that check cannot have. Returns the copied output value."""
    namespace, lookup = graph._graph_namespace, graph._find_nodes_lookup_table
    remap = value_map.__getitem__
    for node in source.nodes:
        if node.op == "output":
            return fx.node.map_arg(node.args[0], remap)
        name = namespace.create_name(node.name, None)
        args, kwargs = fx.node.map_arg(node.args, remap), fx.node.map_arg(node.kwargs, remap)
        new = fx.Node(graph, name, node.op, node.target, args, kwargs, node.type)
        namespace.associate_name_with_obj(name, new)
        graph._insert(new)
        lookup.insert(new)
        graph._len += 1
        new.meta = copy.copy(node.meta)
        value_map[node] = new
    return None
