"""Optimizer wrappers (issue 28, part 5): a ``torch.optim.Optimizer`` subclass that forwards ``state`` and
``param_groups`` to the optimizer inside it (accelerate's ``AcceleratedOptimizer``, Lightning's
``LightningOptimizer``) is the optimizer it wraps: a zgraph step doing the whole update through it matches eager
PyTorch with the plain optimizer, bit for bit in one process and within float reduction noise on 2 ranks, and
zgraph.save / load and full_state_dict go through it. An optimizer zgraph cannot read is a ``CaptureError``
naming its class, never a bare ``KeyError`` (before, the first call failed with ``KeyError: 'step'``)."""

from __future__ import annotations

import copy

import optimizer_wrapper_cases as cases
import pytest
import torch
from optimizer_wrapper_cases import OwnState, make, train_step
from parity import assert_close, compare_states

import zgraph
from zgraph.errors import CaptureError
from zgraph.runtime.optimizers import unwrap_optimizer
from zgraph.runtime.state import Binding


def accelerated(inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """accelerate's own wrapper, as ``Accelerator.prepare`` hands it to a training loop."""
    accelerate = pytest.importorskip("accelerate")
    return accelerate.Accelerator(cpu=True).prepare_optimizer(inner, device_placement=False)


WRAPPERS = {**cases.WRAPPERS, "accelerate": accelerated}
# accelerate comes with the hf extra: its case runs in .ci/run's `-m hf` pass
NAMES = [pytest.param(n, marks=pytest.mark.hf) if n == "accelerate" else n for n in WRAPPERS]


def _train(stage: int, wrap) -> tuple:
    """Train through the wrapper with zgraph and, on a copy, eagerly with the plain AdamW, comparing the loss,
    parameters, gradients and optimizer state after every call; returns the zgraph state."""
    model, opt = make(wrap)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=cases.LR)
    step = zgraph.distribute(zgraph.Config(stage=stage, backend="eager"))(train_step)
    for call, (x, y) in enumerate(cases.batches(5)):
        got, want = step(model, opt, x, y), train_step(reference, ref_opt, x, y)
        assert_close(got, want, bitwise=True, what=f"call {call}: loss")
        compare_states((model, opt), (reference, ref_opt), bitwise=True, what=f"call {call}")
    assert unwrap_optimizer(opt).state, "the wrapped optimizer holds the state"
    return model, opt


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("name", NAMES)
def test_wrapper_matches_eager(name, stage):
    _train(stage, WRAPPERS[name])


@pytest.mark.parametrize("name", NAMES)
def test_save_load_through_the_wrapper(tmp_path, name):
    """A checkpoint saved through the wrapper loads through a fresh wrapper and, for a wrapper zgraph unwraps
    without a step (its optimizer under ``optimizer`` / ``_optimizer``), into the plain optimizer: the checkpoint
    holds the wrapped optimizer's class."""
    model, opt = _train(3, WRAPPERS[name])
    zgraph.save(tmp_path / "ck", model, opt)
    saved_model, saved_optim = zgraph.full_state_dict(model, opt)
    assert saved_optim["state"], "full_state_dict reads the wrapped optimizer's state"
    for wrap in (WRAPPERS[name], None) if unwrap_optimizer(opt) is not opt else (WRAPPERS[name],):
        fresh, fresh_opt = make(wrap)
        zgraph.load(tmp_path / "ck", fresh, fresh_opt)
        loaded_model, loaded_optim = zgraph.full_state_dict(fresh, fresh_opt)
        assert_close(loaded_model, saved_model, bitwise=True, what=f"model loaded through {wrap}")
        assert_close(loaded_optim, saved_optim, bitwise=True, what=f"optimizer loaded through {wrap}")


def test_wrapper_and_the_optimizer_it_wraps_are_one():
    """A step that reaches both the wrapper and the optimizer inside it binds one optimizer."""
    model, opt = make(cases.Forwarding)
    inner = opt.optimizer

    def both(model, x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        inner.zero_grad()
        return loss.detach()

    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=cases.LR)
    step = zgraph.distribute(zgraph.Config(stage=0, backend="eager"))(both)
    for x, y in cases.batches():
        assert_close(step(model, x, y), train_step(reference, ref_opt, x, y), bitwise=True, what="loss")
    compare_states((model, inner), (reference, ref_opt), bitwise=True, what="after 3 calls")


@pytest.mark.parametrize("stage", [0, 3])
def test_wrapper_with_its_own_state_is_refused(stage):
    model, opt = make(OwnState)
    step = zgraph.distribute(zgraph.Config(stage=stage, backend="eager"))(train_step)
    x, y = cases.batches(1)[0]
    with pytest.raises(CaptureError, match=r"OwnState.*`state` is not the wrapped optimizer's"):
        step(model, opt, x, y)


def test_unreadable_state_is_a_capture_error_naming_the_class():
    """Optimizer state a graph reads that is not in ``optimizer.state`` names the optimizer, not a KeyError."""
    model, opt = make()
    binding = Binding([("model", model)], [("opt", opt)])
    with pytest.raises(CaptureError, match=r"'opt' \(torch\.optim\.adamw\.AdamW\).*'exp_avg' of parameter 0\.weight"):
        binding.optimizer_state_value(0, 0, "exp_avg")


# --------------------------------------------------------------------------------------------- 2 ranks
def test_wrappers_on_two_ranks_match_eager(tmp_path):
    """Every wrapper at stages 0-3 on 2 ranks: the mean loss, the whole parameters and the optimizer state match
    eager PyTorch with the plain AdamW on the global batch (to float reduction order)."""
    from dist_harness import run_ranks

    path = tmp_path / "results.pt"
    run_ranks(2, "optimizer_wrapper_cases.run", str(path), ["stages"], timeout=300)
    results = torch.load(path, weights_only=False)["stages"]
    assert "error" not in results, results.get("error")
    want = cases.eager()
    for (name, stage), got in results.items():
        what = f"{name} at stage {stage}"
        assert_close(got["losses"], want["losses"], bitwise=False, rtol=1e-5, what=f"{what}: losses")
        assert_close(got["model"], want["model"], bitwise=False, rtol=1e-5, what=f"{what}: parameters")
        assert_close(got["optim"], want["optim"], bitwise=False, rtol=1e-5, what=f"{what}: optimizer state")
    assert set(results) == {(name, stage) for name in cases.WRAPPERS for stage in range(4)}


def test_scheduler_on_the_wrapper():
    """An LR scheduler built on the wrapper and stepped in the step after the update, as in eager PyTorch."""
    model, opt = make(cases.Forwarding)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=cases.LR)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)

    def with_scheduler(model, opt, scheduler, x, y):
        loss = train_step(model, opt, x, y)
        scheduler.step()
        return loss

    step = zgraph.distribute(zgraph.Config(stage=0, backend="eager"))(with_scheduler)
    for call, (x, y) in enumerate(cases.batches()):
        got, want = step(model, opt, scheduler, x, y), with_scheduler(reference, ref_opt, ref_scheduler, x, y)
        assert_close(got, want, bitwise=True, what=f"call {call}: loss")
        compare_states((model, opt), (reference, ref_opt), bitwise=True, what=f"call {call}")
