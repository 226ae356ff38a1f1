"""Every ``torch.optim`` optimizer in a zgraph step (issue 40, item 3).

Before, Adafactor, RAdam and ASGD failed with a ``CaptureError``: their ``step()`` branches in Python on the step
count (RAdam's ``rho_t > 5``, ASGD's ``max(1, step - t0)`` and ``mu != 1``) or on a parameter's norm (Adafactor's
``max(eps2, RMS(param))``). The other classes traced, but with their hyper-parameters as constants: a changed ``lr``
captured the step again. Now every numeric hyper-parameter of a ``torch.optim`` class is a graph input, a branch on
a value the host knows before the call (a hyper-parameter, a step counter) is a guard checked before each call
(RAdam's step is captured once for ``rho_t <= 5`` and once for the steps after), and Adafactor's ``max`` / ``min``
are graph ops. LBFGS and SparseAdam are refused, naming why, before anything changes.

One process: bitwise equal to eager PyTorch (parameters, gradients, optimizer state and param groups after every
call) with ``lr`` changed before every call and no capture for it, with ``foreach=True`` and Adagrad's
``fused=True``. Two ranks (one rank group, ``torch_optimizer_cases``): every optimizer at stages 0-3 equals DDP on
the same global batches, within DDP's own distance to one process (the yardstick; here both are bitwise).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch_optimizer_cases as cases
from parity import run_parity
from torch import nn

import zgraph

NAMES = list(cases.OPTIMIZERS)
FOREACH = [n for n in NAMES if n != "Muon"]  # Muon has no foreach implementation
CALLS = 6  # RAdam's rho_t passes 5 at its 6th step; ASGD averages from its 4th (t0=2)
# captures of the step over CALLS calls: the first step creates the optimizer's state inside the graph (Adagrad
# creates it in its constructor), then one graph for the later steps, and more where host guards flip (RAdam at
# step 6; ASGD at step 4, where step - t0 passes 1, and at step 5, where mu is no longer 1); none for a new lr
VARIANTS = {name: 2 for name in NAMES} | {"Adagrad": 1, "RAdam": 3, "ASGD": 4}


def _batches(calls: int = CALLS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(calls)]


def _scale_lr(state: tuple) -> None:
    for group in state[1].param_groups:
        group["lr"] *= 0.7


@pytest.mark.parametrize("name", NAMES)
def test_one_process_equals_eager_bitwise_and_a_new_lr_does_not_recapture(name):
    compiled = run_parity(cases.train_step, lambda: cases.make(name), _batches(), between_calls=_scale_lr)
    assert compiled._dispatch.variants() == VARIANTS[name], "a changed lr captured the step again"


@pytest.mark.parametrize("name", FOREACH)
def test_foreach_equals_eager_bitwise(name):
    """torch's multi-tensor implementation, traced as written (its ``_foreach_`` ops on the step counters)."""
    calls = CALLS if name in ("RAdam", "ASGD") else 3
    run_parity(cases.train_step, lambda: cases.make(name, foreach=True), _batches(calls), between_calls=_scale_lr)


def _parts() -> tuple:
    """A model with one small part per optimizer class, each part stepped by its own optimizer (Muon: its 2-D
    parameters): one step graph holds every class. ASGD (``t0=0``) averages from its 3rd step: the host's guards
    choose a third graph there."""
    torch.manual_seed(0)
    model = nn.ModuleDict({name: nn.Linear(8, 4) for name in NAMES})
    make = {**cases.OPTIMIZERS, "ASGD": lambda ps: torch.optim.ASGD(ps, lr=0.05, t0=0, weight_decay=0.01)}
    return model, *(
        make[name]([p for p in model[name].parameters() if name != "Muon" or p.dim() == 2]) for name in NAMES
    )


def _parts_step(model, *rest):
    *opts, x, y = rest
    loss = sum(F.mse_loss(part(x), y) for part in model.values())
    loss.backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return loss.detach()


def _scale_every_lr(state: tuple) -> None:
    for opt in state[1:]:
        for group in opt.param_groups:
            group["lr"] *= 0.7


def _state(state: tuple) -> dict:
    return {"model": state[0].state_dict(), "optim": [opt.state_dict() for opt in state[1:]]}


@pytest.mark.inductor
def test_inductor_compiles_every_class_and_equals_eager(monkeypatch):
    """Their hyper-parameters and step counters are host-known symbols of the graph (a branch on one is a guard
    checked before each call); inductor compiles against them as numbers only the run knows, with no fallback to
    the eager backend. Losses, parameters and optimizer states equal eager's within fp32 rounding (relative to each
    tensor's largest value: centered RMSprop's ``square_avg - grad_avg ** 2`` amplifies it in a few elements), the
    host's guards choose the graph, and a changed ``lr`` does not recapture. Muon's Newton-Schulz iteration runs in
    bfloat16, whose fused intermediates inductor keeps in float32 unless ``emulate_precision_casts``: set here, so
    that its numbers are eager's too. ``CI`` is set, as CI runners set it: inductor then refuses a fallback for an
    op that has a decomposition unless the fallback overrides it (``lerp.Scalar``'s, which branches on its weight,
    is left out of the table)."""
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("CI", "1")
    state, reference = _parts(), _parts()
    step = zgraph.distribute(zgraph.Config(backend="inductor"))(_parts_step)
    with warnings.catch_warnings(record=True) as caught, inductor_config.patch(emulate_precision_casts=True):
        warnings.simplefilter("always")
        for call, (x, y) in enumerate(_batches(4)):
            got = {"loss": step(*state, x, y), **_state(state)}
            want = {"loss": _parts_step(*reference, x, y), **_state(reference)}
            distance = _distance(got, want)
            assert distance <= 1e-5, f"call {call}: {distance:.2e} from eager"
            _scale_every_lr(state)
            _scale_every_lr(reference)
    assert not [str(w.message) for w in caught if "inductor" in str(w.message)]
    assert "final (inductor)" in step.explain()  # compiled, not fallen back to the eager backend
    # the first step (it creates the optimizers' states), the second, the steps once ASGD averages (the 4th call
    # reuses it): none for a new lr
    assert step._dispatch.variants() == 3, "a changed lr captured the step again"


def test_fused_adagrad_equals_eager_bitwise():
    """torch's fused Adagrad kernel in the graph. It takes its hyper-parameters as floats: they are fixed to their
    values by guards (a change captures again), the numbers are the kernel's."""
    run_parity(cases.train_step, lambda: cases.make("Adagrad", fused=True), _batches(3))


@pytest.mark.parametrize("name", list(cases.REFUSED))
def test_refused_optimizers_leave_everything_as_it_was(name):
    model, opt = cases.make(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = zgraph.distribute(backend="eager")(cases.train_step)
    with pytest.raises(zgraph.CaptureError, match=rf"does not support the optimizer .*{name}"):
        step(model, opt, *_batches(1)[0])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not opt.state
    assert not step._dispatch.cache


class NormClipped(torch.optim.Optimizer):
    """SGD that skips a parameter whose gradient norm exceeds 1: a branch on a value only the device knows."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad.norm() < 1:  # the branch zgraph cannot capture
                    p.add_(p.grad, alpha=-group["lr"])


def test_a_branch_on_a_device_value_names_the_line_and_the_tensor_form():
    model, _ = cases.make("Adagrad")
    opt = NormClipped(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = zgraph.distribute(backend="eager")(cases.train_step)
    with pytest.raises(zgraph.CaptureError) as error:
        step(model, opt, *_batches(1)[0])
    message = str(error.value)
    assert re.search(r"test_torch_optimizers\.py:\d+ \(step\): `if p\.grad\.norm\(\) < 1:", message), message
    assert "step counters" in message and "torch.where" in message, message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not opt.state


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The rank group: every optimizer with DDP and zgraph at stages 0-3, the refusals at stage 3, Adafactor's
    checkpoint at stage 3."""
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("torch_optimizers") / "results.pt"
    run_ranks(2, "torch_optimizer_cases.run", str(path), ["stages", "refusals", "adafactor_checkpoint"], timeout=600)
    return torch.load(path, weights_only=False)


def _tensors(value: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _tensors(item, f"{prefix}.{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _tensors(item, f"{prefix}[{i}]").items()}
    return {}


def _distance(got: dict, want: dict) -> float:
    """The largest difference of any tensor of ``got`` from ``want``'s, relative to the largest value of it."""
    a, b = _tensors(got), _tensors(want)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(
        ((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12)).item()
        for k in b
        if b[k].numel()
    )


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_equal_ddp_at_every_stage(ranks, name):
    results = ranks["stages"]
    assert "error" not in results, results.get("error")
    ddp = results[name]["ddp"]
    yardstick = _distance(ddp, cases.eager(name))  # DDP's own distance to one process on the global batch
    for stage in range(4):
        got = results[name][stage]
        assert got["optim"]["param_groups"] == ddp["optim"]["param_groups"]
        distance = _distance(got, ddp)
        assert distance <= max(2 * yardstick, 1e-6), f"{name} at stage {stage}: {distance:.2e} from DDP"


def test_two_ranks_refuse_lbfgs_and_sparse_adam_at_stage_3_before_sharding(ranks):
    results = ranks["refusals"]
    assert "error" not in results, results.get("error")
    for got in results.values():
        assert got["message"] and "does not support the optimizer" in got["message"], got
        assert got["unchanged"] and got["plain"] and got["same_params"] and got["no_state"], got
    assert "LBFGS.step(closure)" in results["LBFGS"]["message"]
    assert "sparse gradient" in results["SparseAdam"]["message"]


def test_two_ranks_adafactor_factored_state_checkpoints_at_stage_3(ranks):
    """Adafactor's row and column states are kept whole at stages 1-3 (they are not the parameter's shape): saved
    and loaded with the rest, a resumed step equals the uninterrupted one."""
    got = ranks["adafactor_checkpoint"]
    assert "error" not in got, got.get("error")
    assert _distance(got["loaded"], got["saved"]) == 0.0
    assert _distance(got["after_loaded"], got["after"]) == 0.0
    state = got["saved"][1]["state"][0]
    assert state["row_var"].shape == (16, 1) and state["col_var"].shape == (1, 8)
