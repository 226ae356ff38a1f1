"""ZeRO stages 0-3 on 1, 2 and 4 spawned ranks (gloo) against eager PyTorch on one process.

For every case of ``zero_cases.CASES`` and every stage, after 10 steps the ranks' averaged losses, the whole
parameters and buffers (``zgraph.full_state_dict``) and the optimizer state equal a single-process eager run on
the concatenated global batch within 1e-6 relative to each tensor's scale (max |a - b| <= 1e-6 * max |b|):
the ranks average per-rank gradients, eager sums over the whole batch at once, so the float reductions run in a
different order and agree to a few ulps, not bitwise. Every rank group is started once per world size and runs
all cases, to keep process start-up out of the test time.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from zero_cases import CASES, reference

STAGES = [0, 1, 2, 3]
WORLDS = [1, 2, 4]
REL = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            path = tmp_path_factory.mktemp(f"zero{world}") / "results.pt"
            run_ranks(world, "zero_cases.run_cases", str(path), STAGES, list(CASES))
            cache[world] = torch.load(path, weights_only=False)
        return cache[world]

    return get


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), what
        return
    scale = expected.abs().max().clamp_min(1e-12)
    err = (actual - expected).abs().max() / scale
    assert err <= REL, f"{what}: max |diff| is {err.item():.2e} of max |expected|"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", list(CASES))
def test_zero_matches_eager_on_global_batch(results, world, stage, name):
    result = results(world)[(stage, name)]
    assert "error" not in result, result.get("error")
    expected = reference(CASES[name], world)
    for i, (got, want) in enumerate(zip(result["losses"], expected["losses"])):
        assert abs(got - want) <= REL * max(abs(want), 1e-12), f"loss of call {i}: {got} vs {want}"
    for got_model, want_model in zip(result["models"], expected["models"], strict=True):
        assert got_model.keys() == want_model.keys()
        for key in want_model:
            assert_rel(got_model[key], want_model[key], f"state_dict[{key!r}]")
    for got_opt, want_opt in zip(result["optimizers"], expected["optimizers"], strict=True):
        assert got_opt["param_groups"] == want_opt["param_groups"]
        assert got_opt["state"].keys() == want_opt["state"].keys()
        for index, state in want_opt["state"].items():
            for key, value in state.items():
                assert_rel(got_opt["state"][index][key], value, f"optimizer state[{index}][{key!r}]")


def test_accumulation_loop_equals_one_big_batch(results):
    """The Python micro-batch loop inside the step gives what one big batch gives (on 2 ranks, stage 3)."""
    looped = results(2)[(3, "accumulation_loop")]
    one_batch = reference(CASES["adamw"], 2)
    for key, value in one_batch["models"][0].items():
        assert_rel(looped["models"][0][key], value, key)
