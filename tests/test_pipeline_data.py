"""Pipeline parallelism over ``P x D`` ranks (issue 42): two pipelines of two stages on four gloo ranks, each
pipeline on its rows of the batch (``zgraph.pipeline_batch``), against eager PyTorch on the whole batch, and the
gradient reductions a step issues: one per stage, the same for 2 and 4 micro-batches (3 steps with 2, 1 with 4);
at ZeRO stages 1 to 3 within each stage's data-parallel group, one reduce-scatter per stage's bucket (stage 3: and one
all-gather of its parameters); and two stages of two sequence-parallel ranks each (P=2 x SP=2), with the rank layout
and its refusals."""

from __future__ import annotations

import re

import pytest
import sequence_cases as sc
import torch
from pipeline_cases import CLIP, LR, SGD, Net, batches, step

import zgraph

PARAMS = [name for name, _ in Net().named_parameters()]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("pipeline_data") / "results.pt"
    cases = ["two_by_two", "zero_within_stages", "stage_three", "stage_three_regathered", "hybrid_degenerate"]
    cases += ["zero_clipped", "reduced_in_bf16", "step_results"]
    cases += ["pipeline_by_sequence", "pipeline_by_sequence_refused"]
    run_ranks(4, "pipeline_data_cases.run", str(path), cases, timeout=300)
    results = torch.load(path, weights_only=False)
    for result in results.values():
        assert not (isinstance(result, dict) and "error" in result), result.get("error")
    return results


@pytest.fixture(scope="module")
def two_by_two(four_ranks):
    return four_ranks["two_by_two"]


@pytest.mark.parametrize("microbatches", [2, 4])
def test_two_pipelines_of_two_stages_equal_eager_on_the_whole_batch(two_by_two, microbatches):
    runs = [rank[[2, 4].index(microbatches)] for rank in two_by_two]
    assert sorted(n for r in runs[:2] for n in r["owned"]) == sorted(PARAMS), "pipeline 0 holds every parameter"
    assert [r["owned"] for r in runs[2:]] == [r["owned"] for r in runs[:2]], "pipeline 1 runs the same stages"
    for r in runs:
        torch.testing.assert_close(torch.stack(r["got"]), torch.stack(r["want"]), rtol=1e-6, atol=1e-6)
        assert r["distance"] < 1e-6 and r["whole"] < 1e-6, (r["distance"], r["whole"])
    whole_state = sum(r["state"] for r in runs[:2])
    assert [r["state"] for r in runs[2:]] == [r["state"] for r in runs[:2]], "the same stages' state per place"
    assert all(r["state"] < whole_state / 2 * 1.05 for r in runs), "each rank holds its stage's share of the state"
    if microbatches == 2:
        assert all(r["loaded"] < 1e-6 for r in runs), "zgraph.save of the pipelined model loads as eager's"
    for rank, r in enumerate(runs):
        first = rank - rank % 2
        assert r["explained"].endswith(
            f"this is rank {rank % 2} of the pipeline of global ranks {[first, first + 1]}, one of 2 pipelines"
        ), r["explained"]


def test_gradients_are_reduced_once_per_stage_per_step_whatever_the_micro_batch_count(two_by_two):
    """Each rank's step all-reduces over the pipelines its stage's gradient sums once (one flat bucket of all its
    parameters) and the 0-d loss once, for 2 and 4 micro-batches; the ranks of the stage that makes the loss also
    the cross_entropy mean's count of tokens, once (the others do not need it: each backward's seed is its
    micro-batch's share of the count, ``zgraph.passes.token_count``)."""
    for rank in two_by_two:
        two, four = rank
        count = [1] if "head.weight" in two["owned"] else []
        assert sorted(two["sizes"]) == sorted(four["sizes"]) == sorted([two["stage_numel"], 1, *count]), (two, four)


ZERO_RUNS = {"stage 1, 2 micro-batches": 0, "stage 1, 4 micro-batches": 1, "stage 2, 2 micro-batches": 2}


@pytest.mark.parametrize("run", list(ZERO_RUNS))
def test_zero_within_each_stage_equals_eager_and_shards_the_optimizer_state(four_ranks, run):
    """ZeRO 1 and 2 within each stage's data-parallel group: parameters, and the whole model's and (stage 1) the
    optimizer's state (``zgraph.full_state_dict``), as eager's after the steps; each rank holds a quarter
    (1 / (P x D)) of the optimizer state; ``zgraph.save`` (the optimizer state's shards gathered) loads as eager's
    model and optimizer state."""
    runs = [rank[ZERO_RUNS[run]] for rank in four_ranks["zero_within_stages"]]
    for r in runs:
        torch.testing.assert_close(torch.stack(r["got"]), torch.stack(r["want"]), rtol=1e-6, atol=1e-6)
        assert r["distance"] < 1e-6 and r["whole"] < 1e-6 and r.get("whole_optim", 0.0) < 1e-6, r
        assert r["optimizer"] < r["eager_optimizer"] / 4 * 1.1, (r["optimizer"], r["eager_optimizer"])
        assert r.get("loaded", 0.0) < 1e-6, "zgraph.save of the pipelined model loads as eager's"
    assert sorted(n for r in runs[:2] for n in r["owned"]) == sorted(PARAMS)


def test_zero_reduces_each_stage_bucket_once_per_step_whatever_the_micro_batch_count(four_ranks):
    """At ZeRO >= 1 a stage's gradient sums are reduce-scattered by its update graph, which runs once per step: one
    reduce-scatter per bucket (one here) per stage, for 2 and 4 micro-batches; nothing else reduces gradients (the
    step's only all-reduces are the loss's and, on the ranks of the stage that makes the loss, the token count's)."""
    for rank in four_ranks["zero_within_stages"]:
        for r in rank:
            count = [1] if "head.weight" in r["owned"] else []
            assert r["reduce_scatters"] == [1] and sorted(r["sizes"]) == [1, *count], r


STAGE_THREE_RUNS = {"2 micro-batches, 3 steps": 0, "4 micro-batches, 2 steps": 1}


def padded(owned: list[str]) -> int:
    """Bytes of the parameters named ``owned`` (a stage's), each padded to 2 equal dim-0 shards."""
    return sum(-(-p.shape[0] // 2) * 2 * p[0].numel() * 4 for n, p in Net().named_parameters() if n in owned)


@pytest.mark.parametrize("run", list(STAGE_THREE_RUNS))
def test_zero_3_within_each_stage_equals_eager_and_holds_a_quarter_of_the_parameters(four_ranks, run):
    """ZeRO 3 within each stage's data-parallel group: losses, parameters, and the whole model's and optimizer's
    state (``zgraph.full_state_dict``) as eager's after the steps, and the whole model on every rank inside
    ``zgraph.gather``; ``zgraph.save`` loads as eager's model and optimizer state; between steps each rank holds a
    quarter (1 / (P x D)) of the parameters and of the optimizer state (its stage's shards), and the tensors its
    model, optimizer and steps left alive are that state (the whole parameters a step gathers are let go)."""
    runs = [rank[STAGE_THREE_RUNS[run]] for rank in four_ranks["stage_three"]]
    for r in runs:
        torch.testing.assert_close(torch.stack(r["got"]), torch.stack(r["want"]), rtol=1e-6, atol=1e-6)
        assert r["distance"] < 1e-6 and r["whole"] < 1e-6 and r["whole_optim"] < 1e-6 and r["loaded"] < 1e-6, r
        assert r["gathered"] < 1e-6, "zgraph.gather gives every rank the whole model"
        assert r["params"] < r["eager_params"] / 4 * 1.1, (r["params"], r["eager_params"])
        assert r["state"] <= r["live"] <= r["state"] + 64, r  # nothing else left alive: + the step's own scalars
        assert r["optimizer"] < r["eager_optimizer"] / 4 * 1.1, (r["optimizer"], r["eager_optimizer"])
    assert sorted(n for r in runs[:2] for n in r["owned"]) == sorted(PARAMS)


def test_zero_3_gathers_and_reduces_each_stage_bucket_once_per_step_whatever_the_micro_batch_count(four_ranks):
    """At ZeRO 3 a stage's parameters are all-gathered once per step (its gather graph: one bucket here, run before
    the stage's first action and kept across the micro-batches) and its gradients reduce-scattered once (its update
    graph, which reads and writes the shards and gathers nothing): the collectives a step runs are the same for 2
    and 4 micro-batches."""
    for rank in four_ranks["stage_three"]:
        for r in rank:
            stage = r["gathers"]
            assert [n for n, count in stage.items() if count] == [n for n in stage if n.endswith(".gather")], stage
            assert sum(stage.values()) == 1 and r["reduce_scatters"] == [1], r
            # on gloo a reduce-scatter runs as an all_to_all_single (zgraph.graph.reduce_scatter_by_all_to_all)
            assert r["comm"] == {"all_gather_into_tensor_coalesced": 1, "all_to_all_single": 1}, r["comm"]


def test_zero_3_regathered_gathers_before_each_action_and_equals_eager(four_ranks):
    """``Config.pipeline_regather`` (P=2 x D=2, interleaved: 2 stages per rank, 2 micro-batches): the parameters,
    the whole model and optimizer state equal eager's after the steps, a quarter of the state per rank and nothing
    else alive between steps; in the last step each stage's gather ran before each of its actions (2 stages x 2
    micro-batches x F and B: 8 all-gathers per rank), its gradients still reduce-scattered once; ``explain()`` and
    ``step.estimate`` say so."""
    for r in four_ranks["stage_three_regathered"]:
        torch.testing.assert_close(torch.stack(r["got"]), torch.stack(r["want"]), rtol=1e-6, atol=1e-6)
        assert r["distance"] < 1e-6 and r["whole"] < 1e-6 and r["whole_optim"] < 1e-6 and r["loaded"] < 1e-6, r
        assert r["params"] < r["eager_params"] / 4 * 1.1 and r["state"] <= r["live"] <= r["state"] + 64, r
        assert r["comm"] == {"all_gather_into_tensor_coalesced": 8, "all_to_all_single": 2}, r["comm"]
        assert any("before each of its actions" in line for line in r["sharding"]), r["sharding"]
    model = Net()
    config = zgraph.Config(
        backend="eager",
        pipeline_parallel=2,
        schedule="interleaved_1f1b",
        pipeline_virtual_stages=2,
        microbatches=2,
        stage=3,
        param_persistence_threshold=0,
        pipeline_regather=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    e = zgraph.distribute(config)(step).estimate(model, opt, *batches()[0], world_size=4)
    assert e.comm_count["all_gather_into_tensor"] == 8, e.comm_count


@pytest.mark.parametrize("run", list(STAGE_THREE_RUNS))
def test_the_estimate_at_zero_3_gives_the_state_each_rank_holds_and_the_collectives_it_runs(four_ranks, run):
    """Issue 42, item 4: ``step.estimate`` of the ZeRO 3 runs (in process, 4 ranks planned, each rank's rows): each
    stage's model state is what the tensors its ranks' model, optimizer and steps left alive hold between steps
    (its parameters' and optimizer state's padded shards); per step one all-gather of the stage's parameters (their
    padded whole) and one reduce-scatter of its gradients, the ops the run issued; the peak is an update's."""
    runs = [rank[STAGE_THREE_RUNS[run]] for rank in four_ranks["stage_three"]]
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    microbatches = [2, 4][STAGE_THREE_RUNS[run]]
    config = zgraph.Config(backend="eager", pipeline_parallel=2, schedule="1f1b", microbatches=microbatches, stage=3,
                           param_persistence_threshold=0)  # fmt: skip
    rows = zgraph.pipeline_batch(batches()[0], 2, rank=0, world=4)  # a rank's rows: half the batch
    estimate = zgraph.distribute(config)(step).estimate(model, opt, *rows, world_size=4)
    for rank, r in enumerate(runs):
        stage = estimate.stages[rank % 2]
        assert stage.model_state_bytes["total"] == r["state"] <= r["live"] <= r["state"] + 64, (stage, r)
    assert estimate.comm_count["all_gather_into_tensor"] == estimate.comm_count["reduce_scatter_tensor"] == 1
    sender = padded(runs[0]["owned"])  # stage 0, the larger: the rank sending the most
    assert estimate.comm_bytes["all_gather_into_tensor"] == estimate.comm_bytes["reduce_scatter_tensor"] == sender
    assert {k: n for k, n in estimate.comm_ops.items() if k != "isend"} == runs[0]["comm"], estimate.comm_ops
    # the peak: stage 0's update (with the summing twins no backward here holds its contributions at once), its
    # bucket padded whole into the reduce-scatter and out of it; the gathered parameters were let go before it
    alive = dict(estimate.alive_at_peak)
    assert estimate.peak_node.startswith("rank 0 of the pipeline: stage 0's update"), estimate.peak_node
    assert alive["_chunk_cat_default"] == alive["all_to_all_single_default"] == sender, alive
    assert not any(k.startswith("whole parameters gathered") for k in alive), alive


def test_hybrid_sharding_of_one_rank_replicates_and_of_the_whole_group_is_plain_zero(four_ranks):
    """P=2 x D=2: ``shard_group_size=1`` (ZeRO 2) keeps each stage's whole optimizer state on its ranks, reduces
    its gradients by a reduce-scatter over one rank and an all-reduce across the two; ``shard_group_size=2`` (ZeRO
    1) shards it over the data-parallel group as without it (a quarter per rank, no all-reduce across groups); both
    equal eager after the steps."""
    for replicated, plain in four_ranks["hybrid_degenerate"]:
        for r in (replicated, plain):
            torch.testing.assert_close(torch.stack(r["got"]), torch.stack(r["want"]), rtol=1e-6, atol=1e-6)
            assert r["distance"] < 1e-6 and r["whole"] < 1e-6 and r.get("loaded", 0.0) < 1e-6, r
        whole_stage = replicated["eager_optimizer"] / 2
        assert whole_stage * 0.9 < replicated["optimizer"] < whole_stage * 1.1, replicated
        assert replicated["comm"] == {"all_to_all_single": 1, "all_reduce_": 1, "all_gather_into_tensor_coalesced": 1}
        assert plain["optimizer"] < plain["eager_optimizer"] / 4 * 1.1, plain
        assert "all_reduce_" not in plain["comm"] and plain["reduce_scatters"] == [1], plain
        assert any(line.startswith("ZeRO within each stage: a stage's") for line in plain["sharding"]), plain
        hybrid = next(line for line in replicated["sharding"] if line.startswith("ZeRO within each stage, hybrid"))
        assert "over the 1 rank of its shard group" in hybrid and "across the 2 shard groups" in hybrid, hybrid


@pytest.mark.parametrize(("run", "stage", "shards"), [(0, 2, 1), (1, 1, 2)])
def test_the_estimate_of_hybrid_sharding_within_stages_gives_what_the_ranks_held_and_ran(
    four_ranks, run, stage, shards
):
    """``step.estimate`` (in process, 4 ranks planned) of the hybrid runs above: each stage's model state is what its
    ranks hold (``shard_group_size=1``: the whole optimizer state, unpadded; 2: sharded as without hybrid), and its
    collectives are the ops the run issued (with 1: a reduce-scatter over the shard group, an all-reduce across)."""
    runs = [r[run] for r in four_ranks["hybrid_degenerate"]]
    config = zgraph.Config(backend="eager", pipeline_parallel=2, schedule="1f1b", microbatches=2, stage=stage,
                           shard_group_size=shards, param_persistence_threshold=0)  # fmt: skip
    model = Net()
    e = zgraph.distribute(config)(step).estimate(model, torch.optim.AdamW(model.parameters(), lr=LR), *batches()[0],
                                                 world_size=4)  # fmt: skip
    for rank, r in enumerate(runs):
        assert e.stages[rank % 2].model_state_bytes["total"] == r["state"], (e.stages[rank % 2], r["state"])
    assert {k: n for k, n in e.comm_ops.items() if k != "isend"} == runs[0]["comm"], (e.comm_ops, runs[0]["comm"])
    assert ("all_reduce" in e.comm_count) == (shards == 1), e.comm_count


def test_max_grad_norm_at_zero_2_clips_by_the_norm_over_every_stage_and_shard(four_ranks):
    """Issue 42, item 2: P=2 x D=2 at ZeRO 2, every step clipping (eager's norm above ``max_grad_norm``): the whole
    model (``zgraph.full_state_dict``) equals eager's after 3 SGD steps; the stage's gradients are still
    reduce-scattered once (one bucket), by the part of the update the norm reads, which hands the shards on."""
    for r in four_ranks["zero_clipped"]:
        torch.testing.assert_close(torch.stack(r["got"]), torch.stack(r["want"]), rtol=1e-6, atol=1e-6)
        assert r["whole"] < 1e-6 and min(r["norms"]) > CLIP, r
        assert r["reduce_scatters"] == 1, r["reduce_scatters"]
        assert r["totals_all_reduced"] == [1], "the norm's partial sums over the pipeline: one fp32 scalar"
    config = zgraph.Config(
        backend="eager", pipeline_parallel=2, schedule="1f1b", microbatches=2, stage=2, max_grad_norm=CLIP
    )
    model = Net()
    e = zgraph.distribute(config)(step).estimate(model, SGD(model.parameters()), *batches()[0], world_size=4)
    ran = four_ranks["zero_clipped"][0]
    assert e.comm_count["all_reduce"] == ran["graph_all_reduces"] + len(ran["totals_all_reduced"]) == 2, e.comm_count


def test_a_steps_own_clip_norm_and_a_value_of_the_parameters_are_returned_as_eager_returns_them(four_ranks):
    """P=2 x D=2: ``clip_grad_norm_``'s norm, made once a step from the gradients of every stage and pipeline (a
    result of stage 0's update), and a value of the parameters alone (the same on every micro-batch and pipeline:
    not summed over the pipelines) equal eager's on the whole batch, with the loss, on every rank."""
    for r in four_ranks["step_results"]:
        torch.testing.assert_close(torch.stack(r["got"]), torch.stack(r["want"]), rtol=1e-5, atol=1e-6)


def test_reduce_dtype_is_what_each_stages_gradients_cross_the_pipelines_in(four_ranks):
    """Issue 42, item 2: ``reduce_dtype=torch.bfloat16`` at ZeRO 0 (the all-reduce of each stage's gradient sums)
    and ZeRO 2 (the update's reduce-scatter) sends bf16; the model differs from eager's by bf16's rounding (in
    fp32: below 1e-6)."""
    for zero0, zero2 in four_ranks["reduced_in_bf16"]:
        assert zero0["all_reduced"] == ["torch.bfloat16"] and zero0["scattered"] == [], zero0
        assert zero2["all_reduced"] == [] and zero2["scattered"] == ["torch.bfloat16"], zero2
        assert 1e-6 < zero0["whole"] < 1e-3 and 1e-6 < zero2["whole"] < 1e-3, (zero0["whole"], zero2["whole"])


@pytest.mark.parametrize("stage", [1, 2])
def test_explain_and_the_estimate_give_the_state_sharded_within_each_stage(four_ranks, stage):
    """``explain()`` says what each stage shards over which data-parallel group and its update graph's buckets;
    ``step.estimate`` (in process, 4 ranks planned) gives each stage's model state as its ranks hold it: the
    optimizer state's padded shard, the parameters in their padded all-gathered storage."""
    runs = [rank[ZERO_RUNS[f"stage {stage}, 2 micro-batches"]] for rank in four_ranks["zero_within_stages"]]
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    config = zgraph.Config(backend="eager", pipeline_parallel=2, schedule="1f1b", microbatches=2, stage=stage)
    estimate = zgraph.distribute(config)(step).estimate(model, opt, *batches()[0], world_size=4)
    for rank, r in enumerate(runs):
        assert estimate.stages[rank % 2].model_state_bytes["total"] == r["state"], (estimate.stages, r["state"])
        zero, *buckets = sorted(r["sharding"], key=lambda line: not line.startswith("ZeRO"))
        assert zero.startswith("ZeRO within each stage: a stage's optimizer state sharded over the 2 ranks of its "
                               f"data-parallel group (here global ranks {[rank % 2, rank % 2 + 2]})"), zero  # fmt: skip
        kinds = ("all_gather", "reduce_scatter")  # the stage's one bucket, padded to equal shards
        nbytes = padded(r["owned"])
        assert buckets == [f"buckets of stage{rank % 2}.update: {kind} x1 ({nbytes} B)" for kind in kinds], buckets
    # the estimate's collectives are its update graph's (those of rank 0, stage 0's, the larger: sending the most)
    assert estimate.comm_count == {"send": 2, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
    assert estimate.comm_bytes["all_gather_into_tensor"] == estimate.comm_bytes["reduce_scatter_tensor"]
    assert estimate.comm_bytes["reduce_scatter_tensor"] == padded(runs[0]["owned"])


BY_SEQUENCE = {"stage 0": 0, "stage 1": 1, "stage 0, uneven labels per slice": 2, "stage 3": 3,
               "stage 3, hybrid": 4}  # fmt: skip


@pytest.mark.parametrize("run", list(BY_SEQUENCE))
def test_two_stages_of_two_sequence_parallel_ranks_equal_eager_on_the_whole_batch(four_ranks, run):
    """P=2 x SP=2 (ranks 0, 1: stage 0; ranks 2, 3: stage 1; ranks 0 and 2, 1 and 3 a chain of sends), a GPT on each
    rank's slice of the sequences: losses and every parameter after 3 steps as eager's on the whole batch, at ZeRO 0,
    1 and 3 (over the stage's two sequence ranks), and with the last position's label ignored (the cross_entropy
    mean's count differs between slices); each stage's forward and backward run attention's all-to-alls."""
    runs = [rank[BY_SEQUENCE[run]] for rank in four_ranks["pipeline_by_sequence"]]
    for r in runs:
        torch.testing.assert_close(torch.tensor(r["got"]), torch.tensor(r["want"]), rtol=1e-6, atol=1e-6)
        assert r["distance"] < 1e-6, r["distance"]
        parts = {name.split(".")[1]: n for name, n in r["exchanges"].items() if re.fullmatch(r"stage\d\.\w+", name)}
        assert parts["forward"] > 0 and parts["backward"] > 0 and parts["update"] == 0, r["exchanges"]
    assert runs[0]["owned"] == runs[1]["owned"] and runs[2]["owned"] == runs[3]["owned"], "a stage per place"
    assert not set(runs[0]["owned"]) & set(runs[2]["owned"])
    assert "blocks.0.qkv.weight" in runs[0]["owned"] and "blocks.1.qkv.weight" in runs[2]["owned"]
    for rank, r in enumerate(runs):
        chain = [rank % 2, rank % 2 + 2]
        assert r["explained"].endswith(
            f"this is rank {rank // 2} of the chain of global ranks {chain}, one of 2 (1 pipelines x 2 sequence slices)"
        ), r["explained"]


def test_hybrid_sharding_with_sequence_parallelism_within_stages(four_ranks):
    """P=2 x SP=2 at ZeRO 3 with ``shard_group_size=1``: a stage's state is whole on each of its 2 sequence ranks
    (shard groups of one rank, replicated across the two), its gradient sums reduced within the shard group and
    all-reduced across once per step; parameters as eager's (the parametrized test above)."""
    runs = [rank[BY_SEQUENCE["stage 3, hybrid"]] for rank in four_ranks["pipeline_by_sequence"]]
    assert runs[0]["params"] == runs[1]["params"] and runs[2]["params"] == runs[3]["params"], "whole on both"
    assert runs[0]["params"] + runs[2]["params"] == runs[0]["eager_params"], [r["params"] for r in runs]
    for rank, r in enumerate(runs):
        assert r["comm"] == {"all_gather_into_tensor_coalesced": 1, "all_to_all_single": 1, "all_reduce_": 1}, r
        data = [rank - rank % 2, rank - rank % 2 + 1]
        assert r["sharding"] == (
            f"  ZeRO within each stage, hybrid: a stage's parameters sharded over the 1 rank of its shard group "
            f"(here global ranks [{rank}]) and replicated across the 2 shard groups of its data-parallel group "
            f"(global ranks {data}); its update graph reduce-scatters the gradient sums within the shard group and "
            "all-reduces the shards across the groups once per step (the lines `buckets of stageN.update`)"
        ), r["sharding"]
    model = sc.build("gpt")[0]  # the estimate, in process: what the ranks held and the ops they ran
    config = zgraph.Config(backend="eager", pipeline_parallel=2, sequence_parallel=2, microbatches=2, stage=3,
                           param_persistence_threshold=0, shard_group_size=1)  # fmt: skip
    rows = zgraph.pipeline_batch(sc.batches("gpt")[0], 2, sequence_parallel=2, rank=0, world=4)
    e = zgraph.distribute(config)(sc.train_step).estimate(model, SGD(model.parameters()), *rows, world_size=4)
    assert [s.model_state_bytes["params"] for s in e.stages] == [runs[0]["params"], runs[2]["params"]], e.stages
    assert {k: n for k, n in e.comm_ops.items() if k != "isend"} == runs[0]["comm"], e.comm_ops


def test_zero_3_with_sequence_parallelism_shards_over_the_stages_sequence_ranks_and_gathers_once_per_step(four_ranks):
    """P=2 x SP=2 at ZeRO 3: a stage's parameters are sharded over its place's data-parallel group, the D x SP ranks
    running it (here its 2 sequence ranks; as DeepSpeed's ZeRO-3 with Ulysses shards over data x sequence ranks), so
    each rank holds a quarter (1 / (P x SP)) of the parameters between steps; each stage all-gathers them once per
    step (its gather graph, one bucket; no other stage graph gathers) and reduce-scatters its gradient sums once
    (on gloo an ``all_to_all_single``); attention's all-to-alls are ``zgraph`` ops, not counted here."""
    runs = [rank[BY_SEQUENCE["stage 3"]] for rank in four_ranks["pipeline_by_sequence"]]
    for rank, r in enumerate(runs):
        assert r["params"] < r["eager_params"] / 4 * 1.1, (r["params"], r["eager_params"])
        assert {n: c for n, c in r["gathers"].items() if c} == {f"stage{rank // 2}.gather": 1}, r["gathers"]
        assert r["comm"] == {"all_gather_into_tensor_coalesced": 1, "all_to_all_single": 1}, r["comm"]
        ranks = [rank - rank % 2, rank - rank % 2 + 1]
        assert (
            f"parameters sharded over the 2 ranks of its data-parallel group (here global ranks {ranks})"
            in r["sharding"]
        ), r["sharding"]


def test_pipeline_by_sequence_that_does_not_divide_the_world_is_refused(four_ranks):
    """P=2 and SP=4 each divide 4 ranks, their product does not: ``Config`` refuses it, naming both."""
    for message in four_ranks["pipeline_by_sequence_refused"]:
        assert "pipeline_parallel=2 x sequence_parallel=4 = 8 must divide the world size (4)" in message, message


def test_the_rank_layout_of_pipelines_by_sequence():
    """``P x SP x D`` ranks, SP innermost: rank ``(d*P + p)*SP + s``; a chain holds one slice through every stage,
    a place's data-parallel group every chain's rank at that place; ``zgraph.pipeline_batch`` cuts rows by ``d``
    and sequences by ``s``."""
    from zgraph.runtime.pipeline_groups import layout, place_of

    ranks = list(range(8))  # P=2, SP=2, D=2
    assert layout(ranks, 0, 2, 2) == ([0, 2], (0, 1, 4, 5))
    assert layout(ranks, 3, 2, 2) == ([1, 3], (2, 3, 6, 7))
    assert layout(ranks, 5, 2, 2) == ([5, 7], (0, 1, 4, 5))
    assert layout(ranks, 5, 2, 1) == ([4, 5], (1, 3, 5, 7)), "without SP: pipelines of P consecutive ranks"
    assert [place_of(r, 2, 2) for r in ranks] == [0, 0, 1, 1, 0, 0, 1, 1]
    batch = torch.arange(4 * 6).view(4, 6)
    got = [zgraph.pipeline_batch(batch, 2, sequence_parallel=2, rank=r, world=8) for r in ranks]
    assert torch.equal(got[0], batch[:2, :3]) and torch.equal(got[3], batch[:2, 3:]) and torch.equal(got[2], got[0])
    assert torch.equal(got[5], batch[2:, 3:])
    with pytest.raises(ValueError, match="pipeline_parallel=2 x sequence_parallel=2 does not divide the world"):
        zgraph.pipeline_batch(batch, 2, sequence_parallel=2, rank=0, world=6)


def test_a_step_group_pipelines_by_sequence_do_not_divide_is_refused_before_any_group():
    """A step's own group (``step_groups``, before any group is made) that ``P x SP`` does not divide."""
    from zgraph.binding.setup import step_groups
    from zgraph.runtime.process_group import ProcessGroupInfo

    config = zgraph.Config(pipeline_parallel=2, sequence_parallel=2)
    group = ProcessGroupInfo(world_size=6, rank=0, group_name="six", backend="gloo")
    with pytest.raises(ValueError, match=r"pipeline_parallel=2 x sequence_parallel=2 = 4 must divide the world"):
        step_groups(group, config)
