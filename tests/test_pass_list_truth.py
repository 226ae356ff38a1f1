"""The pass list shows what runs: options bound when it is built, checked properties, the backend's rewrites as
recorded passes, the pass that made each node, a keyword-only Config."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from parity import train_step
from torch import nn

import zgraph
from zgraph.graph import MADE_BY, UPDATED_INPUTS, insert, output_node
from zgraph.passes import PROPERTY_CHECKS, Pass, default_passes

_step = train_step


def _run(**options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zgraph.distribute(backend="eager", **options)(_step)
    step(model, opt, torch.randn(5, 4), torch.randint(0, 2, (5,)))
    return step


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        zgraph.Config(2)  # type: ignore[misc]
    assert zgraph.Config(stage=2).stage == 2


def test_pass_options_are_bound_and_default_to_configs():
    def options(passes):
        return [(p.name, getattr(p.fn, "keywords", {})) for p in passes]

    assert options(default_passes()) == options(default_passes(**zgraph.Config().pass_options()))
    passes = {p.name: p for p in default_passes(stage=3, allgather_bucket_bytes=123, reduce_dtype=torch.bfloat16)}
    assert isinstance(passes["bucket"].fn, functools.partial)
    assert passes["bucket"].fn.keywords["allgather_bytes"] == 123
    assert passes["shard_params"].fn.keywords == {"stage": 3, "max_reuse_distance": 0}
    assert passes["cast"].fn.keywords == {"reduce_dtype": torch.bfloat16, "cross_group_dtype": None}
    # a pass's signature names its options; the context carries no config
    assert "reduce_dtype" in inspect.signature(passes["cast"].fn.func).parameters
    assert not hasattr(zgraph.passes.PassContext(), "config")
    assert zgraph.Config(param_dtype=torch.bfloat16).pass_options()["reduce_dtype"] == torch.bfloat16


def test_every_provided_property_has_a_checker():
    for p in default_passes():
        assert p.provides <= PROPERTY_CHECKS.keys(), p.name
    with pytest.raises(zgraph.PassError, match="no checker"):
        Pass("claims", lambda gm, ctx: gm, provides={"unverifiable"})


def test_final_graph_is_what_runs_and_the_rewrite_is_recorded(tmp_path):
    step = _run()
    compiled = step._dispatch.last
    assert [r.name for r in compiled.backend_records] == ["reinplace"]
    final = step.graphs["final"]
    assert final is compiled.backend_records[-1].gm
    assert final.meta[UPDATED_INPUTS] == compiled.executable.updated_inputs
    in_place = [
        n for n in final.graph.nodes if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
    ]
    assert in_place  # the optimizer's updates, in place, as the eager backend runs them
    assert "reinplace (eager)" in step.explain()
    text = open(step.dump(tmp_path)[-1]).read()
    assert "add_" in text or "mul_" in text or "lerp_" in text


def _scale_loss(gm, ctx):
    """Return the loss times one (a node for the test to find)."""
    out = output_node(gm)
    loss = out.args[0][0]
    scaled = insert(gm, torch.ops.aten.mul.Tensor, (loss, 1.0), before=out)
    out.args = ((scaled, *out.args[0][1:]),)
    return gm


def test_nodes_name_the_pass_that_made_them(tmp_path):
    step = _run(extra_passes=[_scale_loss])
    final = step.graphs["final"]
    made = {n.name: n.meta.get(MADE_BY) for n in final.graph.nodes if n.op == "call_function"}
    assert "_scale_loss" in made.values()
    assert not any(MADE_BY in n.meta for n in step.graphs["captured"].graph.nodes)
    text = open(step.dump(tmp_path)[-1]).read()
    assert "# nodes added by passes:" in text and "#   _scale_loss: mul" in text
