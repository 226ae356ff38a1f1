"""Provenance: every node a pass creates carries ``meta[MADE_BY]``, its name (``zgraph.passes.provenance.run_pass``, a
create-node hook on the module the pass edits), however it made the node; nodes that survive keep their stamp."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
from pass_graphs import Builder, aten, context

from zgraph.graph import (
    INPUT,
    MADE_BY,
    OUTPUTS,
    PHASE,
    VAL,
    GraphOutput,
    compute_val,
    fake_mode,
    insert,
    output_node,
)
from zgraph.graph_copy import copy_graph_module
from zgraph.passes import Pass, run_passes
from zgraph.passes.provenance import run_pass


def _step() -> fx.GraphModule:
    """x -> mm -> relu -> (returned); a captured graph, no node made by a pass."""
    b = Builder()
    x = b.input("x", (4, 6))
    w = b.input("w", (6, 4), "param", 0)
    y = b.op(aten.relu.default, b.op(aten.mm.default, x, w))
    return b.finish([(y, GraphOutput("user", "y", 0))])


def _returned(gm: fx.GraphModule) -> fx.Node:
    return output_node(gm).args[0][0]


def _made(gm: fx.GraphModule) -> dict[str, str | None]:
    return {n.name: n.meta.get(MADE_BY) for n in gm.graph.nodes}


def _split_in_place(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Split the returned value in two and add the halves back, by ``graph.call_function`` and ``getitem`` nodes
    (as ``bucket`` unpacks a merged collective), then ``create_node``; no ``insert``."""
    y = _returned(gm)
    out = output_node(gm)
    with gm.graph.inserting_before(out):
        parts = gm.graph.call_function(aten.split.Tensor, (y, 2))
        halves = [gm.graph.call_function(operator.getitem, (parts, i)) for i in range(2)]
        cat = gm.graph.create_node("call_function", aten.cat.default, (halves,))
    for node in (parts, *halves, cat):
        node.meta[PHASE] = y.meta[PHASE]
        compute_val(node, fake_mode(gm))
    out.args = ((cat,),)
    return gm


def _run(gm: fx.GraphModule, *passes: Pass, keep: bool = True) -> list:
    return run_passes(gm, context(), list(passes), check_input=False, keep=keep)


def _no_hooks_or_marks(*modules: fx.GraphModule) -> None:
    for gm in modules:
        assert gm._create_node_hooks == [] and gm._deepcopy_hooks == []
        assert all(set(n.meta) <= {VAL, PHASE, MADE_BY, INPUT, OUTPUTS} for n in gm.graph.nodes)  # no mark left


@pytest.mark.parametrize("keep", [True, False])
def test_nodes_made_without_insert_carry_the_pass(keep):
    gm = _step()
    captured = dict(_made(gm))
    (record,) = _run(gm, Pass("split", _split_in_place), keep=keep)
    made = _made(record.gm)
    new = {n.name for n in record.gm.graph.nodes if n.target in (aten.split.Tensor, operator.getitem, aten.cat.default)}
    assert len(new) == 4 and all(made[name] == "split" for name in new)
    assert all(made[name] is None for name in captured)  # the captured graph's nodes name no pass
    assert all(v is None for v in _made(gm).values()) == keep  # keep: the pass edited a copy, gm is as captured
    _no_hooks_or_marks(gm, record.gm)


def _copy_a_node(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """``node_copy`` the returned value in place (its meta, stamp included, is copied) and return the copy."""
    y = _returned(gm)
    with gm.graph.inserting_after(y):
        again = gm.graph.node_copy(y)
    output_node(gm).args = ((again,),)
    return gm


def _insert_neg(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    y = _returned(gm)
    output_node(gm).args = ((insert(gm, aten.neg.default, (y,), after=y),),)
    return gm


def test_a_copied_node_is_the_copying_pass_s_and_the_rest_keep_their_stamp():
    first, second = _run(_step(), Pass("neg", _insert_neg), Pass("copy", _copy_a_node))
    (neg,) = [n for n in second.gm.graph.nodes if n.target is aten.neg.default and n.meta[MADE_BY] == "neg"]
    again = _returned(second.gm)
    assert again.target is aten.neg.default and again.meta[MADE_BY] == "copy"  # its meta said "neg"
    assert neg.name in _made(first.gm) and _made(first.gm)[neg.name] == "neg"
    assert _made(second.gm)["mm_default"] is None


def _rebuild(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Return a new module on a graph of its own: every node copied, an ``abs`` added before the output."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            y = env[node.args[0][0]]
            absolute = graph.call_function(aten.abs.default, (y,))
            absolute.meta = {PHASE: y.meta[PHASE], VAL: y.meta[VAL]}
            graph.output((absolute,)).meta = copy.copy(node.meta)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("keep", [True, False])
def test_a_pass_that_returns_a_new_module(keep):
    gm = _step()
    first, second = _run(gm, Pass("neg", _insert_neg), Pass("rebuild", _rebuild), keep=keep)
    assert second.gm is not first.gm
    made = _made(second.gm)
    (absolute,) = [n for n in second.gm.graph.nodes if n.target is aten.abs.default]
    assert made[absolute.name] == "rebuild"
    assert made["output"] is None  # made with the old output's meta: a copy of it, as ``node_copy`` makes
    (neg,) = [n for n in second.gm.graph.nodes if n.target is aten.neg.default]
    assert made[neg.name] == "neg"  # copied, not made: the stamp it had
    assert made["mm_default"] is None and made["x"] is None
    _no_hooks_or_marks(gm, first.gm, second.gm)


def _edit_a_copy(how):
    def edit(gm: fx.GraphModule, ctx) -> fx.GraphModule:
        new = how(gm)
        return _split_in_place(_copy_a_node(new, ctx), ctx)

    return edit


@pytest.mark.parametrize("how", [copy.deepcopy, copy_graph_module], ids=["deepcopy", "copy_graph_module"])
def test_a_pass_that_edits_a_copy_of_its_graph(how):
    gm = _step()
    (record,) = _run(gm, Pass("edit_copy", _edit_a_copy(how)))
    made = _made(record.gm)
    new = [n for n in record.gm.graph.nodes if n.target in (aten.split.Tensor, operator.getitem, aten.cat.default)]
    assert len(new) == 4 and all(made[n.name] == "edit_copy" for n in new)
    assert [made[n.name] for n in record.gm.graph.nodes if n.target is aten.relu.default] == [None, "edit_copy"]
    _no_hooks_or_marks(gm, record.gm)


def test_nothing_is_stamped_outside_a_pass_and_a_failing_pass_leaves_no_hook():
    gm = _step()
    node = insert(gm, aten.neg.default, (_returned(gm),), after=_returned(gm))
    assert MADE_BY not in node.meta

    def fails(gm, ctx):
        _split_in_place(gm, ctx)
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no"):
        run_pass("fails", gm, fails, context())
    _no_hooks_or_marks(gm)
    assert all(MADE_BY not in n.meta for n in gm.graph.nodes)  # stamped only when the pass returns
