"""A short soak on each rank (issue 25, item 6; the long one is ``benchmarks/soak.py``): ZeRO-3 with optimizer
states on the NVMe tier, a tiny GPT, sampled after every step: open files, the offload directory's bytes, the
tensor bytes held (``zgraph.runtime.memory.live_storages``) and the resident set (VmRSS)."""

from __future__ import annotations

import json
import os
import re

import torch
from torch import Tensor, nn

import zgraph
from zgraph.demos.models import GPT, GPTConfig, lm_loss
from zgraph.runtime.memory import live_storages

SHAPE = GPTConfig(vocab=96, d_model=32, layers=1, heads=2, seq=16)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: Tensor, tgt: Tensor) -> Tensor:
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.MULTILINE).group(1)) * 1024


def run(rank: int, world: int, steps: int, directory: str, out: str) -> None:
    """``steps`` steps, one sample after each; each rank writes its samples as JSON to ``out.<rank>``."""
    torch.manual_seed(0)
    model = GPT(SHAPE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = zgraph.Config(stage=3, backend="eager", offload_optimizer="nvme", offload_dir=directory)
    step = zgraph.distribute(config)(train_step)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, SHAPE.vocab, (2, SHAPE.seq + 1), generator=g) for _ in range(4)]
    samples = []
    for i in range(steps):
        batch = batches[i % len(batches)]
        step(model, opt, batch[:, :-1], batch[:, 1:])
        fds = len(os.listdir("/proc/self/fd"))
        samples.append({"fds": fds, "dir": _dir_bytes(directory), "tensors": sum(live_storages().values())})
        samples[-1]["rss"] = _rss()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(samples, f)
