"""A CNN with BatchNorm, GroupNorm and LayerNorm under ``param_dtype=torch.bfloat16``, whose norm layers
``Config.keep_fp32_modules`` keeps in fp32 (run by test_norm_precision.py on 1 and 2 ranks).

The reference is eager PyTorch with the same casts, as DDP would run it: each rank's share of the global batch
goes through the model with its own BatchNorm statistics (running statistics per rank, as zgraph keeps them), the
convolution and linear parameters read cast to bf16 and the norm layers' in fp32, the input cast to bf16; the
loss is the mean of the ranks' losses, so gradients are DDP's average.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_named
from torch import nn

import zgraph
from zgraph.graph import collective_kind

STEPS = 2
GLOBAL_BATCH = 8
LR = 0.1
NORMS = (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),  # BatchNorm follows: a bias would have no gradient but noise
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.Flatten(),
        nn.LayerNorm(128),
        nn.Linear(128, 5),
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def local(batch: tuple, rank: int, world: int) -> tuple:
    n = GLOBAL_BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def step(model, opt, x, y):
    loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def reference(world: int, dtype: torch.dtype | None = torch.bfloat16) -> dict:
    """Eager PyTorch with the policy's casts to ``dtype`` (None: none), DDP-style over ``world`` ranks (see the
    module docstring)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = [name for name, m in model.named_modules() if isinstance(m, NORMS)]
    kept = {f"{name}.{attr}" for name in norms for attr in ("weight", "bias")}
    buffers = [{n: b.clone() for n, b in model.named_buffers()} for _ in range(world)]
    losses = []
    for batch in batches():
        params = {n: p if n in kept or dtype is None else p.to(dtype) for n, p in model.named_parameters()}
        total = 0
        for rank in range(world):
            x, y = local(batch, rank, world)
            x = x if dtype is None else x.to(dtype)
            out = torch.func.functional_call(model, {**params, **buffers[rank]}, (x,))
            total = total + F.cross_entropy(out.float(), y)
        loss = total / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "buffers": buffers[0], "initial": make_model().state_dict()}


def norms_in_fp32(rank: int, world: int) -> dict:
    """Stages 0-3 with bf16 compute and the default policy (norm layers in fp32), and in fp32 as a control."""
    out = {}
    for dtype, stage in [(d, s) for d in (None, torch.bfloat16) for s in range(4)]:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0, param_dtype=dtype)
        compiled = zgraph.distribute(config)(step)
        losses = []
        for batch in batches():
            loss = compiled(model, opt, *local(batch, rank, world)).detach().clone()
            dist.all_reduce(loss)
            losses.append(float(loss) / world)
        gathers = set()
        for node in compiled.graphs["final"].graph.nodes:
            if collective_kind(node) == "all_gather_into_tensor" and node.meta.get("phase") == "forward":
                source = node.args[0][0] if isinstance(node.args[0], (list, tuple)) else node.args[0]
                gathers.add(str(source.meta["val"].dtype))
        out[(str(dtype), stage)] = {
            "losses": losses,
            "params": zgraph.full_state_dict(model),
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "gathered_dtypes": gathers,
        }
    return out


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())
