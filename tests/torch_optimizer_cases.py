"""Every ``torch.optim`` optimizer in a zgraph step (issue 40, item 3), shared by test_torch_optimizers.py in one
process and on 2 spawned ranks (``run``): the optimizers with branch-taking hyper-parameters set, a tiny model, the
global batches, DDP on the same global batches, zgraph at stages 0-3, the refused optimizers and a checkpoint of
Adafactor's factored state."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_named
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zgraph

STEPS = 3
GLOBAL_BATCH = 8

# name -> optimizer on the parameters; hyper-parameters chosen so the steps take their branches (weight decay,
# momentum, ASGD's averaging from step 3 on: t0=2)
OPTIMIZERS = {
    "Adafactor": lambda ps, **kw: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.01, **kw),
    "Adagrad": lambda ps, **kw: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.01, weight_decay=0.01, **kw),
    "Adadelta": lambda ps, **kw: torch.optim.Adadelta(ps, lr=1.0, weight_decay=0.01, **kw),
    "Adamax": lambda ps, **kw: torch.optim.Adamax(ps, lr=0.02, weight_decay=0.01, **kw),
    "ASGD": lambda ps, **kw: torch.optim.ASGD(ps, lr=0.05, t0=2, weight_decay=0.01, **kw),
    "NAdam": lambda ps, **kw: torch.optim.NAdam(ps, lr=0.02, weight_decay=0.01, decoupled_weight_decay=True, **kw),
    "RAdam": lambda ps, **kw: torch.optim.RAdam(ps, lr=0.02, weight_decay=0.01, **kw),
    "RMSprop": lambda ps, **kw: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True, weight_decay=0.01, **kw),
    "Rprop": lambda ps, **kw: torch.optim.Rprop(ps, lr=0.01, **kw),
    "Muon": lambda ps, **kw: torch.optim.Muon(ps, lr=0.02, **kw),
}
REFUSED = {
    "LBFGS": lambda ps: torch.optim.LBFGS(ps),
    "SparseAdam": lambda ps: torch.optim.SparseAdam(ps),
}


def make(name: str, **flags: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and the optimizer ``name`` (Muon: on the 2-D parameters, as its documentation says)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    params = [p for p in model.parameters() if p.dim() == 2] if name == "Muon" else list(model.parameters())
    return model, {**OPTIMIZERS, **REFUSED}[name](params, **flags)


def train_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)) for _ in range(steps)
    ]


def eager(name: str) -> dict:
    """One process, eager PyTorch, on the global batches: the parameters and the optimizer's state_dict."""
    model, opt = make(name)
    for x, y in batches():
        train_step(model, opt, x, y)
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _slices(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = GLOBAL_BATCH // world
    return [(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]) for x, y in batches()]


def _ddp(name: str, rank: int, world: int) -> dict:
    model, opt = make(name)
    ddp = DistributedDataParallel(model)
    for x, y in _slices(rank, world):
        train_step(ddp, opt, x, y)
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _zgraph(name: str, stage: int, rank: int, world: int) -> dict:
    model, opt = make(name)
    step = zgraph.distribute(stage=stage, backend="eager", param_persistence_threshold=0)(train_step)
    for x, y in _slices(rank, world):
        step(model, opt, x, y)
    return dict(zip(("model", "optim"), zgraph.full_state_dict(model, opt)))


def stages(rank: int, world: int) -> dict:
    """Every optimizer with DDP and with zgraph at stages 0-3 on this rank's slice of the global batches."""
    return {
        name: {"ddp": _ddp(name, rank, world), **{stage: _zgraph(name, stage, rank, world) for stage in range(4)}}
        for name in OPTIMIZERS
    }


def refusals(rank: int, world: int) -> dict:
    """LBFGS and SparseAdam at stage 3: the CaptureError, and whether the model and optimizer were left as they
    were (no sharded parameter, no state, the optimizer's own parameters)."""
    out = {}
    for name in REFUSED:
        model, opt = make(name)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        params = list(model.parameters())
        step = zgraph.distribute(stage=3, backend="eager", param_persistence_threshold=0)(train_step)
        x, y = batches(1)[0]
        try:
            step(model, opt, x, y)
            message = None
        except zgraph.CaptureError as error:
            message = str(error)
        out[name] = {
            "message": message,
            "unchanged": all(torch.equal(v, before[k]) for k, v in model.state_dict().items()),
            "plain": all(type(p) is nn.Parameter for p in model.parameters()),
            "same_params": opt.param_groups[0]["params"] == params and list(model.parameters()) == params,
            "no_state": not opt.state,
        }
    return out


def adafactor_checkpoint(rank: int, world: int) -> dict:
    """Adafactor at stage 3 (its factored row / column states have other shapes than the parameters: kept whole):
    two steps, zgraph.save, zgraph.load into a fresh model and optimizer, one more step on both."""
    out = {}
    path = os.path.join(OUT_DIR, "adafactor_ck")
    mine = _slices(rank, world)
    config = zgraph.Config(stage=3, backend="eager", param_persistence_threshold=0)
    model, opt = make("Adafactor")
    step = zgraph.distribute(config)(train_step)
    for x, y in mine[:2]:
        step(model, opt, x, y)
    zgraph.save(path, model, opt)
    out["saved"] = zgraph.full_state_dict(model, opt)
    fresh, fresh_opt = make("Adafactor")
    zgraph.load(path, fresh, fresh_opt)
    out["loaded"] = zgraph.full_state_dict(fresh, fresh_opt)
    fresh_step = zgraph.distribute(config)(train_step)
    step(model, opt, *mine[2])
    fresh_step(fresh, fresh_opt, *mine[2])
    out["after"] = zgraph.full_state_dict(model, opt)
    out["after_loaded"] = zgraph.full_state_dict(fresh, fresh_opt)
    dist.barrier()
    return out


OUT_DIR = "."


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    global OUT_DIR
    OUT_DIR = os.path.dirname(out_path)
    run_named(rank, world, out_path, names, globals())
