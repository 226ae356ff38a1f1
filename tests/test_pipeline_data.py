"""Pipeline parallelism over ``P x D`` ranks (issue 42): two pipelines of two stages on four gloo ranks, each
pipeline on its rows of the batch (``zgraph.pipeline_batch``), against eager PyTorch on the whole batch, and the
gradient reductions a step issues: one per stage, the same for 2 and 4 micro-batches (3 steps with 2, 1 with 4);
at ZeRO stages 1 and 2 within each stage's data-parallel group, one reduce-scatter per stage's bucket; and two
stages of two sequence-parallel ranks each (P=2 x SP=2), with the rank layout and its refusals."""

from __future__ import annotations

import re

import pytest
import torch
from pipeline_cases import Net

import zgraph

PARAMS = [name for name, _ in Net().named_parameters()]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("pipeline_data") / "results.pt"
    cases = ["two_by_two", "zero_within_stages", "pipeline_by_sequence", "pipeline_by_sequence_refused"]
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
    parameters), the cross_entropy mean's count of tokens once and the 0-d loss once, for 2 and 4 micro-batches."""
    for rank in two_by_two:
        two, four = rank
        assert sorted(two["sizes"]) == sorted(four["sizes"]) == sorted([two["stage_numel"], 1, 1]), (two, four)


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
    step's only all-reduces are the token count's and the loss's)."""
    for rank in four_ranks["zero_within_stages"]:
        for r in rank:
            assert r["reduce_scatters"] == [1] and sorted(r["sizes"]) == [1, 1], r


BY_SEQUENCE = {"stage 0": 0, "stage 1": 1, "stage 0, uneven labels per slice": 2}


@pytest.mark.parametrize("run", list(BY_SEQUENCE))
def test_two_stages_of_two_sequence_parallel_ranks_equal_eager_on_the_whole_batch(four_ranks, run):
    """P=2 x SP=2 (ranks 0, 1: stage 0; ranks 2, 3: stage 1; ranks 0 and 2, 1 and 3 a chain of sends), a GPT on each
    rank's slice of the sequences: losses and every parameter after 3 steps as eager's on the whole batch, at ZeRO 0
    and 1 (over the stage's two sequence ranks), and with the last position's label ignored (the cross_entropy
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
