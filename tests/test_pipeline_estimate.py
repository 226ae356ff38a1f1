"""``step.estimate`` and ``zgraph estimate`` of a pipelined step (issue 42, item 4), in process (an estimate needs no
ranks): each stage's model state against the exact bytes of its parameters and their AdamW state, the micro-batches
the schedule holds (1F1B: ``P - rank``; GPipe: ``M``), the bubble against ``(P - 1) / (M + P - 1)``, the bytes sent
between stages and reduced over pipelines, ZeRO 3 within stages (shards, the gathers and the peak holding their
parameters), the peak on one process against the measured one, the command's table and JSON, and what is refused.
``tests/test_pipeline.py`` compares each stage's state with what each of two gloo ranks holds after pipelined steps,
``tests/test_pipeline_data.py`` at ZeRO 1 to 3 with what each of four (P=2 x D=2) holds."""

from __future__ import annotations

import contextlib
import gc
import json

import cli_runner
import pytest
import torch
from pipeline_cases import BATCH, LR, Net, batches, step

import zgraph
from zgraph.runtime.memory import LiveTensorBytes, state_bytes

WIDTH = 8  # Net's hidden size: what crosses each stage boundary is (rows, WIDTH) fp32


def estimate(world: int | None = None, **config: object) -> tuple[zgraph.Estimate, Net]:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    compiled = zgraph.distribute(zgraph.Config(backend="eager", **config))(step)
    return compiled.estimate(model, opt, *batches()[0], world_size=world), model


def stage_parameters(model: Net, stage: zgraph.StageEstimate, stages: int) -> list[torch.nn.Parameter]:
    """The parameters of a stage's blocks, the input layer's at the first stage and the head's at the last."""
    modules = [model.get_submodule(name.partition(".")[2]) for name in stage.blocks]
    modules += [model.inp] if stage.stage == 0 else []
    modules += [model.head] if stage.stage == stages - 1 else []
    return [p for m in modules for p in m.parameters()]


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stage_holds_its_parameters_state_and_the_schedules_micro_batches(p, schedule):
    m = 4
    e, model = estimate(world=p, pipeline_parallel=p, microbatches=m, schedule=schedule)
    assert e.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert [s.rank for s in e.stages] == list(range(p))
    assert sorted(b for s in e.stages for b in s.blocks) == [f"model.blocks.{i}" for i in range(4)]
    for s in e.stages:
        params = stage_parameters(model, s, p)
        nbytes = sum(q.numel() * 4 for q in params)
        assert s.model_state_bytes["params"] == nbytes
        assert s.model_state_bytes["optimizer"] == 2 * nbytes + 4 * len(params)  # exp_avg, exp_avg_sq; 0-d step
        assert s.model_state_bytes["grads"] == 0  # the step's zero_grad leaves none
        assert s.in_flight == (m if schedule == "gpipe" else p - s.rank)
        assert s.activation_bytes == s.saved_bytes * s.in_flight > 0
        assert s.bubble == pytest.approx(e.bubble)
        boundary = BATCH * WIDTH * 4  # every micro-batch's rows, one way
        assert s.send_bytes == boundary * ((s.stage < p - 1) + (s.stage > 0))
    top = max(e.stages, key=lambda s: s.peak_bytes)  # one stage per rank: the per-rank fields are its rank's
    assert (e.peak_bytes, e.activation_bytes) == (top.peak_bytes, top.activation_bytes)
    assert e.model_state_bytes == top.model_state_bytes
    assert e.peak_node.startswith(f"rank {top.rank} of the pipeline: ")
    assert e.comm_bytes["send"] == max(s.send_bytes for s in e.stages)
    assert e.comm_count["send"] == m * (2 if p > 2 else 1)  # one tensor each way per micro-batch


def test_pipelines_over_more_ranks_all_reduce_each_stages_gradients_once():
    e, _ = estimate(world=4, pipeline_parallel=2, microbatches=4)
    first = e.stages[0]  # the larger stage: the rank sending the most
    assert e.comm_count["all_reduce"] == 1, "one flat bucket per stage and dtype, whatever M is"
    assert e.comm_bytes["all_reduce"] == first.model_state_bytes["params"]
    assert e.comm_ops == {"isend": 4, "all_reduce": 1}
    assert e.to_json()["stages"][0]["model_state_bytes"] == dict(first.model_state_bytes)


def test_a_global_gradient_norm_all_reduces_its_partials_over_the_pipeline():
    """``max_grad_norm`` with one pipeline of 2 (ZeRO 0): each rank all-reduces its stages' partial sum of squares
    (one fp32 scalar) over the pipeline, as ``RankRunner._stage_totals`` does (counted against the run at ZeRO 2 in
    tests/test_pipeline_data.py); without it, no all-reduce."""
    e, _ = estimate(world=2, pipeline_parallel=2, microbatches=2, max_grad_norm=1.0)
    assert e.comm_ops == {"isend": 2, "all_reduce": 1} and e.comm_bytes["all_reduce"] == 4, e.comm_ops
    plain, _ = estimate(world=2, pipeline_parallel=2, microbatches=2)
    assert plain.comm_ops == {"isend": 2}, plain.comm_ops


def test_zero_3_within_stages_holds_shards_and_gathers_each_stage_once():
    """P=2 x D=2 at ZeRO 3 (issue 42, item 4), M=4: each stage's parameters and AdamW state as their padded dim-0
    shards over its 2 data-parallel ranks (0-d ``step`` whole); per step, on each rank, one all-gather of its
    stage's parameters (their padded whole) and one reduce-scatter of its gradient sums, not one per micro-batch
    (the run's own at M=2 and 4: tests/test_pipeline_data.py); its peak holds the whole parameters from the gather
    to the update. With ``param_persistence_threshold`` over every parameter's size no stage gathers and the
    parameters are held whole, as at stage 2."""
    e, model = estimate(world=4, pipeline_parallel=2, microbatches=4, stage=3, param_persistence_threshold=0)
    for s in e.stages:
        params = stage_parameters(model, s, 2)
        shards = sum(-(-q.shape[0] // 2) * q[0].numel() * 4 for q in params)
        assert s.model_state_bytes["params"] == shards
        assert s.model_state_bytes["optimizer"] == 2 * shards + 4 * len(params)
    first = stage_parameters(model, e.stages[0], 2)  # the larger stage: rank 0 sends the most
    whole = sum(-(-q.shape[0] // 2) * 2 * q[0].numel() * 4 for q in first)
    assert e.comm_count == {"send": 4, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
    assert e.comm_bytes["all_gather_into_tensor"] == e.comm_bytes["reduce_scatter_tensor"] == whole
    alive = dict(e.alive_at_peak)
    assert "whole parameters gathered for the rank's stages, held until the updates" in alive, alive
    two, _ = estimate(world=4, pipeline_parallel=2, microbatches=2, stage=2)
    with pytest.warns(RuntimeWarning, match="stage 3 shards no parameter"):
        kept, _ = estimate(world=4, pipeline_parallel=2, microbatches=2, stage=3)  # the default threshold: 100000
    assert [s.model_state_bytes for s in kept.stages] == [s.model_state_bytes for s in two.stages]
    assert kept.comm_count == two.comm_count, "the update all-gathers the new parameters, as at stage 2"
    assert "whole parameters gathered for the rank's stages, held until the updates" not in dict(kept.alive_at_peak)


def test_zero_bubble_and_interleaving_predict_a_smaller_bubble():
    zb, _ = estimate(world=2, pipeline_parallel=2, microbatches=4, schedule="zb_h1")
    interleaved, _ = estimate(
        world=2, pipeline_parallel=2, microbatches=4, schedule="interleaved_1f1b", pipeline_virtual_stages=2
    )
    assert zb.bubble < 0.2 and interleaved.bubble < 0.2
    assert [s.rank for s in interleaved.stages] == [0, 1, 0, 1]


@pytest.mark.parametrize(("schedule", "virtual"), [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)])
def test_the_peak_on_one_process_is_the_measured_one(schedule, virtual):
    """Stages on one rank: the estimate's peak against the model state, the batch and the most bytes allocated
    at once while a call runs (every allocation tracked)."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = batches()[0]
    config = zgraph.Config(
        backend="eager", pipeline_parallel=1, microbatches=4, schedule=schedule, pipeline_virtual_stages=virtual
    )
    compiled = zgraph.distribute(config)(step)
    e = compiled.estimate(model, opt, x, y)
    compiled(model, opt, x, y)  # AdamW's state made
    gc.collect()
    tracker = LiveTensorBytes()
    with tracker:
        compiled(model, opt, x, y)
    held = state_bytes(model, opt)["total"] + x.nbytes + y.nbytes
    assert e.model_state_bytes["total"] == state_bytes(model, opt)["total"]
    assert e.peak_bytes == pytest.approx(held + tracker.peak, rel=0.03)


def test_bad_input_is_refused_before_anything_changes():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    before = [p.detach().clone() for p in model.parameters()]
    compiled = zgraph.distribute(zgraph.Config(backend="eager", pipeline_parallel=2, microbatches=4))(step)
    x, y = batches()[0]
    with pytest.raises(ValueError, match=r"must divide the world size \(3\).*pass world_size="):
        compiled.estimate(model, opt, x, y, world_size=3)
    with pytest.raises(ValueError, match="pass world_size="):
        compiled.estimate(model, opt, x, y)  # one process
    full = zgraph.distribute(zgraph.Config(backend="eager", pipeline_parallel=2, microbatches=4, remat="full"))(step)
    with pytest.raises(zgraph.MemoryBudgetError, match=r"rank 0 [\d,]+ bytes \(remat='full'\), rank 1"):
        full.estimate(model, opt, x, y, world_size=2, memory_budget=1000)  # one policy given: one estimate
    with pytest.raises(zgraph.EstimateError, match="sizes="):
        compiled.estimate(model, opt, x, y, world_size=2, sizes={"s0": 4})
    with pytest.raises(ValueError, match="does not divide the batch"):
        compiled.estimate(model, opt, x[:6], y[:6], world_size=2)
    hybrid = zgraph.Config(backend="eager", pipeline_parallel=2, microbatches=4, stage=2, shard_group_size=4)
    with pytest.raises(ValueError, match=r"shard_group_size=4 must divide the 2 ranks of each stage's"):
        zgraph.distribute(hybrid)(step).estimate(model, opt, x, y, world_size=4)
    assert not opt.state and all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("zero", [0, 3])
def test_a_memory_budget_gives_each_rank_the_lightest_remat_that_fits(zero):
    """1F1B holds two micro-batches on rank 0, one on rank 1: a budget only rank 0 exceeds without remat
    recomputes rank 0's blocks and no others; every rank's planned peak fits. At ZeRO 3 within stages (P=2 x D=2)
    the peaks it plans by hold each stage's parameters gathered whole during its actions (not at an update: they go
    before it)."""
    pipeline = {"pipeline_parallel": 2, "microbatches": 4}
    if zero:
        pipeline.update(stage=3, param_persistence_threshold=0)
    world = 2 * (1 + bool(zero))
    none, full = (estimate(world=world, remat=remat, **pipeline)[0] for remat in (None, "full"))
    budget = max(full.stages[0].peak_bytes, none.stages[1].peak_bytes)
    assert none.stages[0].peak_bytes > budget
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    compiled = zgraph.distribute(zgraph.Config(backend="eager", **pipeline))(step)
    plan = compiled.estimate(model, opt, *batches()[0], world_size=world, memory_budget=budget)
    gathered = "whole parameters gathered for the rank's stages, held until the updates"
    at_peak = plan.chosen.estimate.peak_node
    assert (gathered in dict(plan.chosen.estimate.alive_at_peak)) == (bool(zero) and "update" not in at_peak), at_peak
    assert plan.chosen.changes == {"remat": {f"model.blocks.{i}": "full" if i < 2 else None for i in range(4)}}
    assert all(s.peak_bytes <= budget for s in plan.chosen.estimate.stages)
    assert plan.chosen.estimate.stages[0].saved_bytes == full.stages[0].saved_bytes
    assert plan.chosen.estimate.stages[1].saved_bytes == none.stages[1].saved_bytes


def test_regathering_for_each_action_holds_one_stage_of_parameters_at_a_time():
    """ZeRO 3 within stages (P=2 x D=2), interleaved with 2 stages per rank, 4 micro-batches: with
    ``pipeline_regather`` each stage's gather runs before each of its actions (2 stages x 4 micro-batches x F and B:
    16 all-gathers per rank, against 2), and a rank holds one stage's whole parameters at its peak instead of both
    stages'. A budget below the peak with them kept, under every remat policy, is met by re-gathering: the plan
    turns it on (with the lightest remat that fits then)."""
    pipeline = {"pipeline_parallel": 2, "microbatches": 4, "schedule": "interleaved_1f1b", "pipeline_virtual_stages": 2}
    pipeline.update(stage=3, param_persistence_threshold=0)
    kept, regathered = (estimate(world=4, pipeline_regather=r, **pipeline)[0] for r in (False, True))
    assert (kept.comm_count["all_gather_into_tensor"], regathered.comm_count["all_gather_into_tensor"]) == (2, 16)
    assert regathered.comm_count["reduce_scatter_tensor"] == kept.comm_count["reduce_scatter_tensor"] == 2
    assert regathered.peak_bytes < kept.peak_bytes, (regathered.peak_bytes, kept.peak_bytes)
    alive = dict(regathered.alive_at_peak)
    assert (
        alive["whole parameters gathered for this action (Config.pipeline_regather)"]
        < dict(kept.alive_at_peak)["whole parameters gathered for the rank's stages, held until the updates"]
    )
    full = estimate(world=4, remat="full", **pipeline)[0]
    selective = estimate(world=4, remat="selective", pipeline_regather=True, **pipeline)[0]
    budget = (full.peak_bytes + selective.peak_bytes) // 2
    assert selective.peak_bytes <= budget < full.peak_bytes, "no remat fits with the parameters kept"
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    compiled = zgraph.distribute(zgraph.Config(backend="eager", **pipeline))(step)
    plan = compiled.estimate(model, opt, *batches()[0], world_size=4, memory_budget=budget)
    assert plan.chosen.changes["pipeline_regather"] is True, plan.chosen.changes
    assert plan.chosen.changes["remat"] in (
        "selective",
        {"model.blocks.0": "selective", "model.blocks.1": None, "model.blocks.2": "selective", "model.blocks.3": None},
    )
    assert plan.chosen.estimate.peak_bytes <= budget
    with pytest.raises(zgraph.MemoryBudgetError, match="pipeline_regather"):
        compiled.estimate(model, opt, *batches()[0], world_size=4, memory_budget=budget // 4)


def test_a_memory_budget_runs_as_planned_and_equals_eager():
    """Stages on one process under ``Config.memory_budget``: the plan recomputes, the run equals eager, and the
    measured peak is within the budget (and the estimate's 3 %)."""
    pipeline = {"pipeline_parallel": 1, "pipeline_virtual_stages": 2, "schedule": "interleaved_1f1b", "microbatches": 4}
    none, full = (estimate(remat=remat, **pipeline)[0] for remat in (None, "full"))
    budget = (none.peak_bytes + full.peak_bytes) // 2
    eager, model = Net(), Net()
    eager_opt, opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (eager, model))
    compiled = zgraph.distribute(zgraph.Config(backend="eager", memory_budget=budget, **pipeline))(step)
    tracker = LiveTensorBytes()
    for i, (x, y) in enumerate(batches()):
        with tracker if i == 2 else contextlib.nullcontext():  # the last step: AdamW's state exists
            loss = compiled(model, opt, x, y)
        torch.testing.assert_close(loss, step(eager, eager_opt, x, y), rtol=1e-6, atol=1e-6)
    assert compiled.memory_plan is not None and compiled.memory_plan.chosen.changes["remat"] is not None
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    held = state_bytes(model, opt)["total"] + x.nbytes + y.nbytes
    assert held + tracker.peak <= budget * 1.03


def test_cli_prints_each_stage_and_the_bubble(capsys):
    argv = ["estimate", "--model", "gpt-bench", "--world", "4", "--pipeline-parallel", "2", "--microbatches", "4"]
    done = cli_runner.here(capsys, *argv, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["bubble"] == pytest.approx(0.2) and out["stage"] == 0
    assert [s["rank"] for s in out["stages"]] == [0, 1]
    assert [s["in_flight"] for s in out["stages"]] == [2, 1]
    assert set(out["comm_bytes"]) == {"send", "all_reduce"}
    total = out["stages"][0]["model_state_bytes"]["total"] + out["stages"][1]["model_state_bytes"]["total"]
    assert out["params"] * 4 * 3 < total < out["params"] * 4 * 3 * 1.01  # fp32 params, exp_avg, exp_avg_sq
    table = cli_runner.here(capsys, *argv, "--schedule", "gpipe").stdout
    assert "pipeline_parallel=2, 4 micro-batches, gpipe" in table
    assert "predicted bubble 20.0%" in table
    assert "blocks.0 .. blocks.1" in table and "blocks.2 .. blocks.3" in table


def test_cli_prints_hybrid_sharding_within_stages(capsys):
    """``--shard-group-size 1`` at ZeRO 2, P=2 x D=2: each stage's optimizer state whole on its ranks (shard groups
    of one), its gradients reduce-scattered within the shard group and all-reduced across the two."""
    argv = ["estimate", "--model", "gpt-bench", "--world", "4", "--pipeline-parallel", "2", "--stage", "2"]
    plain, hybrid = (json.loads(cli_runner.here(capsys, *argv, *extra, "--json").stdout)
                     for extra in ([], ["--shard-group-size", "1"]))  # fmt: skip
    assert set(hybrid["comm_bytes"]) == {"send", "reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor"}
    assert "all_reduce" not in plain["comm_bytes"], plain["comm_bytes"]
    for whole, half in zip(hybrid["stages"], plain["stages"]):
        optimizer = whole["model_state_bytes"]["optimizer"], half["model_state_bytes"]["optimizer"]
        assert optimizer[1] * 2 * 0.95 < optimizer[0] <= optimizer[1] * 2, optimizer
    assert "shard_group_size=1" in cli_runner.here(capsys, *argv, "--shard-group-size", "1").stdout


def test_cli_prints_the_stage_3_figures(capsys):
    """``--stage 3`` with pipelines (issue 42, item 4): each rank holds a shard of its stage's larger parameters
    (those over ``param_persistence_threshold`` elements), all-gathers them and reduce-scatters their gradients
    (bucketed) once per step, and its peak holds them gathered whole."""
    argv = ["estimate", "--model", "gpt-bench", "--world", "4", "--pipeline-parallel", "2", "--stage", "3"]
    done = cli_runner.here(capsys, *argv, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["stage"] == 3 and set(out["comm_bytes"]) == {"send", "all_gather_into_tensor", "reduce_scatter_tensor"}
    params = sum(s["model_state_bytes"]["params"] for s in out["stages"])
    assert out["params"] * 4 / 2 <= params < out["params"] * 4 * 0.6, "a half of each, the small ones whole"
    assert "parameters gathered whole" in out["peak_node"], out["peak_node"]
    table = cli_runner.here(capsys, *argv).stdout
    assert "all_gather_into_tensor" in table and "reduce_scatter_tensor" in table
    assert "whole parameters gathered for the rank's stages" in table
    again = json.loads(cli_runner.here(capsys, *argv, "--pipeline-regather", "--json").stdout)  # M = P = 2
    # the stage's gather before each of its 2 forwards and 2 backwards: 3 more than once per step (the update's
    # all-gather of the parameters kept whole runs once either way)
    count, nbytes = ([d[k]["all_gather_into_tensor"] for d in (out, again)] for k in ("comm_count", "comm_bytes"))
    assert count[1] == count[0] + 3, count
    extra = nbytes[1] - nbytes[0]
    assert extra % 3 == 0 and 0.8 * nbytes[0] < extra / 3 < nbytes[0], nbytes
    assert again["comm_bytes"]["reduce_scatter_tensor"] == out["comm_bytes"]["reduce_scatter_tensor"]
    assert "re-gathered per action" in cli_runner.here(capsys, *argv, "--pipeline-regather").stdout


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--microbatches", "4"], "--microbatches is a pipeline option: add --pipeline-parallel P"),
        (["--pipeline-parallel", "3"], "--pipeline-parallel 3 must be positive and divide --world 4"),
        (["--pipeline-parallel", "2", "--budget", "1GiB"], "does not combine with --budget yet"),
        (["--pipeline-parallel", "2", "--shard-group-size", "4"], "shard_group_size=4 must divide the 2 ranks of each"),
        (["--pipeline-regather"], "--pipeline-regather is a pipeline option: add --pipeline-parallel P"),
        (["--pipeline-parallel", "2", "--pipeline-regather"], "Config.pipeline_regather re-gathers ZeRO 3's"),
    ],
)
def test_cli_bad_pipeline_input_is_one_line_and_status_1(capsys, argv, says):
    done = cli_runner.here(capsys, "estimate", "--model", "gpt-bench", "--world", "4", *argv)
    assert done.returncode == 1 and says in done.stderr and done.stderr.count("\n") == 1, done.stderr
