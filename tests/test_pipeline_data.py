"""Pipeline parallelism over ``P x D`` ranks (issue 42): two pipelines of two stages on four gloo ranks, each
pipeline on its rows of the batch (``zgraph.pipeline_batch``), against eager PyTorch on the whole batch, and the
gradient reductions a step issues: one per stage, the same for 2 and 4 micro-batches (3 steps with 2, 1 with 4)."""

from __future__ import annotations

import pytest
import torch
from pipeline_cases import Net

PARAMS = [name for name, _ in Net().named_parameters()]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("pipeline_data") / "results.pt"
    run_ranks(4, "pipeline_data_cases.run", str(path), ["two_by_two"], timeout=300)
    result = torch.load(path, weights_only=False)["two_by_two"]
    assert not (isinstance(result, dict) and "error" in result), result.get("error")
    return result


@pytest.mark.parametrize("microbatches", [2, 4])
def test_two_pipelines_of_two_stages_equal_eager_on_the_whole_batch(four_ranks, microbatches):
    runs = [rank[[2, 4].index(microbatches)] for rank in four_ranks]
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


def test_gradients_are_reduced_once_per_stage_per_step_whatever_the_micro_batch_count(four_ranks):
    """Each rank's step all-reduces over the pipelines its stage's gradient sums once (one flat bucket of all its
    parameters), the cross_entropy mean's count of tokens once and the 0-d loss once, for 2 and 4 micro-batches."""
    for rank in four_ranks:
        two, four = rank
        assert sorted(two["sizes"]) == sorted(four["sizes"]) == sorted([two["stage_numel"], 1, 1]), (two, four)
