"""``zgraph.graph_copy.copy_graph_module`` (each pass edits a copy; the pass list keeps every graph): the copy is the
one ``torch.fx``'s own ``Graph.graph_copy`` makes, node for node, on a captured step with symbolic sizes."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from zero_cases import classify_step

import zgraph
from zgraph import graph_copy
from zgraph.graph_copy import copy_graph_module


def _captured() -> fx.GraphModule:
    """A captured step whose graph has list and keyword arguments, getitems, a tuple output and symbolic sizes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    decorated = zgraph.distribute(zgraph.Config(stage=0, backend="eager"))(classify_step)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    zgraph.mark_dynamic(x, 0)
    zgraph.mark_dynamic(y, 0)
    decorated(model, opt, x, y)
    return decorated.graphs["captured"]


def _reference(gm: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {}))
    return graph


def _structure(graph: fx.Graph) -> list[tuple]:
    def named(a: object) -> object:
        return fx.node.map_arg(a, lambda n: ("node", n.name))

    return [
        (n.name, n.op, n.target, named(n.args), named(n.kwargs), sorted(u.name for u in n.users)) for n in graph.nodes
    ]


def test_the_copy_is_graph_copys_node_for_node():
    assert graph_copy._NODES_COPYABLE  # this torch has the internals the copy appends with: the copy under test
    gm = _captured()
    assert any(isinstance(s, torch.SymInt) for n in gm.graph.nodes for s in getattr(n.meta.get("val"), "shape", ()))
    copied, reference = copy_graph_module(gm), _reference(gm)
    assert _structure(copied.graph) == _structure(reference) == _structure(gm.graph)
    assert len(copied.graph.nodes) == len(gm.graph.nodes)
    for old, new in zip(gm.graph.nodes, copied.graph.nodes, strict=True):
        assert new.graph is copied.graph and new is not old
        assert new.meta is not old.meta and new.meta.keys() == old.meta.keys()
        assert all(new.meta[k] is old.meta[k] for k in old.meta)  # a shallow copy
    assert copied.code == fx.GraphModule(gm, reference).code
    for target in {n.target for n in gm.graph.nodes if n.op == "call_function"}:
        found = copied.graph.find_nodes(op="call_function", target=target)
        assert [n.name for n in found] == [n.name for n in reference.find_nodes(op="call_function", target=target)]


def test_nodes_added_to_the_copy_get_the_names_graph_copy_would_give():
    gm = _captured()
    copied, reference = copy_graph_module(gm).graph, _reference(gm)
    anchor = next(n for n in copied.nodes if n.op == "placeholder")
    ref_anchor = next(n for n in reference.nodes if n.op == "placeholder")
    for graph, x in ((copied, anchor), (reference, ref_anchor)):
        with graph.inserting_after(x):
            for name in ("add", "mul", "getitem", None, "add_1", "add"):
                graph.create_node("call_function", torch.ops.aten.neg.default, (x,), name=name)
    assert [n.name for n in copied.nodes] == [n.name for n in reference.nodes]
    assert len({n.name for n in copied.nodes}) == len(copied.nodes)
    copied.lint()
