"""``Config.memory_budget``: the planner (``zgraph.inspect.budget``) picks, of the combinations of ``remat``,
offload and stage 3's ``max_reuse_distance`` the user left at their defaults, the fastest whose estimated peak fits;
the step then runs it, bitwise as without a budget, its measured peak (live tensor bytes) within the budget. A
budget nothing fits is refused before anything changes, naming the smallest that fits."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import cli_runner
import pytest
import torch

import zgraph
from zgraph.binding.arguments import StepCall
from zgraph.inspect.budget import _choice, _less_prefetch, candidates, plan_prepared, prepare_plan
from zgraph.inspect.estimate import estimate_variant

sys.path.insert(0, str(Path(__file__).parent))
from budget_cases import setup, train  # noqa: E402
from remat_cases import step  # noqa: E402

MiB = 2**20


@pytest.mark.parametrize(
    ("given", "nbytes"),
    [(12 * 2**30, 12 * 2**30), ("12GiB", 12 * 2**30), ("500MB", 500 * 10**6), ("1.5 GiB", 3 * 2**29), ("64", 64)],
)
def test_budget_sizes(given, nbytes):
    assert zgraph.Config(memory_budget=given).memory_budget == nbytes


@pytest.mark.parametrize("given", [0, -5, "12 parsecs", "GiB", True, 1.5, [1]])
def test_bad_budgets_are_refused(given):
    with pytest.raises(ValueError, match="memory_budget"):
        zgraph.Config(memory_budget=given)


def test_remat_auto_needs_a_budget():
    with pytest.raises(ValueError, match="memory_budget"):
        zgraph.Config(remat="auto")
    assert zgraph.Config(remat="auto", memory_budget="auto").memory_budget == "auto"


def test_candidates_change_only_what_the_user_left_at_its_default():
    plain = candidates(zgraph.Config(stage=3), "cpu")
    assert {c["remat"] for c in plain} == {None, "selective", "full"}
    moved = ("offload_optimizer", "offload_params", "offload_activations")
    assert not any(k in c for c in plain for k in moved), "no tier saves CPU memory"
    assert {c.get("max_reuse_distance", 0) > 0 for c in plain} == {False, True}
    nvme = candidates(zgraph.Config(stage=3, offload_dir="/tmp"), "cpu")
    assert {c.get("offload_optimizer") for c in nvme} == {None, "nvme"}
    assert {c.get("offload_params") for c in nvme} == {None, "nvme"}
    assert {c.get("offload_activations") for c in nvme} == {None, "nvme"}
    assert len(nvme) == 3 * 2 * 3 * 2 * 2
    gpu = candidates(zgraph.Config(stage=2), "cuda")
    assert {c.get("offload_optimizer") for c in gpu} == {None, "cpu"} and not any("offload_params" in c for c in gpu)
    fixed = candidates(zgraph.Config(stage=3, remat="full", max_reuse_distance=10, offload_optimizer="cpu"), "cuda")
    assert {c["remat"] for c in fixed} == {"full"}
    assert not any("max_reuse_distance" in c or "offload_optimizer" in c for c in fixed)
    assert not any(c["remat"] == "full" for c in candidates(zgraph.Config(), "cpu", has_blocks=False))


@pytest.fixture(scope="module")
def peaks():
    """Estimated peak of each remat policy on the case's model (the combinations a 1-process CPU plan has)."""
    model, opt, batches = setup()
    planned = zgraph.distribute(zgraph.Config(backend="eager"))(step)
    plan = planned.estimate(model, opt, *batches[0], memory_budget=2**40)
    got = {c.changes["remat"]: c.estimate.peak_bytes for c in (plan.chosen, *plan.nearest)}
    assert got[None] > got["selective"] > got["full"], got
    return got


def test_the_plan_is_the_fastest_combination_that_fits(peaks):
    model, opt, batches = setup()
    config = zgraph.Config(backend="eager")
    prepared = prepare_plan(StepCall.of(step, (model, opt, *batches[0]), {}), config)  # captured once for all
    assert plan_prepared(prepared, config, peaks[None]).chosen.changes["remat"] is None
    # below a policy's peak on every block, the plan applies it to as few blocks as fit (a lighter one on the rest),
    # faster than the policy everywhere; where only full remat everywhere fits, that
    for budget, heavy in [(peaks[None] - 1, "selective"), (peaks["selective"] - 1, "full"), (peaks["full"], "full")]:
        plan = plan_prepared(prepared, config, budget)
        chosen = plan.chosen
        assert chosen.estimate.peak_bytes <= budget, plan.lines()
        assert all(chosen.estimate.step_seconds <= c.estimate.step_seconds for c in plan.nearest)
        assert "memory plan" in "\n".join(plan.lines())
        if budget == peaks["full"]:
            assert chosen.changes["remat"] == "full", plan.lines()
            continue
        assert isinstance(chosen.changes["remat"], dict) and heavy in chosen.changes["remat"].values(), plan.lines()
        everywhere = estimate_variant(prepared, config.replace(**{**chosen.changes, "remat": heavy}))
        assert chosen.estimate.step_seconds < everywhere.step_seconds, plan.lines()


def test_offload_is_estimated_only_where_it_may_win(peaks, tmp_path):
    """Offload adds transfers and saves no compute: where a combination without offload fits, only those whose
    twin without offload is faster are estimated with it (none, when no remat fits); all, where none fits."""
    model, opt, batches = setup()
    config = zgraph.Config(backend="eager", offload_dir=str(tmp_path))
    prepared = prepare_plan(StepCall.of(step, (model, opt, *batches[0]), {}), config)
    assert len(candidates(config, "cpu")) == 3 * 2  # remat x activation offload (stage 0: no optimizer offload)
    assert plan_prepared(prepared, config, peaks[None]).considered == 3
    tight = plan_prepared(prepared, config, peaks["full"] - 1)  # only offloading activations fits now
    assert tight.considered >= 3 * 2 and tight.chosen.changes.get("offload_activations") == "nvme"


def test_stage_3_retries_faster_combinations_gathering_just_in_time():
    """Where a faster combination misses the budget, stage 3 estimates it again with ``prefetch_bytes=1`` (each
    parameter gathered just before its use), which never needs more memory; not where prefetch_bytes is set."""
    model, opt, batches = setup(0, 2, layers=2)
    config = zgraph.Config(stage=3, backend="eager", param_persistence_threshold=0)
    prepared = prepare_plan(StepCall.of(step, (model, opt, *batches[0]), {}), config, world_size=2)
    choices = [_choice(prepared, config, changes) for changes in candidates(config, "cpu")]
    fastest = min(choices, key=lambda c: c.estimate.step_seconds)
    budget = fastest.estimate.peak_bytes - 1
    retried = _less_prefetch(prepared, config, choices, budget)
    assert retried and all(c.changes["prefetch_bytes"] == 1 for c in retried)
    assert {c.changes["remat"] for c in retried} >= {fastest.changes["remat"]}
    for again in retried:
        before = next(
            c for c in choices if c.changes == {k: v for k, v in again.changes.items() if k != "prefetch_bytes"}
        )
        assert again.estimate.peak_bytes <= before.estimate.peak_bytes
    assert not _less_prefetch(prepared, config.replace(prefetch_bytes=2**20), choices, budget)


def test_an_impossible_budget_is_refused_before_anything_changes(peaks):
    model, opt, batches = setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    planned = zgraph.distribute(zgraph.Config(backend="eager", memory_budget=peaks["full"] - 1))(step)
    with pytest.raises(zgraph.MemoryBudgetError, match=f"at least {peaks['full'] / MiB:.1f} MiB") as error:
        planned(model, opt, *batches[0])
    assert "remat='full'" in str(error.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in model.parameters())
    assert planned.memory_plan is None


def test_a_budgeted_step_fits_and_trains_as_without_a_budget(peaks):
    """One process: a budget between the selective and full peaks makes the step recompute some blocks whole; its
    measured peak is within the budget, and it trains bitwise as the step without one."""
    budget = (peaks["selective"] + peaks["full"]) // 2
    got = train(zgraph.Config(backend="eager", memory_budget=budget))
    want = train(zgraph.Config(backend="eager"))
    remat = got["chosen"]["remat"]  # full remat on as few blocks as fit, a lighter policy on the others
    assert set(got["chosen"]) == {"remat"} and "full" in remat.values() and set(remat.values()) != {"full"}, remat
    assert got["peak"] <= budget, (got["peak"], budget)
    assert abs(got["peak"] - got["estimated_peak"]) <= 0.02 * got["estimated_peak"]
    assert all(torch.equal(a, b) for a, b in zip(got["losses"], want["losses"]))
    assert all(torch.equal(got["params"][k], v) for k, v in want["params"].items())
    assert "memory plan" in got["explain"] and "remat={'full': " in got["explain"]


def test_estimate_of_a_budgeted_step_is_its_plan(peaks):
    model, opt, batches = setup()
    budget = (peaks["selective"] + peaks["full"]) // 2
    planned = zgraph.distribute(zgraph.Config(backend="eager", memory_budget=budget))(step)
    estimate = planned.estimate(model, opt, *batches[0])  # of the planned config: full remat on some blocks only
    assert peaks["full"] < estimate.peak_bytes <= budget


def test_two_ranks_at_stage_3_with_nvme_offload_to_choose_from(tmp_path):
    """Two ranks, stage 3, ``offload_dir`` set: the plan may offload optimizer states and parameter shards to NVMe
    files too. Under a budget below the no-remat peak each rank's measured peak fits, and training is bitwise
    as without a budget."""
    from dist_harness import run_ranks

    model, opt, batches = setup(0, 2, layers=2)  # two blocks: a smaller graph for each of the 72 combinations
    config = zgraph.Config(stage=3, backend="eager", param_persistence_threshold=0, offload_dir=str(tmp_path))
    budget = int(0.8 * zgraph.distribute(config)(step).estimate(model, opt, *batches[0], world_size=2).peak_bytes)
    out = tmp_path / "results.pt"
    run_ranks(2, "budget_cases.run", str(out), 3, budget, 2, timeout=600)
    results = torch.load(out, weights_only=False)
    planned, plain = results["planned"], results["plain"]
    assert planned["chosen"] not in (None, {"remat": None}), "the plan must change something to fit"
    assert all(peak <= budget for peak in results["peaks"]), (results["peaks"], budget)
    assert all(torch.equal(a, b) for a, b in zip(planned["losses"], plain["losses"]))
    assert all(torch.equal(planned["params"][k], v) for k, v in plain["params"].items())


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> subprocess.CompletedProcess:
    return cli_runner.here(capsys, "estimate", "--model", "gpt-bench", "--world", "2", *argv)


def test_cli_prints_the_plan_for_a_budget(capsys):
    done = _cli(capsys, "--micro-batch", "8", "--budget", "100MiB", "--plan", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)["plan"]
    remat = plan["changes"]["remat"]  # a policy on every block, or on as few blocks as fit
    policies = set(remat.values()) if isinstance(remat, dict) else {remat}
    assert plan["peak_bytes"] <= 100 * MiB and policies & {"selective", "full"}, remat


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["--plan"], "--plan needs --budget"), (["--budget", "1MiB", "--plan"], "cannot be met: the smallest estimated")],
)
def test_cli_plan_refusals_are_one_line(capsys, argv, says):
    done = _cli(capsys, *argv)
    assert done.returncode == 1 and not done.stdout
    assert done.stderr.strip().splitlines()[-1].startswith("zgraph estimate: ") and says in done.stderr, done.stderr


def _budgeted_lengths(config: zgraph.Config, lengths: list[int], mark_max: int | None = None) -> dict[str, Any]:
    """Calls at these sequence lengths under ``config`` and eager alike (the global generator seeded alike before
    each): the losses, the plan's choice and the warnings after each call, and whether the parameters end equal."""
    model, opt, _ = setup(layers=2)
    reference, ref_opt, _ = setup(layers=2)
    compiled = zgraph.distribute(config)(step)
    g = torch.Generator().manual_seed(3)
    out: dict[str, Any] = {"chosen": [], "warnings": [], "equal": []}
    for call, length in enumerate(lengths):
        x, y = torch.randn(16, length, 8, generator=g), torch.randint(0, 5, (16,), generator=g)
        if mark_max is not None:
            zgraph.mark_dynamic(x, 1, max=mark_max)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(call)
            loss = compiled(model, opt, x, y)
        torch.manual_seed(call)
        out["equal"].append(torch.equal(loss, step(reference, ref_opt, x, y)))
        out["chosen"].append(compiled.memory_plan.chosen.changes)
        out["warnings"].append([str(w.message) for w in caught if "memory plan" in str(w.message)])
    out["equal"].append(all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters())))
    return out


def test_a_larger_call_is_planned_again_and_a_marked_max_is_planned_for_at_once():
    """Sizes that change under a budget: the plan is for the largest sizes so far. A call longer than every earlier
    one is planned again, with a warning naming the dim (here it now needs recomputation); a shorter one is not. A
    dim marked with ``max=`` is planned for that max from the first call, and never again. Every step equals eager."""
    model, opt, _ = setup(layers=2)
    x, y = torch.randn(16, 16, 8), torch.randint(0, 5, (16,))
    short = zgraph.distribute(zgraph.Config(backend="eager"))(step).estimate(model, opt, x, y)
    config = zgraph.Config(backend="eager", memory_budget=int(short.peak_bytes * 1.2))
    grown = _budgeted_lengths(config, [16, 32, 24])
    assert all(grown["equal"]), grown["equal"]
    assert grown["chosen"][0] == {"remat": None} and grown["chosen"][1]["remat"] is not None, grown["chosen"]
    assert grown["chosen"][2] == grown["chosen"][1]
    assert grown["warnings"][0] == [] and grown["warnings"][2] == [], grown["warnings"]
    assert len(grown["warnings"][1]) == 1 and "`x` dim 1: 32 > 16" in grown["warnings"][1][0]
    marked = _budgeted_lengths(config, [16, 32, 24], mark_max=32)
    assert all(marked["equal"]) and marked["chosen"] == [grown["chosen"][1]] * 3, marked["chosen"]
    assert marked["warnings"] == [[], [], []]
