"""ZeRO stages 0-3 on 1, 2 and 4 spawned ranks (gloo) against eager PyTorch on one process.

For every case of ``zero_cases.CASES`` and every stage, after 10 steps the ranks' averaged losses, the whole
parameters and buffers (``zgraph.full_state_dict``) and the optimizer state equal a single-process eager run on
the concatenated global batch within a bound relative to each tensor's scale (max |a - b| <= bound * max |b|):
the ranks average per-rank gradients, eager sums over the whole batch at once, so the float reductions run in a
different order and agree to a few ulps, not bitwise. How far reduction order alone moves the results depends on
the CPU (its vector width and BLAS blocking), so the bound is measured on the machine running the test: the
same eager run with the ranks' rows in another order (``reference(..., rotate=True)``, what DDP's per-rank sums
amount to) gives the case's own noise, and the bound is ``NOISE_FACTOR`` times that, and never below 1e-6.
Every rank group is started once per world size and runs all cases, to keep process start-up out of the time.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dist_harness import run_ranks
from zero_cases import CASES, reference

STAGES = [0, 1, 2, 3]
WORLDS = [1, 2, 4]
REL = 1e-6
NOISE_FACTOR = 10


@functools.cache
def expected(name: str, world: int) -> tuple[dict, float]:
    """The eager reference of a case and its parity bound (see the module's docstring)."""
    plain, rotated = reference(CASES[name], world), reference(CASES[name], world, rotate=True)
    noise = max(
        [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(rotated["losses"], plain["losses"])]
        + [_rel(r[k], p[k]) for r, p in zip(rotated["models"], plain["models"]) for k in p]
        + [
            _rel(r["state"][i][k], v)
            for r, p in zip(rotated["optimizers"], plain["optimizers"])
            for i, state in p["state"].items()
            for k, v in state.items()
        ]
    )
    return plain, max(REL, NOISE_FACTOR * noise)


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if not expected.is_floating_point() or not expected.numel():
        return 0.0
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


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


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, what: str, bound: float = REL) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), what
        return
    err = _rel(actual, expected)
    assert err <= bound, f"{what}: max |diff| is {err:.2e} of max |expected| (bound {bound:.2e})"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", list(CASES))
def test_zero_matches_eager_on_global_batch(results, world, stage, name):
    result = results(world)[(stage, name)]
    assert "error" not in result, result.get("error")
    want_all, bound = expected(name, world)
    for i, (got, want) in enumerate(zip(result["losses"], want_all["losses"])):
        assert abs(got - want) <= bound * max(abs(want), 1e-12), f"loss of call {i}: {got} vs {want} (bound {bound})"
    for got_model, want_model in zip(result["models"], want_all["models"], strict=True):
        assert got_model.keys() == want_model.keys()
        for key in want_model:
            assert_rel(got_model[key], want_model[key], f"state_dict[{key!r}]", bound)
    for got_opt, want_opt in zip(result["optimizers"], want_all["optimizers"], strict=True):
        assert got_opt["param_groups"] == want_opt["param_groups"]
        assert got_opt["state"].keys() == want_opt["state"].keys()
        for index, state in want_opt["state"].items():
            for key, value in state.items():
                assert_rel(got_opt["state"][index][key], value, f"optimizer state[{index}][{key!r}]", bound)


def test_accumulation_loop_equals_one_big_batch(results):
    """The Python micro-batch loop inside the step gives what one big batch gives (on 2 ranks, stage 3)."""
    looped = results(2)[(3, "accumulation_loop")]
    one_batch, bound = expected("adamw", 2)
    for key, value in one_batch["models"][0].items():
        assert_rel(looped["models"][0][key], value, key, bound)
