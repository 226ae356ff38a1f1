"""``zgraph.optimizer_from_deepspeed``: DeepSpeed 0.19.8's optimizer choice and its LR schedules (issue 16)."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

import zgraph

# the schedules are stepped alone here, without optimizer steps
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 0.1, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 40, "warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10}),
    ("WarmupDecayLR", {"total_num_steps": 40, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 10, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 5, "warmup_type": "linear"}),
]


def _lrs(optimizer, scheduler, steps=50):
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in optimizer.param_groups])
        scheduler.step()
    return out


def _ours(kind, params, lr=0.05):
    groups = [{"params": [p]} for p in _params()]
    config = {"optimizer": {"type": "SGD", "params": {"lr": lr}}, "scheduler": {"type": kind, "params": params}}
    return zgraph.optimizer_from_deepspeed(config, groups)


@pytest.mark.parametrize(("kind", "params"), SCHEDULES)
def test_schedules_equal_deepspeeds(kind, params):
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    optimizer, scheduler = _ours(kind, params)
    reference_opt = torch.optim.SGD([{"params": [p]} for p in _params()], lr=0.05)
    reference = getattr(lr_schedules, kind)(reference_opt, **params)
    got, want = _lrs(optimizer, scheduler), _lrs(reference_opt, reference)
    for step, (a, b) in enumerate(zip(got, want)):
        assert all(abs(x - y) <= 1e-12 for x, y in zip(a, b)), (step, a, b)


def test_schedules_by_hand():
    """The same formulas, without DeepSpeed: lr before each optimizer step (DeepSpeed's iteration -1 first)."""
    optimizer, scheduler = _ours("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10,
                                              "warmup_type": "linear"})  # fmt: skip
    lrs = [lr[0] for lr in _lrs(optimizer, scheduler, 13)]
    assert lrs == pytest.approx([0.0, 0.0] + [0.01 * i for i in range(1, 10)] + [0.1, 0.1], abs=1e-15)
    optimizer, scheduler = _ours("WarmupLR", {"warmup_num_steps": 4})  # log warmup to the groups' lr (0.05)
    lrs = [lr[0] for lr in _lrs(optimizer, scheduler, 7)]
    assert lrs == pytest.approx([0.0] + [0.05 * math.log(i + 1) / math.log(4) for i in range(4)] + [0.05, 0.05])
    optimizer, scheduler = _ours("WarmupDecayLR", {"total_num_steps": 6, "warmup_num_steps": 2,
                                                   "warmup_type": "linear"})  # fmt: skip
    lrs = [lr[0] for lr in _lrs(optimizer, scheduler, 9)]
    assert lrs == pytest.approx([0.0, 0.0, 0.0005, 0.001, 0.00075, 0.0005, 0.00025, 0.0, 0.0])
    optimizer, scheduler = _ours("WarmupCosineLR", {"total_num_steps": 4, "warmup_num_steps": 2,
                                                    "warmup_type": "linear", "cos_min_ratio": 0.1})  # fmt: skip
    lrs = [lr[0] for lr in _lrs(optimizer, scheduler, 6)]
    half = 0.1 + 0.9 * (1 + math.cos(math.pi / 2)) / 2
    assert lrs == pytest.approx([0.0, 0.0, 0.025, 0.05 * half, 0.005, 0.005])


def test_scheduler_state_is_json_and_resumes():
    optimizer, scheduler = _ours("WarmupDecayLR", {"total_num_steps": 40, "warmup_num_steps": 10})
    for _ in range(13):
        scheduler.step()
    state = json.loads(json.dumps(scheduler.state_dict()))
    optimizer2, scheduler2 = _ours("WarmupDecayLR", {"total_num_steps": 40, "warmup_num_steps": 10})
    scheduler2.load_state_dict(state)
    scheduler.step()
    scheduler2.step()
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in optimizer2.param_groups]
    optimizer3, scheduler3 = _ours("WarmupDecayLR", {"total_num_steps": 40, "warmup_num_steps": 10,
                                                     "last_batch_iteration": 12})  # fmt: skip
    assert optimizer3.param_groups[0]["lr"] == 0.05, "DeepSpeed leaves the lr until the next step()"
    scheduler3.step()
    assert [g["lr"] for g in optimizer3.param_groups] == [g["lr"] for g in optimizer.param_groups]


def _deepspeed_choice(name, params):
    """What DeepSpeed 0.19.8's engine builds: its own _configure_basic_optimizer on a stand-in engine."""
    engine = pytest.importorskip("deepspeed.runtime.engine").DeepSpeedEngine
    stub = types.SimpleNamespace(
        optimizer_name=lambda: name.lower() if name.lower() in ("adam", "adamw") else name,
        optimizer_params=lambda: dict(params),
        zero_use_cpu_optimizer=lambda: False,
        has_moe_layers=False,
    )
    stub.get_optimizer_configuration = types.MethodType(engine.get_optimizer_configuration, stub)
    return types.MethodType(engine._configure_basic_optimizer, stub)


def _fused_adam_reference(params, lr, betas, eps, wd, adam_w_mode, steps):
    """DeepSpeed's FusedAdam update (csrc/adam/multi_tensor_adam.cu), for CPU where its kernel does not build."""
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for step in range(1, steps + 1):
        _grads(params, step)
        with torch.no_grad():
            for p, (m, v) in zip(params, state):
                g = p.grad if adam_w_mode else p.grad + wd * p
                m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
                v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
                update = (m / (1 - betas[0] ** step)) / ((v / (1 - betas[1] ** step)).sqrt() + eps)
                if adam_w_mode:
                    update = update + wd * p
                p.sub_(lr * update)


def _run(optimizer, params, steps=3):
    for step in range(1, steps + 1):
        _grads(params, step)
        optimizer.step()


@pytest.mark.parametrize(
    ("name", "params", "decoupled"),
    [
        ("Adam", {"lr": 0.01, "weight_decay": 0.1}, True),  # adam_w_mode defaults to true: AdamW
        ("Adam", {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}, False),
        ("AdamW", {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}, True),  # AdamW is always AdamW
        ("adamw", {"lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-6}, True),
    ],
)
def test_adam_is_fused_adams_semantics(name, params, decoupled):
    mine = _params()
    optimizer, scheduler = zgraph.optimizer_from_deepspeed({"optimizer": {"type": name, "params": params}}, mine)
    assert scheduler is None and type(optimizer) is (torch.optim.AdamW if decoupled else torch.optim.Adam)
    assert optimizer.defaults["weight_decay"] == params.get("weight_decay", 0.0), "FusedAdam's default, not 0.01"
    _run(optimizer, mine)
    reference = _params()
    betas = tuple(params.get("betas", (0.9, 0.999)))
    _fused_adam_reference(reference, params["lr"], betas, params.get("eps", 1e-8), params.get("weight_decay", 0.0),
                          decoupled, 3)  # fmt: skip
    for a, b in zip(mine, reference):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_deepspeed_builds_fused_adam_with_that_mode(monkeypatch):
    adam = pytest.importorskip("deepspeed.ops.adam")
    built = {}
    monkeypatch.setattr(adam, "FusedAdam", lambda params, **kwargs: built.update(kwargs) or "fused")
    for name, params, decoupled in [("adam", {}, True), ("adam", {"adam_w_mode": False}, False), ("adamw", {}, True)]:
        assert _deepspeed_choice(name, params)(_params()) == "fused" and built["adam_w_mode"] is decoupled
        ours, _ = zgraph.optimizer_from_deepspeed({"optimizer": {"type": name, "params": params}}, _params())
        assert isinstance(ours, torch.optim.AdamW) is decoupled


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("Adam", {"lr": 0.01, "torch_adam": True}),
        ("Adam", {"lr": 0.01, "torch_adam": True, "adam_w_mode": False, "weight_decay": 0.1}),
        ("AdamW", {"lr": 0.01, "torch_adam": True}),  # torch's AdamW default weight decay, 0.01
        ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True}),
    ],
)
def test_torch_optimizers_equal_deepspeeds_choice(name, params):
    theirs_params, mine = _params(), _params()
    theirs = _deepspeed_choice(name, params)(theirs_params)
    ours, _ = zgraph.optimizer_from_deepspeed({"optimizer": {"type": name, "params": params}}, mine)
    assert type(ours) is type(theirs) and ours.defaults == theirs.defaults
    _run(theirs, theirs_params)
    _run(ours, mine)
    for a, b in zip(mine, theirs_params):
        assert torch.equal(a, b)


def test_torch_adam_by_hand():
    ours, _ = zgraph.optimizer_from_deepspeed(
        {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, _params()
    )
    assert type(ours) is torch.optim.AdamW and ours.defaults["weight_decay"] == 0.01
    ours, _ = zgraph.optimizer_from_deepspeed({"optimizer": {"type": "SGD", "params": {"lr": 0.5}}}, _params())
    assert type(ours) is torch.optim.SGD and ours.defaults["lr"] == 0.5


def test_param_groups_keep_their_settings():
    p = _params()
    groups = [{"params": [p[0]], "weight_decay": 0.0}, {"params": [p[1]]}]
    warmup = {"warmup_max_lr": [0.1, 0.2], "warmup_num_steps": 2}
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": warmup},
    }
    optimizer, scheduler = zgraph.optimizer_from_deepspeed(config, groups)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.1]
    scheduler.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.1, 0.2])


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"optimizer": {"type": "Lamb", "params": {}}}, r"optimizer\.type 'Lamb'"),
        ({"optimizer": {"type": "sgd", "params": {}}}, r"optimizer\.type 'sgd'"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "decay": 0.1}}}, r"unknown key\(s\) \['decay'\]"),
        ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "gradient_clipping"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}}, r"optimizer\.params\.lr: expected a number"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": float("inf")}}}, r"optimizer\.params\.lr: expected a fin"),
        ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": "false"}}}, r"adam_w_mode: expected true or"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, r"betas: expected a list of two numbers"),
        ({"optimizer": {"type": "SGD", "params": {"nesterov": 1}}}, r"nesterov: expected true or false"),
        ({}, "no 'optimizer' section"),
        ({"optimizer": {"type": "SGD"}, "scheduler": {"type": "OneCycle"}}, r"scheduler\.type 'OneCycle'"),
        ({"optimizer": {"type": "SGD"}, "scheduler": {"type": "WarmupDecayLR"}}, "total_num_steps"),
        (
            {"optimizer": {"type": "SGD"}, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}}},
            r"warmup_type: expected one of 'log', 'linear'",
        ),  # fmt: skip
        (
            {"optimizer": {"type": "SGD"}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
            r"warmup_num_steps: expected an integer of at least 1",
        ),  # fmt: skip
        (
            {"optimizer": {"type": "SGD"}, "scheduler": {"type": "WarmupLR", "params": {"min_lr": 0}}},
            r"unknown key\(s\) \['min_lr'\]",
        ),  # fmt: skip
    ],
)
def test_unknown_types_and_params_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        zgraph.optimizer_from_deepspeed(config, _params())


def test_from_deepspeed_ignores_the_sections_optimizer_from_deepspeed_reads():
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "scheduler": {"type": "WarmupLR"}}
    assert zgraph.Config.from_deepspeed(config) == zgraph.Config.from_deepspeed({})
