"""``remat_cases``'s transformer-ish model with dropout trained with ``Config.offload_activations`` (files under a
real directory) at ZeRO stages, alone and with ``remat="selective"`` (the worker ``run`` for
``dist_harness.run_ranks``), for ``test_offload_activations``."""

from __future__ import annotations

import os

import torch
from remat_cases import Net, batches, step

import zgraph
from zgraph.graph import MADE_BY

VARIANTS = {"none": {}, "nvme": {"offload_activations": "nvme"}, "nvme+selective": {}}
VARIANTS["nvme+selective"] = {"offload_activations": "nvme", "remat": "selective"}


def train(config: zgraph.Config, rank: int = 0, world: int = 1) -> tuple[list, dict, int, list]:
    """Losses of three calls, the whole parameters, how many nodes the ``offload_activations`` pass added, and the
    files left under ``config.offload_dir`` after each call (none: each step removes its own)."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = zgraph.distribute(config)(step)
    losses, left = [], []
    for call, (x, y) in enumerate(batches()):
        n = x.shape[0] // world
        torch.manual_seed(10 + call)
        losses.append(compiled(model, opt, x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]).clone())
        left.append(_files(config.offload_dir))
    made = [
        n for n in compiled.graphs["offload_activations"].graph.nodes if n.meta.get(MADE_BY) == "offload_activations"
    ]
    return losses, zgraph.full_state_dict(model), len(made), left


def _files(directory: str | None) -> list[str]:
    if directory is None:
        return []
    return [os.path.join(root, f) for root, _, files in os.walk(directory) for f in files]


def run(rank: int, world: int, out_path: str, directory: str, stages: list[int]) -> None:
    """Worker: every variant at every stage; rank 0 saves ``{(stage, variant): train(...) or {"error": ...}}``."""
    import traceback

    results: dict = {}
    for stage in stages:
        for name, fields in VARIANTS.items():
            where = os.path.join(directory, f"rank{rank}")
            os.makedirs(where, exist_ok=True)
            config = zgraph.Config(
                stage=stage, backend="eager", param_persistence_threshold=0, offload_dir=where, **fields
            )
            try:
                results[(stage, name)] = train(config, rank, world)
            except Exception:
                results[(stage, name)] = {"error": traceback.format_exc()}
    if rank == 0:
        torch.save(results, out_path)
