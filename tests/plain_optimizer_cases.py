"""A plain-object optimizer (not a ``torch.optim.Optimizer``) on 1 and 2 ranks at every stage (run by
test_user_steps.py). Before issue 16, at stage 3 on 2 ranks its list of ``model.parameters()`` still held the
whole parameters stage 3 had replaced by shards, so its updates never reached the model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dist_harness import run_named
from torch import nn

import zgraph

STEPS = 3
GLOBAL_BATCH = 8


class PlainSGD:
    """What a user writes instead of torch.optim.SGD: a list of parameters and ``p.sub_(lr * p.grad)``."""

    def __init__(self, params, lr: float):
        self.params = list(params)
        self.lr = lr

    def step(self) -> None:
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.sub_(self.lr * p.grad)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def make() -> tuple[nn.Module, PlainSGD]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, PlainSGD(model.parameters(), lr=0.1)


def train(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)) for _ in range(STEPS)
    ]


def eager() -> dict[str, torch.Tensor]:
    """The parameters after eager PyTorch trains on the global batches."""
    model, opt = make()
    for x, y in batches():
        train(model, opt, x, y)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def stages(rank: int, world: int) -> dict:
    out = {}
    n = GLOBAL_BATCH // world
    for stage in range(4):
        model, opt = make()
        step = zgraph.distribute(stage=stage, backend="eager", param_persistence_threshold=0)(train)
        for x, y in batches():
            step(model, opt, x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
        out[stage] = zgraph.full_state_dict(model)
    return out


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())
