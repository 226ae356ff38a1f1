"""Multi-rank behaviour besides parity: collectives per stage, memory per rank, errors instead of hangs,
``zgraph.gather`` (the ranks run ``zero_checks``; these tests read what they report)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from zero_checks import expected_state_bytes

CHECKS = [
    "collective_counts",
    "memory",
    "errors",
    "gather_roundtrip",
    "collective_sequences",
    "differing_plans",
    "prefetch_memory",
    "persistence",
    "released",
    "user_collectives",
    "split_steps",
    "waits_before_use",
    "moved_between_steps",
]


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            path = tmp_path_factory.mktemp(f"checks{world}") / "results.pt"
            names = CHECKS if world == 2 else ["memory"]
            run_ranks(world, "zero_checks.run_checks", str(path), names)
            cache[world] = torch.load(path, weights_only=False)
        result = cache[world]
        for name, value in result.items():
            assert not (isinstance(value, dict) and "error" in value), f"{name}: {value['error']}"
        return result

    return get


def test_collective_counts_per_stage(checks):
    """MLP Linear(8,16) -> tanh -> Linear(16,4): 4 parameters, all trained. Backward reads only the second
    weight (the first layer's input needs no gradient). Bucketing off: one collective per tensor. The step ends
    with zero_grad(), so from stage 1 on only the sharded optimizer reads gradients: reduce-scatter."""
    counts = checks(2)["collective_counts"]
    gather, scatter = "all_gather_into_tensor", "reduce_scatter_tensor"
    assert counts[0] == {("all_reduce", "backward"): 4}
    assert counts[1] == {(scatter, "backward"): 4, (gather, "optimizer"): 4}
    assert counts[2] == {(scatter, "backward"): 4, (gather, "optimizer"): 4}
    assert counts[3] == {(gather, "forward"): 4, (gather, "backward"): 1, (scatter, "backward"): 4}


@pytest.mark.parametrize("world", [2, 4])
def test_model_state_bytes_per_rank(checks, world):
    """Stage 1 holds optimizer state / N, stage 2 also gradients / N, stage 3 also parameters / N (shards are
    padded to equal rows). Counted from the live state, and independently by a dispatch-mode tracker of every
    allocation since the model was built (nothing else is left alive)."""
    measured = checks(world)["memory"]
    expected = expected_state_bytes(world)
    for stage in range(4):
        state = measured[stage]["state"]
        assert state == expected[stage], f"stage {stage}: {state} != {expected[stage]}"
        assert measured[stage]["tracked"] == state["total"], f"stage {stage}: tracker saw {measured[stage]}"
    full = expected[0]
    assert expected[3]["total"] <= full["total"] / world * 1.05
    assert expected[1]["optimizer"] < full["optimizer"] / world * 1.05


def test_batch_shapes_one_graph_cannot_serve_raise_on_every_rank(checks):
    """Batch sizes 4 and 1: the size that differs between ranks is symbolic, but a size 1 is specialized (ranks
    whose sizes one graph serves: ``test_dynamic_shapes``)."""
    message = checks(2)["errors"]["shapes"]
    assert message is not None
    assert "Rank 0 has `input x (s" in message and "rank 1 has `input x (1, 8) torch.float32`" in message
    assert "not a size 0 or 1" in message


def test_a_rank_whose_capture_fails_does_not_hang_the_others(checks):
    message = checks(2)["errors"]["capture"]
    assert message is not None and "Rank 1 could not build its graph" in message
    assert "if fail and loss.item() > 0" in message


def test_stage3_model_outside_the_step(checks):
    errors = checks(2)["errors"]
    assert errors["outside"] is not None and "zgraph.gather" in errors["outside"]
    assert errors["inside_shape"] == (16, 8)
    assert errors["inside_output"].shape == (4, 4)


@pytest.mark.parametrize("stage", [2, 3])
def test_gather_gives_whole_tensors_and_writes_back_edits(checks, stage):
    r = checks(2)["gather_roundtrip"][stage]
    for name, value in r["whole"].items():
        assert torch.equal(value, r["before"][name])
    assert r["grad"].shape == (16, 8) and r["grad"].abs().sum() > 0
    for name, value in r["before"].items():
        assert torch.equal(r["untouched"][name], value), f"{name} changed by a read-only gather"
    assert torch.equal(r["after"]["2.bias"], r["before"]["2.bias"] + 1)
    assert torch.equal(r["after"]["0.weight"], r["before"]["0.weight"])
    assert torch.count_nonzero(r["grad_after"]) == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_rank_issues_the_same_collectives(checks, stage):
    """Bucketed and scheduled graphs: the same collective sequence on every rank (kind, bytes, dtype, phase),
    though each rank's batch differs."""
    first, *others = checks(2)["collective_sequences"][stage]
    assert first and all(other == first for other in others)


def test_ranks_with_different_bucket_plans_raise_before_any_collective(checks):
    message = checks(2)["differing_plans"]
    assert message is not None and "First difference between rank 0 and rank 1" in message
    assert "collective all_gather_into_tensor" in message


def test_prefetch_stays_within_its_cap(checks):
    """Peak live bytes of a stage-3 step grow with ``prefetch_bytes``, by no more than the cap (plus one
    bucket's rounding: gathers are issued whole)."""
    peaks = checks(2)["prefetch_memory"]
    base = peaks[0]
    bucket = 1 << 16
    for cap, peak in peaks.items():
        assert peak - base <= cap + bucket, f"prefetch {cap}: peak {peak} vs {base} without prefetch"
    assert peaks[1 << 30] > base  # prefetching does hold parameters ahead of use


def test_small_parameters_persist_in_stage3(checks):
    result = checks(2)["persistence"]
    big = sorted(n for n, numel in result["numels"].items() if numel > 100_000)
    small = [n for n, numel in result["numels"].items() if numel <= 100_000]
    assert result["sharded"] == big == ["head.weight", "tok.weight"] and small
    assert result["forward_gathers"] >= 1
    # explain() says how many parameters were sharded and how many stayed whole
    whole = len(result["numels"]) - 2
    assert "parameters: 2 sharded (" in result["explain"], result["explain"]
    assert f"{whole} whole on every rank (" in result["explain"]
    assert "param_persistence_threshold=100000 elements" in result["explain"]
    # a model with no parameter above the threshold: stage 3 warns (once for the model) and explain shows 0
    assert len(result["small_warnings"]) == 1 and "param_persistence_threshold" in result["small_warnings"][0]
    assert "parameters: 0 sharded (0 B), 4 whole on every rank" in result["small_explain"], result["small_explain"]


def test_a_sharded_model_is_freed_when_the_user_drops_it(checks):
    """Nothing zgraph keeps (its record of which step sharded a module) holds the model, its optimizer or their
    tensors alive after the user drops model, optimizer and step."""
    assert checks(2)["released"] == {stage: (True, True) for stage in range(4)}


def test_collectives_the_user_calls_inside_the_step(checks):
    """``dist.all_reduce`` (AVG; MAX with ``async_op``), ``broadcast`` and ``all_gather_into_tensor`` written in
    the step give, on every call, what the same collectives give eagerly; an untraceable one raises clearly."""
    result = checks(2)["user_collectives"]
    for inside, eager in zip(result["inside"], result["eager"]):
        for got, want in zip(inside, eager):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert "c10d.allgather_" in result["list_all_gather"]


@pytest.mark.parametrize("stage", range(4))
def test_accumulation_over_calls_with_the_optimizer_in_another_step(checks, stage):
    """``forward_backward`` (zgraph, no optimizer) twice, then ``opt.step()`` in a second zgraph step: equal to
    eager on the global batch at every stage. Stepping the optimizer eagerly instead works where eager optimizers
    can: stages 0-1 (whole gradients) and 3 (the optimizer adopts the sharded parameters and updates the DTensor
    shards, as with FSDP2); stage 2 (whole parameters, sharded gradients) raises clearly."""
    result = checks(2)["split_steps"]
    assert result[("zgraph", stage)] < 1e-6
    if stage == 2:
        assert "stage-2 step left these parameters' gradients sharded" in result[("eager", stage)]
    else:
        assert result[("eager", stage)] < 1e-6


def test_stage3_waits_sit_right_before_the_first_real_use(checks):
    """A gathered parameter's wait (and its transpose or cast) moves to right before the op that computes with
    it, so the gather overlaps everything before that op."""
    between = checks(2)["waits_before_use"]
    assert between, "the stage-3 graph has forward gathers"
    assert max(between.values()) == 0, between


def test_model_moved_between_steps_keeps_training(checks):
    """``model.to(device)`` on a model whose parameters zgraph sharded swaps copies into them; the next updates used
    to go to the shards swapped out and were lost (silently: stage 3's third step equalled its second). Now the
    copies are adopted. A parameter laid out otherwise is refused before the step runs, naming it; not blamed on an
    earlier step's failure (failure records used to stand until that same step succeeded again)."""
    result = checks(2)["moved_between_steps"]
    for stage in range(4):
        assert result[stage] < 1e-6, (stage, result[stage])
    assert "parameter 0.weight is no longer a DTensor sharded as zgraph shards it" in result["replicated"], result
    assert "_step_with_list_all_gather" not in result["replicated"], "blamed on a failure the ranks got over"
    assert result["unchanged"], "the refused step changed the model"
