"""An EMA of the weights (``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn``), issue 40 item 4.

Updated inside the step, ``update_parameters`` branches on ``n_averaged == 0``: a 0-d integer buffer, a *host
counter* whose value the host knows before each call (``zgraph.capture.host_scalars``: the branch is a guard), so
the step is captured once for the first call (which copies the weights) and once for every later call (which
averages). Before, the branch was a ``CaptureError``. On 2 ranks at
stages 0-3, inside the step and outside it (eagerly after each call), the model and the EMA after 3 steps equal
eager PyTorch on the global batch within a bound relative to each tensor's scale (the ranks average per-rank
gradients: reduction order differs by a few ulps); at stage 3 the EMA's parameters are shards, whole in
``zgraph.gather``, ``full_state_dict`` and ``save_pretrained``; ``zgraph.save`` / ``load`` of model and EMA resume
to the uninterrupted run. One rank group runs every case.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F
from ema_cases import STAGES, WHERE, batches, build, inside
from ema_cases import eager as eager_run
from safetensors import safe_open
from torch import nn

import zgraph

REL = 1e-6  # max |a - b| <= REL * max |b|: a few ulps of reduction order (tests/test_zero_parity.py's floor)
eager = functools.cache(eager_run)  # the reference: one process, the global batch


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("ema") / "results.pt"
    run_ranks(2, "ema_cases.run", str(path), ["stages", "resume"], timeout=600)
    results = torch.load(path, weights_only=False)
    for name in ("stages", "resume"):
        assert "error" not in results[name], results[name].get("error")
    return results, path.parent


def _assert_near(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, expected in want.items():
        bound = REL * max(expected.abs().max().item(), 1.0)
        diff = (got[key].double() - expected.double()).abs().max().item()
        assert diff <= bound, f"{what} {key}: max |diff| {diff:.3e} > {bound:.1e}"


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("stage", STAGES)
def test_ema_equals_eager_on_the_global_batch(two_ranks, stage, where):
    got, want = two_ranks[0]["stages"][stage, where], eager()
    _assert_near(got["model"], want["model"], "model")
    _assert_near(got["ema"], want["ema"], "ema")
    assert got["ema"]["n_averaged"].item() == 3
    assert got["sharded"] == [stage == 3] * 4, "the EMA is sharded like the model at stage 3, whole below"
    assert got["captures"] == (2 if where == "inside" else 1), "inside: the first update and every later one"


def test_the_sharded_ema_is_updated_on_its_shards(two_ranks):
    """At stage 3 the averaging step gathers the model's parameters for forward and backward, never the EMA's:
    the update reads the model's updated shards."""
    gathered = two_ranks[0]["stages"]["gathered_inputs"]
    assert gathered and not any(name.startswith("ema") for name in gathered), gathered


def test_the_sharded_ema_is_whole_in_gather_and_in_its_export(two_ranks):
    results, directory = two_ranks
    want = eager()["ema"]
    model, ema, _ = build()
    ema.load_state_dict(want)
    with torch.no_grad():
        expected = ema(batches()[0][0])
    torch.testing.assert_close(results["stages"]["gathered_forward"], expected, rtol=1e-5, atol=1e-6)
    with safe_open(os.path.join(directory, "ema_export", "model.safetensors"), "pt") as f:
        exported = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    _assert_near(exported, ema.module.state_dict(), "exported EMA")


def test_a_resumed_run_equals_the_uninterrupted_one(two_ranks):
    results = two_ranks[0]
    uninterrupted = results["stages"][3, "inside"]
    _assert_near(results["resume"]["model"], uninterrupted["model"], "model")
    _assert_near(results["resume"]["ema"], uninterrupted["ema"], "ema")


# ------------------------------------------------------------------------------------------------ one process
def test_ema_in_one_process_is_eagers_bitwise_and_estimates():
    model, ema, opt = build()
    step = zgraph.distribute(zgraph.Config(backend="eager"))(inside)
    estimate = step.estimate(model, ema, opt, *batches()[0], world_size=2)
    assert estimate.model_state_bytes["buffers"] > 0 and ema.n_averaged.item() == 0
    losses = [step(model, ema, opt, x, y) for x, y in batches()]
    reference = build()
    want = [inside(*reference, x, y) for x, y in batches()]
    assert all(torch.equal(a, b) for a, b in zip(losses, want))
    for (key, a), b in zip(ema.state_dict().items(), reference[1].state_dict().values()):
        assert torch.equal(a, b), key
    assert step._dispatch.variants() == 2


class Alternating(nn.Module):
    """Counts its calls in a 0-d integer buffer and negates its output on every second one."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.register_buffer("calls", torch.tensor(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) if self.calls % 2 else -self.linear(x)


def test_any_modules_counter_may_be_branched_on():
    """The branch reads the counter after the step advanced it; each branch is captured once, and checking which
    one a call takes leaves the counter as it is."""

    def step(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def make():
        torch.manual_seed(0)
        model = Alternating()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    x = torch.randn(3, 4)
    compiled = zgraph.distribute(zgraph.Config(backend="eager"))(step)
    model, opt = make()
    got = [compiled(model, opt, x) for _ in range(4)]
    reference = make()
    want = [step(*reference, x) for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert model.calls.item() == 4 and compiled._dispatch.variants() == 2


def test_a_branch_on_a_value_only_the_device_knows_is_still_refused():
    def step(model, ema, opt, x, y):
        loss = F.mse_loss(model(x), y)
        if loss > 1:  # the offending line
            loss = loss / 2
        loss.backward()
        opt.step()
        ema.update_parameters(model)

    model, ema, opt = build()
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    with pytest.raises(zgraph.CaptureError) as info:
        zgraph.distribute(zgraph.Config(backend="eager"))(step)(model, ema, opt, *batches()[0])
    message = str(info.value)
    assert "if loss > 1:" in message and "test_ema.py" in message
    assert "AveragedModel.n_averaged" in message, "the hint names the supported form"
    assert all(torch.equal(before[k], v) for k, v in ema.state_dict().items())
