"""Single-process parity of the decorated step with eager PyTorch (foundation issue, acceptance list 7).

Each test runs the step 5 times through zgraph (eager backend unless stated) and eagerly on deep copies, and
compares returned values, parameters, buffers, ``.grad`` and optimizer state after every call. The graph runs
the same aten ops as eager (the optimizer kernels mirror torch.optim op for op), so the comparison is bitwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from parity import run_parity
from torch import nn

import zgraph


def mlp(seed: int = 0, d_in: int = 8, d_out: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, d_out))


def batches(n: int = 5, batch: int = 6, d_in: int = 8, classes: int = 4, seed: int = 1) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]


def standard_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_scalar_backward_adamw():
    run_parity(standard_step, lambda: _with_opt(mlp(), torch.optim.AdamW, lr=1e-2), batches())


def _with_opt(model: nn.Module, cls: type, **kw) -> tuple:
    return model, cls(model.parameters(), **kw)


def test_loss_function_defined_outside_model():
    def loss_fn(logits, y):
        return F.mse_loss(logits.softmax(-1), F.one_hot(y, 4).float()) + 0.1 * logits.pow(2).mean()

    def step(model, opt, x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run_parity(step, lambda: _with_opt(mlp(), torch.optim.Adam, lr=1e-2), batches())


def test_two_models_one_combined_loss():
    def make():
        enc, head = mlp(0, 8, 8), mlp(1, 8, 4)
        opt = torch.optim.AdamW(list(enc.parameters()) + list(head.parameters()), lr=1e-2)
        return enc, head, opt

    def step(enc, head, opt, x, y):
        z = enc(x)
        loss = F.cross_entropy(head(z), y) + 0.01 * z.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, z.detach()

    run_parity(step, make, batches())


def test_nonscalar_backward_with_gradient_argument():
    def step(model, opt, x, g):
        out = model(x)
        out.backward(gradient=g)
        opt.step()
        opt.zero_grad()
        return out.detach()

    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(5)]
    run_parity(step, lambda: _with_opt(mlp(), torch.optim.SGD, lr=0.1), data)


def test_two_backward_calls_accumulate_into_grad():
    def step(model, opt, x, y):
        half = x.shape[0] // 2
        loss1 = F.cross_entropy(model(x[:half]), y[:half])
        loss1.backward()
        loss2 = F.cross_entropy(model(x[half:]), y[half:])
        loss2.backward()
        opt.step()
        opt.zero_grad()
        return loss1 + loss2

    run_parity(step, lambda: _with_opt(mlp(), torch.optim.Adam, lr=1e-2), batches())


def test_autograd_grad_and_manual_grads():
    def step(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        params = [p for p in model.parameters()]
        grads = torch.autograd.grad(loss, params)
        for p, g in zip(params, grads):
            p.grad = g * 0.5
        opt.step()
        opt.zero_grad()
        return loss

    run_parity(step, lambda: _with_opt(mlp(), torch.optim.SGD, lr=0.1, momentum=0.9), batches())


def test_frozen_parameters():
    def make():
        model = mlp()
        model[0].weight.requires_grad_(False)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    run_parity(standard_step, make, batches())


def test_batchnorm_running_stats():
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    run_parity(standard_step, make, batches())


def test_sgd_with_momentum():
    run_parity(
        standard_step,
        lambda: _with_opt(mlp(), torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
        batches(),
    )


def _two_groups(cls: type, **kw):
    def make():
        model = mlp()
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        return model, cls(groups, **kw)

    return make


def test_adam_defaults_and_two_param_groups():
    run_parity(standard_step, lambda: _with_opt(mlp(), torch.optim.Adam), batches())
    run_parity(standard_step, _two_groups(torch.optim.Adam, lr=1e-2), batches())


def test_adamw_defaults_and_two_param_groups():
    run_parity(standard_step, lambda: _with_opt(mlp(), torch.optim.AdamW), batches())
    run_parity(standard_step, _two_groups(torch.optim.AdamW, lr=1e-2, amsgrad=True), batches())


def test_sgd_defaults_and_two_param_groups():
    run_parity(standard_step, lambda: _with_opt(mlp(), torch.optim.SGD, lr=0.05), batches())
    run_parity(standard_step, _two_groups(torch.optim.SGD, lr=0.05, momentum=0.5), batches())


def _bf16_batches() -> list[tuple]:
    return [(x.bfloat16(), y) for x, y in batches()]


@pytest.mark.parametrize(
    "cls, kw",
    [
        (torch.optim.AdamW, {"lr": 1e-2}),
        (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
        (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
    ],
    ids=["adamw", "adam", "sgd", "adamw-fused"],
)
def test_bf16_model_updates_as_eager_does(cls, kw):
    """Regression: a bf16 model (no precision config) was updated through float32 copies rounded once, the
    arithmetic of fused optimizers, where eager's single-tensor step computes in bf16 op by op; now bitwise eager
    (a ``fused=True`` optimizer keeps the float32 arithmetic, which is eager's too)."""
    run_parity(standard_step, lambda: _with_opt(mlp().bfloat16(), cls, **kw), _bf16_batches())


def test_lr_scheduler_between_calls_takes_effect_without_retrace():
    def make():
        model, opt = _with_opt(mlp(), torch.optim.AdamW, lr=1e-2)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(model, opt, scheduler, x, y):
        return standard_step(model, opt, x, y)

    compiled = run_parity(step, make, batches(), between_calls=lambda state: state[2].step())
    assert len(compiled._dispatch.cache) == 1, "an LR change must not retrace"


def _schedulers() -> dict[str, Callable]:
    return {
        "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (1 + i)),
        "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10),
        "warmup_then_cosine": lambda opt: torch.optim.lr_scheduler.SequentialLR(
            opt,
            [
                torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2),
                torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
            ],
            milestones=[2],
        ),
    }


@pytest.mark.parametrize("name", sorted(_schedulers()))
def test_lr_scheduler_stepped_inside_the_step(name):
    """``scheduler.step()`` after ``opt.step()`` inside the step, as training loops write it: the scheduler runs
    eagerly after the graph on every call, the next call's graph reads the new learning rate (and OneCycle's
    betas), and nothing retraces."""

    def make():
        model, opt = _with_opt(mlp(), torch.optim.AdamW, lr=1e-2)
        return model, opt, _schedulers()[name](opt)

    def step(model, opt, scheduler, x, y):
        loss = standard_step(model, opt, x, y)
        scheduler.step()
        return loss

    lrs = []
    compiled = run_parity(step, make, batches(), between_calls=lambda state: lrs.append(_hparams(state[1])))
    assert lrs[0::2] == lrs[1::2], "learning rates and betas follow eager's"
    assert len(set(map(str, lrs))) > 1, "the schedule changed the learning rate"
    assert len(compiled._dispatch.cache) == 1


def _hparams(opt: torch.optim.Optimizer) -> list:
    return [(g["lr"], g["betas"]) for g in opt.param_groups]


def test_lr_scheduler_stepped_before_the_optimizer_takes_effect_in_the_same_call():
    def make():
        model, opt = _with_opt(mlp(), torch.optim.SGD, lr=0.1, momentum=0.9)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(model, opt, scheduler, x, y):
        scheduler.step()  # unusual order (torch warns), but eager semantics must hold
        return standard_step(model, opt, x, y)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's warning about the order, on both sides
        run_parity(step, make, batches())


def test_lr_scheduler_steps_that_cannot_be_replayed_raise():
    model, opt = _with_opt(mlp(), torch.optim.SGD, lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    x, y = next(iter(batches()))

    def on_plateau(model, opt, x, y):
        loss = standard_step(model, opt, x, y)
        plateau.step(loss)
        return loss

    with pytest.raises(zgraph.CaptureError, match="ReduceLROnPlateau.step\\(\\) with arguments"):
        zgraph.distribute(backend="eager")(on_plateau)(model, opt, x, y)

    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)

    def between_updates(model, opt, x, y):
        standard_step(model, opt, x, y)
        scheduler.step()
        return standard_step(model, opt, x, y)

    with pytest.raises(zgraph.CaptureError, match="between two step\\(\\) calls of its optimizer"):
        zgraph.distribute(backend="eager")(between_updates)(model, opt, x, y)


def test_hyperparameters_are_graph_inputs_not_constants():
    def between(state):
        group = state[1].param_groups[0]
        group["lr"] *= 0.7
        group["weight_decay"] += 0.05
        group["betas"] = (group["betas"][0] - 0.01, group["betas"][1])
        group["eps"] *= 2

    compiled = run_parity(
        standard_step, lambda: _with_opt(mlp(), torch.optim.AdamW, lr=1e-2), batches(), between_calls=between
    )
    assert len(compiled._dispatch.cache) == 1
    hparams = [n for n in compiled.graphs["final"].graph.nodes if n.op == "placeholder" and "group0" in n.name]
    assert {n.meta["zgraph_input"].field for n in hparams} == {"lr", "beta1", "beta2", "eps", "weight_decay"}


def test_step_leaves_grad_populated():
    def step(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    run_parity(step, lambda: _with_opt(mlp(), torch.optim.SGD, lr=0.1), batches())


def test_zero_grad_without_set_to_none():
    def step(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    run_parity(step, lambda: _with_opt(mlp(), torch.optim.Adam, lr=1e-2), batches())


def test_new_batch_shape_retraces_and_stays_correct():
    data = batches(2, batch=6) + batches(2, batch=3, seed=5) + batches(1, batch=6, seed=6)
    compiled = run_parity(standard_step, lambda: _with_opt(mlp(), torch.optim.AdamW, lr=1e-2), data)
    assert len(compiled._dispatch.cache) == 2


def test_small_gpt_adamw():
    from zgraph.demos.models import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(vocab=64, d_model=32, layers=2, heads=2, seq=16, tie_weights=True)

    def make():
        torch.manual_seed(0)
        model = GPT(cfg)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model, opt, idx, tgt):
        loss = lm_loss(model(idx), tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)) for _ in range(5)]
    run_parity(step, make, data)


@pytest.mark.inductor
def test_inductor_backend_matches_eager():
    """Inductor fuses and reorders float math: equal to eager within 1e-5 relative after 5 AdamW steps."""
    run_parity(
        standard_step,
        lambda: _with_opt(mlp(), torch.optim.AdamW, lr=1e-2),
        batches(),
        config=zgraph.Config(backend="inductor"),
        bitwise=False,
        rtol=1e-5,
    )


class Stack(nn.Module):
    """Ten small linear layers (one parameter group each), a dropout on a transposed activation and an
    ``add(x, mm, alpha=0.5)`` of the user's own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(10))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 4:
                x = F.dropout(x.t(), 0.2).t()
            if i == 7:
                x = x.add(x @ layer.weight, alpha=0.5)
        return self.head(x)


def _every_optimizer_variant() -> tuple:
    model = Stack()
    layers = [list(layer.parameters()) for layer in model.layers]
    sgd = torch.optim.SGD(
        [
            {"params": layers[0]},
            {"params": layers[1], "momentum": 0.9, "dampening": 0.1},
            {"params": layers[2], "momentum": 0.9, "nesterov": True},
            {"params": layers[3], "weight_decay": 0.1},
            {"params": layers[4], "momentum": 0.5, "maximize": True},
        ],
        lr=0.05,
    )
    adam = torch.optim.Adam(
        [{"params": layers[5]}, {"params": layers[6], "weight_decay": 0.1}, {"params": layers[7], "amsgrad": True}],
        lr=1e-2,
    )
    adamw = torch.optim.AdamW(
        [
            {"params": layers[8]},
            {"params": [*layers[9], *model.head.parameters()], "weight_decay": 0.1, "amsgrad": True},
        ],
        lr=1e-2,
    )
    return model, sgd, adam, adamw


@pytest.mark.inductor
def test_inductor_optimizer_updates_and_random_numbers_match_eager():
    """Regressions: inductor fused add(x, mm(..), alpha=a) into addmm and dropped alpha (the optimizers'
    param.add_(grad, alpha=-lr): plain SGD moved by +grad, coupled weight decay was lost; and a user's own
    alpha), and drew random numbers with its own generator. One compile: SGD (plain, momentum with dampening,
    nesterov, weight decay, maximize), Adam (plain, weight decay, amsgrad), AdamW (default, weight decay with
    amsgrad), noise, a random mask and dropout; the generator is seeded alike before both runs. Within fp32
    rounding of eager after 3 steps."""

    def step(model, sgd, adam, adamw, x, y):
        x = x + 0.1 * torch.randn_like(x)
        keep = (torch.rand(x.shape[0]) > 0.2).float()
        loss = (F.cross_entropy(model(x), y, reduction="none") * keep).mean()
        loss.backward()
        for opt in (sgd, adam, adamw):
            opt.step()
            opt.zero_grad()
        return loss

    compiled = run_parity(
        step,
        _every_optimizer_variant,
        batches(3),
        config=zgraph.Config(backend="inductor"),
        bitwise=False,
        rtol=1e-6,
        seed=30,
    )
    assert "final (inductor)" in compiled.explain()  # compiled, not fallen back to the eager backend


def test_lstm_step_replays_with_the_kernels_backward_state():
    """Regression: mkldnn's LSTM keeps its backward workspace only with grad mode on; the graph must replay
    with the grad mode it was traced with."""

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.rnn = nn.LSTM(8, 16, batch_first=True)
            self.out = nn.Linear(16, 4)

        def forward(self, x):
            return self.out(self.rnn(x.unsqueeze(1).repeat(1, 5, 1))[0][:, -1])

    run_parity(standard_step, lambda: _with_opt(Recurrent(), torch.optim.Adam, lr=1e-2), batches())


def test_inductor_failure_falls_back_to_eager_with_a_warning(monkeypatch):
    import torch._inductor.compile_fx as inductor

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(inductor, "compile_fx", broken)
    with pytest.warns(RuntimeWarning, match="inductor could not compile.*no C\\+\\+ compiler"):
        compiled = run_parity(
            standard_step,
            lambda: _with_opt(mlp(), torch.optim.AdamW, lr=1e-2),
            batches(2),
            config=zgraph.Config(backend="inductor"),
        )
    assert "final (eager)" in compiled.explain()
