"""The model, steps and multi-rank worker of test_symbolic_passes.py: a tiny GPT trained by a step whose sequence
dim is symbolic (``zgraph.mark_dynamic``) under the passes a config turns on (sequence parallelism, remat,
activation offload, clipping), and by eager PyTorch on the global batches (DDP's semantics: equal rows, or equal
sequence slices, per rank)."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
from dist_harness import run_named

import zgraph
from zgraph.demos.models import GPT, GPTConfig, lm_loss

CONFIG = GPTConfig(vocab=37, d_model=16, layers=2, heads=4, seq=48)
LENGTHS = (16, 24, 40)  # global sequence lengths; with sequence parallelism each of 2 ranks gets half
ROWS = 4  # global batch
CLIP = 0.5


def train_step(model, opt, idx, targets):
    loss = lm_loss(model(idx), targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(CONFIG)  # plain SGD: linear in the gradients (AdamW would magnify the float noise in the zero
    return model, torch.optim.SGD(model.parameters(), lr=0.1)  # gradient of a key bias), no state made by step 1


def _rank_batch(length: int, rank: int, world: int, sequence_parallel: int | None) -> tuple:
    g = torch.Generator().manual_seed(length)
    idx = torch.randint(0, CONFIG.vocab, (ROWS, length), generator=g)
    targets = torch.roll(idx, -1, dims=1)
    if sequence_parallel:
        return zgraph.shard_sequence((idx, targets), sequence_parallel)
    rows = ROWS // world
    return idx[rank * rows : (rank + 1) * rows], targets[rank * rows : (rank + 1) * rows]


def eager(max_grad_norm: float | None = None) -> dict:
    """Eager PyTorch on the global batches (whole sequences): losses and final parameters."""
    model, opt = _setup()
    losses = []
    for length in LENGTHS:
        idx, targets = _rank_batch(length, 0, 1, None)
        loss = lm_loss(model(idx), targets)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def symbolic(config: zgraph.Config, rank: int = 0, world: int = 1) -> dict:
    """Losses (the mean over the ranks: the global batch's) and final parameters of a step whose sequence dim is
    symbolic from the first call, on this rank's part of each global batch; its capture count."""
    model, opt = _setup()
    step = zgraph.distribute(config)(train_step)
    losses = []
    for length in LENGTHS:
        idx, targets = _rank_batch(length, rank, world, config.sequence_parallel)
        zgraph.mark_dynamic(idx, 1)
        zgraph.mark_dynamic(targets, 1)
        loss = step(model, opt, idx, targets).detach().clone()
        if world > 1:
            dist.all_reduce(loss)
        losses.append(loss / world)
    return {"losses": losses, "params": zgraph.full_state_dict(model), "variants": step._dispatch.variants()}


def sequence_parallel_remat(rank: int, world: int) -> dict:
    """Stage 3, Ulysses over 2 ranks (positions of a symbolic slice moved), blocks recomputed."""
    config = zgraph.Config(stage=3, sequence_parallel=2, remat="full", backend="eager", param_persistence_threshold=0)
    return symbolic(config, rank, world)


def offload_clip(rank: int, world: int) -> dict:
    """Stage 2: saved activations offloaded to files (stash/unstash of symbolic shapes), selective remat,
    clipping."""
    config = zgraph.Config(
        stage=2,
        backend="eager",
        offload_activations="nvme",
        offload_dir=tempfile.mkdtemp(prefix="zgraph-symbolic-"),
        max_grad_norm=CLIP,
        remat="selective",
    )
    return symbolic(config, rank, world)


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())
