"""A short soak on each rank (issue 25, item 6; the long one is ``benchmarks/soak.py``): ZeRO-3 with optimizer
states on the NVMe tier, a tiny GPT, sampled after every step: open files, the offload directory's bytes, the
tensor bytes held (``zgraph.runtime.memory.live_tensors``; the tensors new since the last sample are listed) and
the resident set (VmRSS)."""

from __future__ import annotations

import json
import os
import re
import time

import torch
from torch import Tensor, nn

import zgraph
from zgraph.demos.models import GPT, GPTConfig, lm_loss
from zgraph.runtime.memory import live_tensors

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


def _held(before: dict[int, tuple[int, str]]) -> tuple[dict[int, tuple[int, str]], int | None]:
    """Each live tensor storage's bytes and description (no tensor kept), looked at again a moment later where
    the first look differs from ``before``: a gloo worker thread lets go of a finished collective (and of its
    tensors, whose Python objects torch keeps while C++ holds them) a moment after the step's wait returned, and
    under load that moment outlasts the step (full-size parameters of the last all-gather, seen at about one
    sample in a hundred). A leak is there at both looks. Also the first look's bytes where it was not kept."""
    held, first = _look(), None
    if sum(n for n, _ in held.values()) != sum(n for n, _ in before.values()):
        first = sum(n for n, _ in held.values())
        time.sleep(0.5)
        held = _look()
    return held, first


def _look() -> dict[int, tuple[int, str]]:
    return {ptr: (t.untyped_storage().nbytes(), f"{tuple(t.shape)} {t.dtype}") for ptr, t in live_tensors().items()}


def run(rank: int, world: int, steps: int, directory: str, out: str) -> None:
    """``steps`` steps, one sample after each; each rank writes its samples as JSON to ``out.<rank>``."""
    torch.manual_seed(0)
    model = GPT(SHAPE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = zgraph.Config(stage=3, backend="eager", offload_optimizer="nvme", offload_dir=directory)
    step = zgraph.distribute(config)(train_step)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, SHAPE.vocab, (2, SHAPE.seq + 1), generator=g) for _ in range(4)]
    samples, before = [], {}
    for i in range(steps):
        batch = batches[i % len(batches)]
        step(model, opt, batch[:, :-1], batch[:, 1:])
        fds = len(os.listdir("/proc/self/fd"))
        held, first = _held(before)
        samples.append({"fds": fds, "dir": _dir_bytes(directory), "tensors": sum(n for n, _ in held.values())})
        samples[-1]["first_look"] = first  # the bytes a first look saw, where a second was needed
        samples[-1]["new"] = [held[ptr][1] for ptr in held.keys() - before.keys()]  # no tensor kept: its description
        samples[-1]["rss"], before = _rss(), held
    with open(f"{out}.{rank}", "w") as f:
        json.dump(samples, f)
