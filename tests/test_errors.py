"""Bad input gets a clear error before any work (foundation issue, acceptance list 8)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import zgraph


def _model_opt():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_data_dependent_branch_names_the_call_and_the_source_line():
    @zgraph.distribute(backend="eager")
    def step(model, opt, x):
        loss = model(x).pow(2).mean()
        if loss.item() > 1:  # the offending line
            loss = loss * 2
        loss.backward()
        opt.step()
        return loss

    model, opt = _model_opt()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(zgraph.CaptureError) as info:
        step(model, opt, torch.randn(3, 4))
    message = str(info.value)
    assert "depends on the value of a tensor" in message
    assert "test_errors.py" in message and "if loss.item() > 1:" in message
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), "a failed capture must not change the model"
    assert model.weight.grad is None


def test_grad_scaler_points_to_zgraph_loss_scaling():
    scaler = torch.amp.GradScaler("cpu")

    @zgraph.distribute(backend="eager")
    def step(model, opt, x):
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    model, opt = _model_opt()
    with pytest.raises(zgraph.CaptureError, match="GradScaler") as info:
        step(model, opt, torch.randn(3, 4))
    assert 'loss_scale="dynamic"' in str(info.value) and "scaler.step(opt)" in str(info.value)


def test_untraceable_optimizer_is_named():
    class ThresholdSGD(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad.abs().max().item() > 0.5:  # data-dependent: cannot be traced
                        p.data.add_(p.grad, alpha=-group["lr"])

    model = nn.Linear(4, 2)
    opt = ThresholdSGD(model.parameters())

    @zgraph.distribute(backend="eager")
    def step(model, opt, x):
        model(x).sum().backward()
        opt.step()

    with pytest.raises(zgraph.CaptureError, match="ThresholdSGD"):
        step(model, opt, torch.randn(3, 4))


def test_optimizer_step_with_closure_is_rejected_clearly():
    model = nn.Linear(4, 2)
    opt = torch.optim.LBFGS(model.parameters())

    @zgraph.distribute(backend="eager")
    def step(model, opt, x):
        def closure():
            opt.zero_grad()
            loss = model(x).sum()
            loss.backward()
            return loss

        return opt.step(closure)

    with pytest.raises(zgraph.CaptureError, match=r"LBFGS\.step\(closure\)"):
        step(model, opt, torch.randn(3, 4))


def test_other_plain_optimizers_are_traced_as_written():
    """RMSprop is not a registered kernel: its own step() is traced (hyper-parameters guarded by value)."""
    from parity import run_parity

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        return model, torch.optim.RMSprop(model.parameters(), lr=1e-2, momentum=0.5)

    def step(model, opt, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    g = torch.Generator().manual_seed(0)
    run_parity(step, make, [(torch.randn(5, 4, generator=g),) for _ in range(5)])


def test_pure_tensor_step_without_module():
    def step(w, x):
        loss = (x @ w).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
        w.grad = None
        return loss

    compiled = zgraph.distribute(backend="eager")(step)
    torch.manual_seed(0)
    w = torch.randn(4, 3, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_(True)
    for _ in range(5):
        x = torch.randn(6, 4)
        assert torch.equal(compiled(w, x), step(w_ref, x))
        assert torch.equal(w, w_ref) and w.grad is None


def test_step_without_gradients():
    compiled = zgraph.distribute(backend="eager")(lambda x, y: {"sum": x + y, "n": 3})
    out = compiled(torch.ones(2), torch.arange(2.0))
    assert torch.equal(out["sum"], torch.tensor([1.0, 2.0])) and out["n"] == 3


def test_changing_lr_inside_the_step_is_rejected():
    @zgraph.distribute(backend="eager")
    def step(model, opt, x):
        opt.param_groups[0]["lr"] = 0.01
        model(x).sum().backward()
        opt.step()

    model, opt = _model_opt()
    with pytest.raises(zgraph.CaptureError, match="param_groups"):
        step(model, opt, torch.randn(3, 4))
    assert opt.param_groups[0]["lr"] == 0.1


def test_state_in_closure_and_globals_is_found():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def step(x):
        loss = F.mse_loss(model(x), torch.zeros(3, 2))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    compiled = zgraph.distribute(backend="eager")(step)
    for _ in range(3):
        x = torch.randn(3, 4)
        got = compiled(x)
        loss = F.mse_loss(reference(x), torch.zeros(3, 2))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.equal(got, loss.detach())
    assert torch.equal(model.weight, reference.weight)


# ------------------------------------------------------------------ steps zgraph refuses (issue 16)
class LazyHead(nn.Module):
    """Creates its second layer's weight on the first forward, from the input's width."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.w = None

    def forward(self, x):
        h = self.body(x)
        if self.w is None:
            self.w = nn.Parameter(torch.randn(2, h.shape[-1]))
        return h @ self.w.t()


def test_a_parameter_created_inside_the_step_is_refused_and_the_model_left_as_it_was():
    model = LazyHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @zgraph.distribute(backend="eager")
    def step(model, opt, x):
        model(x).sum().backward()
        opt.step()

    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(zgraph.CaptureError, match=r"created parameter `w`.*before the first call"):
        step(model, opt, torch.randn(3, 4))
    assert model.w is None and "w" not in model._parameters, "the model is as it was"
    assert all(torch.equal(p, before[n]) and not isinstance(p, FakeTensor) for n, p in model.state_dict().items())
    model(torch.randn(3, 4))  # created eagerly: the step now trains it
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, opt, torch.randn(3, 4))


def test_a_submodule_created_inside_the_step_is_refused_with_its_name():
    class Grows(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Module()
            self.inner.linear = nn.Linear(4, 4)

        def forward(self, x):
            if not hasattr(self.inner, "extra"):
                self.inner.extra = nn.Linear(4, 2)
            return self.inner.extra(self.inner.linear(x))

    model = Grows()

    @zgraph.distribute(backend="eager")
    def step(model, x):
        model(x).sum().backward()

    with pytest.raises(zgraph.CaptureError, match=r"created submodule `inner.extra`"):
        step(model, torch.randn(3, 4))
    assert not hasattr(model.inner, "extra")


def test_a_generator_step_is_refused():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @zgraph.distribute(backend="eager")
    def step(model, opt, x):
        loss = model(x).sum()
        loss.backward()
        opt.step()
        yield loss

    before = model.weight.detach().clone()
    with pytest.raises(zgraph.CaptureError, match=r"returned a generator.*instead of `yield`"):
        step(model, opt, torch.randn(3, 4))
    assert torch.equal(model.weight, before)


def test_a_step_calling_another_step_is_refused():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @zgraph.distribute(backend="eager")
    def forward_backward(model, x):
        loss = model(x).sum()
        loss.backward()
        return loss

    @zgraph.distribute(backend="eager")
    def step(model, opt, x):
        loss = forward_backward(model, x)
        opt.step()
        return loss

    with pytest.raises(zgraph.CaptureError, match=r"`.*forward_backward` was called from inside another zgraph step"):
        step(model, opt, torch.randn(3, 4))
    assert all(not isinstance(p, FakeTensor) for p in model.parameters())
