"""A step run under ``Config.memory_budget`` and measured (the worker ``run`` for ``dist_harness.run_ranks``), for
``test_memory_budget``: the model of ``remat_cases`` with wide activations, so the plan has something to choose."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from dist_harness import all_gather_values
from estimate_cases import holding
from remat_cases import Net, step
from torch import Tensor

import zgraph

STEPS = 3


def setup(
    rank: int = 0, world: int = 1, layers: int = 4
) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[tuple[Tensor, Tensor]]]:
    """The model, its optimizer, and this rank's share of ``STEPS`` global batches (the same on every world size)."""
    model = Net(d_model=32, layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 64, 8, generator=g), torch.randint(0, 5, (64,), generator=g)) for _ in range(STEPS)]
    n = 64 // world
    return model, opt, [(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]) for x, y in batches]


def train(config: zgraph.Config, rank: int = 0, world: int = 1, layers: int = 4) -> dict[str, Any]:
    """``STEPS`` calls; the last one measured: every tensor the rank holds before it tracked, and everything the call
    allocates (``LiveTensorBytes``). Returns losses, whole parameters, the measured peak, the plan (if any)."""
    model, opt, batches = setup(rank, world, layers)
    compiled = zgraph.distribute(config)(step)
    losses = []
    for call, (x, y) in enumerate(batches):
        torch.manual_seed(10 + call)
        if call < STEPS - 1:
            losses.append(compiled(model, opt, x, y).clone())
            continue
        tracker = holding(model, opt, x, y)  # (what it does not track, garbage too, is not measured)
        with tracker:
            losses.append(compiled(model, opt, x, y).clone())
    plan = compiled.memory_plan
    return {
        "losses": losses,
        "params": zgraph.full_state_dict(model),
        "peak": tracker.peak,
        "chosen": None if plan is None else plan.chosen.changes,
        "estimated_peak": None if plan is None else plan.chosen.estimate.peak_bytes,
        "explain": compiled.explain(),
    }


def run(rank: int, world: int, out_path: str, stage: int, budget: int, layers: int) -> None:
    """Worker: the step at ``stage`` with NVMe offload possible (``offload_dir``), under ``budget`` and without one;
    rank 0 saves both runs and every rank's measured peak."""
    offload_dir = tempfile.mkdtemp(prefix=f"zgraph-budget-{rank}-")
    base = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0, offload_dir=offload_dir)
    planned = train(base.replace(memory_budget=budget), rank, world, layers)
    plain = train(base, rank, world, layers)
    peaks = all_gather_values(planned["peak"])
    if rank == 0:
        torch.save({"planned": planned, "plain": plain, "peaks": peaks}, out_path)
