"""The model, batches and eager reference of test_dynamic_shapes.py, and its multi-rank worker: a tiny GPT (no
dropout) with AdamW over batches whose sequence length and batch size change, at stages 0-3.

Semantics at world W (DDP's): each rank runs its rows of the global batch; the loss is the mean of the ranks'
losses (equal rows per rank: the global batch's mean) and the gradients are averaged."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from dist_harness import all_gather_values, run_named
from torch import nn

import zgraph
from zgraph.demos.models import GPT, GPTConfig, lm_loss

CONFIG = GPTConfig(vocab=48, d_model=16, layers=1, heads=2, seq=40)
# (global batch, sequence length): the second call changes both, so the second capture makes both symbolic;
# every later size runs on it. Each of 2 ranks gets >= 2 rows of each batch (a size 1 specializes).
SIZES = [(4, 12), (6, 20), (8, 7), (4, 33), (6, 16)]


def model() -> nn.Module:
    torch.manual_seed(0)
    return GPT(CONFIG)


def adamw(m: nn.Module, eps: float = 1e-8) -> torch.optim.AdamW:
    return torch.optim.AdamW(m.parameters(), lr=1e-2, eps=eps)


def batch(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, CONFIG.vocab, (rows, length), generator=g) for _ in range(2))


def batches(sizes: list[tuple[int, int]] = SIZES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batch(rows, length, i) for i, (rows, length) in enumerate(sizes)]


def train_step(m, opt, idx, targets):
    loss = lm_loss(m(idx), targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def eager(world: int = 1, sizes: list[tuple[int, int]] = SIZES, eps: float = 1e-8) -> dict:
    """Eager PyTorch on the global batches (the loss the mean of ``world`` equal rank slices' losses)."""
    m = model()
    opt = adamw(m, eps)
    losses = []
    for idx, targets in batches(sizes):
        loss = sum(lm_loss(m(i), t) for i, t in zip(idx.chunk(world), targets.chunk(world))) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in m.state_dict().items()}}


def zgraph_run(
    config: zgraph.Config, rank: int = 0, world: int = 1, sizes: list[tuple[int, int]] = SIZES, eps: float = 1e-8
) -> dict:
    """``eager``'s quantities for zgraph's step under ``config`` on this rank's rows of each batch, and the
    number of captures after each call."""
    m = model()
    opt = adamw(m, eps)
    step = zgraph.distribute(config)(train_step)
    losses, variants = [], []
    for idx, targets in batches(sizes):
        loss = step(m, opt, idx.chunk(world)[rank], targets.chunk(world)[rank]).detach().clone()
        if world > 1:
            dist.all_reduce(loss)
        losses.append(loss / world)
        variants.append(step._dispatch.variants())
    return {"losses": losses, "params": zgraph.full_state_dict(m), "variants": variants}


def stages(rank: int, world: int) -> dict:
    """Stages 0-3 (stage 3 shards every parameter) on this rank's rows, eager backend."""
    return {
        stage: zgraph_run(zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0), rank, world)
        for stage in range(4)
    }


def inductor_stage_3(rank: int, world: int) -> dict:
    """Stage 3 with inductor (AdamW's ``eps`` 1e-3: see test_dynamic_shapes), the warnings of a fallback to the
    eager backend, and every rank's inductor FX graph cache misses and hits."""
    config = zgraph.Config(stage=3, backend="inductor", param_persistence_threshold=0)
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = zgraph_run(config, rank, world, eps=1e-3)
    fallbacks = [str(w.message) for w in caught if "inductor" in str(w.message)]
    counters = torch._dynamo.utils.counters["inductor"]
    cache = all_gather_values({k: counters[k] for k in ("fxgraph_cache_miss", "fxgraph_cache_hit")})
    return {**result, "fallbacks": fallbacks, "cache": cache}


# Each rank's (rows, length) per call, as DDP ranks whose collators pad each batch to its own longest row: the
# first call the same on both ranks; at the second rank 0 repeats its size (its first graph serves it) while rank 1
# changes (its sizes become symbolic): the ranks' graphs differ until rank 0 makes the same dims symbolic; then
# every call differs between the ranks.
RANK_SIZES = [[(2, 12), (2, 12), (2, 20), (3, 7), (2, 16)], [(2, 12), (2, 9), (3, 33), (2, 16), (2, 5)]]


def rank_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batch(rows, length, 10 * rank + i) for i, (rows, length) in enumerate(RANK_SIZES[rank])]


def eager_ranks() -> dict:
    """DDP on ``RANK_SIZES``: the loss the mean of the ranks' losses, the gradients averaged."""
    m = model()
    opt = adamw(m)
    losses = []
    for calls in zip(*(rank_batches(rank) for rank in range(len(RANK_SIZES)))):
        loss = sum(lm_loss(m(idx), targets) for idx, targets in calls) / len(calls)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in m.state_dict().items()}}


def ranks_differ(rank: int, world: int) -> dict:
    """Stages 0 and 3 with each rank's own sizes (``RANK_SIZES``): losses averaged, whole parameters, and this
    rank's and the other ranks' captures after each call."""
    out = {}
    for stage in (0, 3):
        m = model()
        opt = adamw(m)
        config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0)
        step = zgraph.distribute(config)(train_step)
        losses, variants = [], []
        for idx, targets in rank_batches(rank):
            loss = step(m, opt, idx, targets).detach().clone()
            dist.all_reduce(loss)
            losses.append(loss / world)
            variants.append(all_gather_values(step._dispatch.variants()))
        out[stage] = {"losses": losses, "params": zgraph.full_state_dict(m), "variants": variants}
    return out


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())
