"""Offload runs for tests/test_offload.py: the same training with and without ``offload_optimizer="nvme"``."""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn

import zgraph

STEPS = 4


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batches(rank: int = 0, world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        n = 8 // world
        out.append((x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
    return out


def make_step(config: zgraph.Config):
    @zgraph.distribute(config)
    def step(model, opt, x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def train(config: zgraph.Config, rank: int = 0, world: int = 1) -> tuple[list[float], dict, dict]:
    """Losses (as exact float bits) and the whole model / optimizer state after training."""
    model, opt = make()
    step = make_step(config)
    losses = [step(model, opt, x, y).item() for x, y in batches(rank, world)]
    model_state, optim_state = zgraph.full_state_dict(model, opt)
    return losses, model_state, optim_state


def same(a: object, b: object) -> bool:
    """Bitwise equality of nested results."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def compare_ranks(rank: int, world: int, stage: int, state_dtype_name: str | None) -> None:
    """On each rank: offloaded training equals training without offload, bitwise; files gone afterwards."""
    state_dtype = getattr(torch, state_dtype_name) if state_dtype_name else None
    base = zgraph.Config(stage=stage, backend="eager", measure_collectives=False, optimizer_state_dtype=state_dtype)
    with tempfile.TemporaryDirectory() as directory:
        expected = train(base, rank, world)
        got = train(base.replace(offload_optimizer="nvme", offload_dir=directory), rank, world)
        assert same(expected, got), f"rank {rank}: offloaded training differs"
        import gc

        gc.collect()
        assert os.listdir(directory) == [], os.listdir(directory)
