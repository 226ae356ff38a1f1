"""A pass with nothing to do (``Pass.applies``) is neither run nor given a copy of the graph: its record shares the
previous graph (issue 41, item 4: a faster capture)."""

from __future__ import annotations

import functools

import pytest
import torch.fx as fx
from pass_graphs import Builder, aten, context, count, grad_step, param

from zgraph.errors import PassError
from zgraph.graph import INPUT, OPTIMIZER, OUTPUTS, GraphOutput
from zgraph.graph_copy import copy_graph_module
from zgraph.ops import GRAD_CONTRIBUTION, GRAD_NORM
from zgraph.passes import Pass, PassContext, default_passes, run_passes
from zgraph.passes.pass_list import pass_applies
from zgraph.passes.reduce_scatter_grads import reduce_scatter_grads


def _never_run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    raise AssertionError("a pass that does not apply is not run")


def test_a_pass_that_does_not_apply_shares_the_previous_graph():
    gm = grad_step()
    skipped = Pass("skipped", _never_run, applies=lambda gm, ctx, **options: False)
    applied = Pass("applied", functools.partial(reduce_scatter_grads, stage=0), applies=lambda gm, ctx, **options: True)
    records = run_passes(gm, PassContext(), [skipped, applied], check_input=False)
    assert records[0].gm is gm and not records[0].applied  # the record shares its input: no copy
    assert records[1].applied and records[1].gm is not gm and count(gm, GRAD_CONTRIBUTION) == 1


def test_what_a_pass_that_does_not_apply_provides_is_still_checked():
    claims = Pass("claims", _never_run, provides={"grads_reduced"}, applies=lambda gm, ctx, **options: False)
    with pytest.raises(PassError, match="claims.*grads_reduced"):  # the markers are still there
        run_passes(grad_step(), PassContext(), [claims], check_input=False)


def _update_with_norm() -> fx.GraphModule:
    """An optimizer update of parameter 0 scaled by its gradient's norm (a ``grad_norm`` to lower)."""
    b = Builder()
    w = b.input("w", (8, 4), "param", 0)
    g = b.input("g", (8, 4), "grad", 0)
    m = b.input("m", (8, 4), "opt_state", 0, field="exp_avg", optimizer=0)
    norm = b.op(GRAD_NORM, g, 2.0, phase=OPTIMIZER)
    new_m = b.op(aten.add.Tensor, b.op(aten.mul.Tensor, m, 0.9, phase=OPTIMIZER), g, phase=OPTIMIZER)
    new_w = b.op(aten.sub.Tensor, w, b.op(aten.div.Tensor, new_m, norm, phase=OPTIMIZER), phase=OPTIMIZER)
    roles = [GraphOutput("param", "w", 0), GraphOutput("opt_state", "m", 0, field="exp_avg", optimizer=0)]
    return b.finish(list(zip([new_w, new_m], roles)))


def _code_and_roles(gm: fx.GraphModule) -> tuple:
    inputs = [n.meta.get(INPUT) for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = [n.meta.get(OUTPUTS) for n in gm.graph.nodes if n.op == "output"]
    return gm.graph.python_code("self").src, inputs, outputs


@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("distributed", [False, True])
def test_a_default_pass_that_says_it_does_not_apply_changes_nothing(stage, distributed):
    params = (param(0, (8, 4)),)
    ctx = context(params) if distributed else PassContext(params=params)
    skipped = 0
    for graph in (grad_step, _update_with_norm):
        for p in default_passes(stage=stage):
            gm = graph()
            if pass_applies(p, gm, ctx):
                continue
            skipped += 1
            assert _code_and_roles(p.fn(copy_graph_module(gm), ctx)) == _code_and_roles(gm), p.name
    assert skipped >= 4


def test_lower_collectives_applies_where_it_has_an_operator_to_lower():
    (lower,) = [p for p in default_passes() if p.name == "lower_collectives"]
    assert pass_applies(lower, _update_with_norm(), PassContext())  # grad_norm becomes a local norm
    assert not pass_applies(lower, grad_step(), PassContext())
