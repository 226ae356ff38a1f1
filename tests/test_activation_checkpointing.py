"""Activation checkpointing (``torch.utils.checkpoint``, reentrant and not) under every precision configuration.

The reference is eager PyTorch with the same casts: under ``param_dtype`` each parameter is read through a
parametrization that casts it (so the checkpoint's recomputation casts again, with autograd through the cast,
as zgraph's does) and the model's input is cast as zgraph casts it; under autocast the forward runs under
``torch.autocast``. The graph runs the same aten ops on the same values, so losses and parameters are equal
bitwise. Before the fix (issue 16), with ``param_dtype=torch.bfloat16`` the reentrant form failed when run
(``mat1 and mat2 must have the same dtype``) and the non-reentrant one at capture (recomputed values had other
dtypes): the backward, and the recomputation inside it, ran without zgraph's casts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

import zgraph

LR = 0.1


class Cast(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, value):
        return value.to(self.dtype)


class Net(nn.Module):
    """Linear, a checkpointed block of two layers, a head."""

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.embed = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


def step(model, opt, x, y):
    loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def autocast_step(model, opt, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def eager_reference(reentrant: bool, param_dtype: torch.dtype | None, autocast: bool, loss_scale: float | None):
    """Losses and final parameters of eager PyTorch with the casts zgraph applies."""
    model = Net(reentrant)
    if param_dtype is not None:
        for module in model.modules():
            if isinstance(module, nn.Linear):
                parametrize.register_parametrization(module, "weight", Cast(param_dtype), unsafe=True)
                parametrize.register_parametrization(module, "bias", Cast(param_dtype), unsafe=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches():
        if param_dtype is not None:
            x = x.to(param_dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.mse_loss(model(x).float(), y)
        if loss_scale is None:
            loss.backward()
        else:
            (loss * loss_scale).backward()
            for p in model.parameters():
                p.grad.mul_(1.0 / loss_scale)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [p.detach() for p in model.parameters()]


CONFIGS = {
    "fp32": ({}, step),
    "bf16_params": ({"param_dtype": torch.bfloat16}, step),
    "fp16_params_loss_scale": ({"param_dtype": torch.float16, "loss_scale": 1024.0}, step),
    "autocast_config": ({"autocast_dtype": torch.bfloat16}, step),
    "autocast_in_step": ({}, autocast_step),
    "bf16_params_and_autocast": ({"param_dtype": torch.bfloat16, "autocast_dtype": torch.bfloat16}, step),
}


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_activation_checkpointing_equals_eager_with_the_same_casts(name, reentrant):
    kwargs, fn = CONFIGS[name]
    model = Net(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    compiled = zgraph.distribute(zgraph.Config(backend="eager", **kwargs))(fn)
    got = [compiled(model, opt, x, y) for x, y in batches()]
    autocast = "autocast_dtype" in kwargs or fn is autocast_step
    want, params = eager_reference(reentrant, kwargs.get("param_dtype"), autocast, kwargs.get("loss_scale"))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    for p, q in zip(model.parameters(), params):
        assert p.dtype == torch.float32 and torch.equal(p, q)
