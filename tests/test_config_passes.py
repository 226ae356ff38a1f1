"""Config validation, the pass list's contracts, and inspection (foundation issue, items 2, 4, 5)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap

import pytest
import torch
import torch.fx as fx
from parity import train_step
from torch import nn

import zgraph
from zgraph.passes import Pass, build_pass_list, default_passes


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stage": 4}, "stage"),
        ({"stage": -1}, "stage"),
        ({"stage": "3"}, "stage"),
        ({"stage": 1.0}, "stage"),
        ({"stage": True}, "stage"),
        ({"backend": "cuda"}, "backend"),
        ({"backend": None}, "backend"),
        ({"disable_passes": "bucket"}, "disable_passes"),
        ({"disable_passes": [1]}, "disable_passes"),
        ({"extra_passes": [42]}, "extra_passes"),
        ({"extra_passes": "fn"}, "extra_passes"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"Config\.{field}"):
        zgraph.Config(**kwargs)


def test_config_error_lists_allowed_values():
    with pytest.raises(ValueError, match=r"0, 1, 2, 3"):
        zgraph.Config(stage=5)


def test_config_is_frozen_and_documented():
    config = zgraph.Config(stage=2)
    with pytest.raises(AttributeError):
        config.stage = 3  # type: ignore[misc]
    for name in zgraph.Config.__dataclass_fields__:
        assert f"{name}:" in zgraph.Config.__doc__, f"Config.{name} is not documented"


def test_every_config_field_has_a_docstring_under_it():
    body = ast.parse(textwrap.dedent(inspect.getsource(zgraph.Config))).body[0].body
    documented = {
        stmt.target.id
        for stmt, after in zip(body, body[1:])
        if isinstance(stmt, ast.AnnAssign)
        and isinstance(stmt.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
        and after.value.value.strip()
    }
    assert documented == {f.name for f in dataclasses.fields(zgraph.Config)}


def test_pass_options_are_declared_on_the_fields():
    options = zgraph.Config().pass_options()
    assert set(options) == set(inspect.signature(default_passes).parameters), "every option, and only those"
    declared = {f.metadata["pass_option"] for f in dataclasses.fields(zgraph.Config) if "pass_option" in f.metadata}
    assert declared == set(options)
    config = zgraph.Config(stage=3, max_reuse_distance=7, offload_optimizer="cpu", offload_fraction=0.5)
    assert {k: config.pass_options()[k] for k in ("stage", "max_reuse_distance", "offload_fraction")} == {
        "stage": 3,
        "max_reuse_distance": 7,
        "offload_fraction": 0.5,
    }
    bf16 = zgraph.Config(param_dtype=torch.bfloat16)
    assert bf16.pass_options()["reduce_dtype"] == torch.bfloat16, "reduce_dtype None: param_dtype"
    assert bf16.replace(reduce_dtype=torch.float32).pass_options()["reduce_dtype"] == torch.float32


def test_config_passes_is_the_default_passes_built_with_its_options():
    noop = Pass("noop", lambda gm, ctx: gm, after="cse")
    config = zgraph.Config(stage=3, max_reuse_distance=7, disable_passes=["bucket"], extra_passes=[noop])
    names = [p.name for p in config.passes()]
    assert names[:2] == ["cse", "noop"] and "bucket" not in names
    assert names == [p.name for p in build_pass_list(default_passes(**config.pass_options()), ["bucket"], [noop])]
    bound = {p.name: p.fn for p in config.passes()}
    assert bound["shard_params"].keywords == {"stage": 3, "max_reuse_distance": 7}
    with pytest.raises(zgraph.PassError, match="no_such_pass"):
        zgraph.Config(disable_passes=["no_such_pass"]).passes()


def test_the_old_pipeline_names_still_work_for_one_release():
    """The word "pipeline" now means pipeline parallelism; the pass list's old names are aliases that warn."""
    assert zgraph.PipelineError is zgraph.PassError
    config = zgraph.Config(stage=2)
    with pytest.warns(DeprecationWarning, match=r"Config.passes\(\)"):
        assert [p.name for p in config.pipeline()] == [p.name for p in config.passes()]
    with pytest.warns(DeprecationWarning, match=r"Config.pass_options\(\)"):
        assert config.pipeline_options() == config.pass_options()


def test_distribute_overrides_and_keeps_the_function_callable():
    def train_step(x):
        """Doc of the step."""
        return x * 2

    step = zgraph.distribute(zgraph.Config(stage=1), backend="eager")(train_step)
    assert step.config == zgraph.Config(stage=1, backend="eager")
    assert step.__name__ == "train_step" and step.__doc__ == "Doc of the step."
    assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))
    assert zgraph.distribute()(train_step).config == zgraph.Config()


def test_distribute_without_parentheses_is_a_clear_error():
    with pytest.raises(TypeError, match="parentheses"):
        zgraph.distribute(lambda x: x)


def _train_setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


_step = train_step


def test_unknown_disabled_pass_is_rejected_before_anything_runs():
    with pytest.raises(zgraph.PassError, match="no_such_pass"):
        zgraph.distribute(disable_passes=["no_such_pass"])(_step)


def test_disabling_a_pass_another_needs_is_rejected():
    with pytest.raises(zgraph.PassError, match=r"requires .grads_reduced. \(provided by .reduce_scatter_grads.\)"):
        zgraph.distribute(disable_passes=["reduce_scatter_grads"])(_step)
    needs = Pass("needs_reduced", lambda gm, ctx: gm, requires={"grads_reduced"}, after="cse")
    with pytest.raises(zgraph.PassError, match="needs_reduced.*grads_reduced.*reduce_scatter_grads"):
        zgraph.distribute(extra_passes=[needs])(_step)


def test_extra_pass_runs_and_its_graph_is_kept():
    seen = []

    def count_mm(gm: fx.GraphModule, ctx) -> fx.GraphModule:
        """Count matrix multiplies."""
        seen.append(sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default))
        assert ctx.world_size == 1 and ctx.params[0].name == "0.weight"
        return gm

    step = zgraph.distribute(backend="eager", extra_passes=[count_mm])(_step)
    model, opt = _train_setup()
    step(model, opt, torch.randn(5, 4), torch.randint(0, 2, (5,)))
    assert seen and seen[0] > 0
    assert list(step.graphs)[-2:] == ["count_mm", "final"]


def test_extra_pass_placed_after_a_named_pass():
    def noop(gm, ctx):
        return gm

    step = zgraph.distribute(extra_passes=[Pass("noop", noop, after=default_passes()[0].name)])(_step)
    assert [p.name for p in step._dispatch.passes][1] == "noop"


def test_a_pass_that_breaks_its_contract_is_caught():
    def leaves_marker(gm, ctx):
        return gm

    fake_reducer = Pass("fake_reducer", leaves_marker, provides={"grads_reduced"}, after="shard_params")
    step = zgraph.distribute(backend="eager", disable_passes=["reduce_scatter_grads"], extra_passes=[fake_reducer])(
        _step
    )
    model, opt = _train_setup()
    with pytest.raises(zgraph.PassError, match="fake_reducer.*grads_reduced"):
        step(model, opt, torch.randn(5, 4), torch.randint(0, 2, (5,)))


def test_graphs_explain_and_dump(tmp_path):
    step = zgraph.distribute(backend="eager")(_step)
    with pytest.raises(RuntimeError, match="not been called"):
        step.graphs  # noqa: B018
    model, opt = _train_setup()
    step(model, opt, torch.randn(5, 4), torch.randint(0, 2, (5,)))
    names = list(step.graphs)
    assert names[0] == "captured" and names[-1] == "final"
    assert [p.name for p in default_passes()] == names[1:-1]
    table = step.explain()
    for name in names[:-1]:
        assert name in table
    assert "final (eager)" in table and "all_gather" in table
    # one process: stage 3 sharding has nothing to do; its row is listed, its graph is the previous one (not copied)
    graphs = step.graphs
    assert graphs["shard_params"] is graphs["reduce_scatter_grads"] and graphs["remat"] is graphs["cse"]
    assert graphs["reduce_scatter_grads"] is not graphs["remat"]
    row = next(line for line in table.splitlines() if line.startswith("shard_params "))
    assert "(nothing to do) Stage 3: parameters enter sharded" in row
    paths = step.dump(tmp_path / "graphs")
    assert len(paths) == len(names)
    assert os.path.basename(paths[0]) == "00_captured.py"
    text = open(paths[0]).read()
    assert "0_weight" in text and "exp_avg_0_weight" in text and "lr_" in text
    assert "arg0_1" not in text


def test_every_node_has_a_phase():
    step = zgraph.distribute(backend="eager")(_step)
    model, opt = _train_setup()
    step(model, opt, torch.randn(5, 4), torch.randint(0, 2, (5,)))
    gm = step.graphs["captured"]
    phases = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            phases.setdefault(node.meta["phase"], set()).add(node.target)
    aten = torch.ops.aten
    assert aten.addmm.default in phases["forward"]
    assert aten.mm.default in phases["backward"] and aten.addmm.default not in phases["backward"]
    assert aten.addcdiv.default in phases["optimizer"] and aten.lerp.Tensor in phases["optimizer"]
