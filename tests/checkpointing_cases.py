"""The model, steps and eager reference of test_activation_checkpointing.py, and its multi-rank worker: bf16
compute at stages 0-3, where at stage 3 the recomputation inside backward reads parameters gathered again for
backward, in the compute dtype."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_named
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

import zgraph

GLOBAL_BATCH = 6
LR = 0.1


class Cast(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, value):
        return value.to(self.dtype)


class Net(nn.Module):
    """Linear, a checkpointed block of two layers, a head."""

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.embed = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


def step(model, opt, x, y):
    loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def autocast_step(model, opt, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def eager_reference(reentrant: bool, param_dtype: torch.dtype | None, autocast: bool, loss_scale: float | None):
    """Losses and final parameters of eager PyTorch with the casts zgraph applies."""
    model = Net(reentrant)
    if param_dtype is not None:
        for module in model.modules():
            if isinstance(module, nn.Linear):
                parametrize.register_parametrization(module, "weight", Cast(param_dtype), unsafe=True)
                parametrize.register_parametrization(module, "bias", Cast(param_dtype), unsafe=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches():
        if param_dtype is not None:
            x = x.to(param_dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.mse_loss(model(x).float(), y)
        if loss_scale is None:
            loss.backward()
        else:
            (loss * loss_scale).backward()
            for p in model.parameters():
                p.grad.mul_(1.0 / loss_scale)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [p.detach() for p in model.parameters()]


def stages(rank: int, world: int) -> dict:
    out = {}
    n = GLOBAL_BATCH // world
    for reentrant in (True, False):
        for stage in range(4):
            model = Net(reentrant)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            config = zgraph.Config(
                stage=stage, backend="eager", param_persistence_threshold=0, param_dtype=torch.bfloat16
            )
            compiled = zgraph.distribute(config)(step)
            losses = []
            for x, y in batches():
                loss = compiled(model, opt, x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
                loss = loss.detach().clone()
                dist.all_reduce(loss)
                losses.append(float(loss) / world)
            out[(reentrant, stage)] = {"losses": losses, "params": zgraph.full_state_dict(model)}
    return out


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())
