"""The model, steps and multi-rank worker of test_symbolic_passes.py: a tiny GPT trained by a step whose sequence
dim is symbolic (``zgraph.mark_dynamic``) and by steps captured for each size (static graphs), under the passes a
config turns on (sequence parallelism, remat, activation offload, bf16 states, clipping)."""

from __future__ import annotations

import tempfile

import torch
from dist_harness import run_named

import zgraph
from zgraph.demos.models import GPT, GPTConfig, lm_loss

CONFIG = GPTConfig(vocab=37, d_model=16, layers=2, heads=4, seq=48)
LENGTHS = (16, 24, 40)  # global sequence lengths; with sequence parallelism each of 2 ranks gets half
ROWS = 4  # global batch


def train_step(model, opt, idx, targets):
    loss = lm_loss(model(idx), targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _rank_batch(length: int, rank: int, world: int, sequence_parallel: int | None) -> tuple:
    g = torch.Generator().manual_seed(length)
    idx = torch.randint(0, CONFIG.vocab, (ROWS, length), generator=g)
    targets = torch.roll(idx, -1, dims=1)
    if sequence_parallel:
        return zgraph.shard_sequence((idx, targets), sequence_parallel)
    rows = ROWS // world
    return idx[rank * rows : (rank + 1) * rows], targets[rank * rows : (rank + 1) * rows]


def symbolic_and_static(config: zgraph.Config, rank: int = 0, world: int = 1) -> dict:
    """Losses and final parameters of the symbolic step (one capture) and of static captures (a step per size)
    from the same start; the symbolic step's capture count."""
    out = {}
    for kind in ("symbolic", "static"):
        model, opt = _setup()
        step = zgraph.distribute(config)(train_step)
        losses = []
        for length in LENGTHS:
            idx, targets = _rank_batch(length, rank, world, config.sequence_parallel)
            if kind == "symbolic":
                zgraph.mark_dynamic(idx, 1)
                zgraph.mark_dynamic(targets, 1)
            else:  # a step captured for this size only
                step = zgraph.distribute(config)(train_step)
            losses.append(step(model, opt, idx, targets).detach().clone())
        out[kind] = {"losses": losses, "params": zgraph.full_state_dict(model)}
        if kind == "symbolic":
            out["variants"] = step._dispatch.variants()
    return out


def sequence_parallel_remat(rank: int, world: int) -> dict:
    """Stage 3, Ulysses over 2 ranks (positions of a symbolic slice moved), blocks recomputed."""
    config = zgraph.Config(stage=3, sequence_parallel=2, remat="full", backend="eager", param_persistence_threshold=0)
    return symbolic_and_static(config, rank, world)


def offload_bf16_clip(rank: int, world: int, offload_dir: str | None = None) -> dict:
    """Stage 2: saved activations offloaded to files (stash/unstash of symbolic shapes), bf16 parameters with fp32
    masters and bf16 optimizer states, clipping."""
    directory = offload_dir or tempfile.mkdtemp(prefix="zgraph-symbolic-")
    config = zgraph.Config(
        stage=2,
        backend="eager",
        offload_activations="nvme",
        offload_dir=directory,
        param_dtype=torch.bfloat16,
        master_dtype=torch.float32,
        optimizer_state_dtype=torch.bfloat16,
        max_grad_norm=0.5,
        remat="selective",
    )
    return symbolic_and_static(config, rank, world)


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())
