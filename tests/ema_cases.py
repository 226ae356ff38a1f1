"""The model, steps and eager reference of ``test_ema.py``, and its 2-rank worker: an EMA of the weights
(``AveragedModel`` with ``get_ema_multi_avg_fn``) updated inside the step, right after ``opt.step()``, or eagerly
after each call, at ZeRO stages 0-3; each rank trains on its half of the global batch.

Inside the step ``update_parameters`` branches on ``n_averaged == 0`` (a host counter: the first call copies the
weights, later calls average), so the step is captured twice. Updated outside, at stages 0-2 the EMA is not the
step's (its parameters whole, as the model's are after each call); at stage 3 the step is handed the EMA as well,
so zgraph lays it out like the model (shards), and ``update_parameters`` runs eagerly on the shards."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from dist_harness import run_named
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import zgraph

DECAY = 0.9
STEPS = 3
STAGES = (0, 1, 2, 3)
WHERE = ("inside", "outside")
WORK = ""  # the directory the worker writes checkpoints and exports into (set by ``run``)


def build() -> tuple[nn.Module, AveragedModel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    return model, ema, torch.optim.AdamW(model.parameters(), lr=0.01)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches (8 rows)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(STEPS)]


def train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def inside(model: nn.Module, ema: AveragedModel, opt: torch.optim.Optimizer, x, y) -> torch.Tensor:
    loss = train(model, opt, x, y)
    ema.update_parameters(model)
    return loss


def with_ema(model: nn.Module, ema: AveragedModel, opt: torch.optim.Optimizer, x, y) -> torch.Tensor:
    """The step of an EMA updated outside it, handed the EMA at stage 3 (zgraph shards it like the model)."""
    return train(model, opt, x, y)


def eager() -> dict[str, dict[str, torch.Tensor]]:
    """One process, the global batches: the model's and the EMA's state after ``STEPS`` steps."""
    model, ema, opt = build()
    for x, y in batches():
        inside(model, ema, opt, x, y)
    return {"model": model.state_dict(), "ema": ema.state_dict()}


def config(stage: int) -> zgraph.Config:
    return zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0)


def _half(rank: int, t: torch.Tensor) -> torch.Tensor:
    return t[rank * 4 : (rank + 1) * 4]


def _run(rank: int, stage: int, where: str, objects: tuple, calls: list) -> zgraph.DistributedStep:
    """Run the ``calls`` (global batches) through a step of ``stage``; the EMA updated ``where``."""
    model, ema, opt = objects
    fn = inside if where == "inside" else with_ema if stage == 3 else train
    step = zgraph.distribute(config(stage))(fn)
    for x, y in calls:
        args = (model, ema, opt) if fn is not train else (model, opt)
        step(*args, _half(rank, x), _half(rank, y))
        if where == "outside":
            ema.update_parameters(model)
    return step


def stages(rank: int, world: int) -> dict:
    """Every stage, the EMA updated inside and outside the step: the whole model and EMA after ``STEPS`` steps,
    how the EMA's parameters are held, how many captures the step made. At stage 3 (inside) also the EMA's
    forward inside ``zgraph.gather`` and its export by ``zgraph.save_pretrained``."""
    out = {}
    x = batches()[0][0]
    for stage in STAGES:
        for where in WHERE:
            model, ema, opt = objects = build()
            step = _run(rank, stage, where, objects, batches())
            out[stage, where] = {
                "model": zgraph.full_state_dict(model),
                "ema": zgraph.full_state_dict(ema),
                "sharded": [isinstance(p, DTensor) for p in ema.parameters()],
                "captures": step._dispatch.variants(),
            }
            if stage == 3 and where == "inside":
                out["gathered_inputs"] = _gathered_inputs(step)
                with zgraph.gather(ema), torch.no_grad():
                    out["gathered_forward"] = ema(x)
                zgraph.save_pretrained(ema.module, os.path.join(WORK, "ema_export"))
    return out


def _gathered_inputs(step: zgraph.DistributedStep) -> set[str]:
    """The graph inputs the last call's graph all-gathers, by name."""
    gathers = [n for n in step.graphs["final"].graph.nodes if "all_gather" in str(n.target)]
    return {arg.name for n in gathers for arg in n.all_input_nodes if arg.op == "placeholder"}


def resume(rank: int, world: int) -> dict:
    """Stage 3, the EMA updated inside the step: 2 steps, ``zgraph.save`` of model and EMA (and the optimizer),
    then new objects, ``zgraph.load`` before their first step, and the last step."""
    path = os.path.join(WORK, "ckpt")
    model, ema, opt = objects = build()
    _run(rank, 3, "inside", objects, batches()[:2])
    zgraph.save(path, nn.ModuleDict({"model": model, "ema": ema}), opt)
    model, ema, opt = objects = build()
    zgraph.load(path, nn.ModuleDict({"model": model, "ema": ema}), opt)
    _run(rank, 3, "inside", objects, batches()[2:])
    return {"model": zgraph.full_state_dict(model), "ema": zgraph.full_state_dict(ema)}


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    global WORK
    WORK = os.path.dirname(out_path)
    run_named(rank, world, out_path, names, globals())
