"""The models, steps and eager reference of test_compiled_models.py, and its multi-rank worker.

``Net`` is built plain; ``compiled(form)`` wraps it in one of the ways users put ``torch.compile`` on a model
(the whole model, ``module.compile()``, a compiled ``forward``, a compiled submodule, a ``@torch.compile``
function the forward calls, or all at once). zgraph traces through the wrappers: the step equals eager PyTorch on
the plain model, on one process and (``stages``) at ZeRO stages 0-3 on 2 ranks against the global batch.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_named
from torch import nn

import zgraph

GLOBAL_BATCH = 8
STEPS = 3
FORMS = ["optimized_module", "module_compile", "compiled_forward", "compiled_submodule", "compiled_function", "all"]


@torch.compile
def gelu_scaled(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x) * 1.5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 12)
        self.norm = nn.LayerNorm(12)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + torch.tanh(self.a(h)))


class Net(nn.Module):
    """An embedding layer, a block, a head; ``compiled_function``: the activation is a ``@torch.compile`` function."""

    def __init__(self, compiled_function: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.compiled_function = compiled_function
        self.embed = nn.Linear(6, 12)
        self.block = Block()
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = gelu_scaled(h) if self.compiled_function else F.gelu(h) * 1.5
        return self.head(self.block(h))


def compiled(form: str) -> nn.Module:
    """A fresh ``Net`` with ``torch.compile`` put on it the way ``form`` names; returns what the step is given."""
    model = Net(compiled_function=form in ("compiled_function", "all"))
    if form in ("module_compile", "all"):
        model.block.compile()
    if form == "compiled_forward":
        model.block.forward = torch.compile(model.block.forward)
    if form in ("compiled_submodule", "all"):
        model.head = torch.compile(model.head)
    return torch.compile(model) if form in ("optimized_module", "all") else model


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def eager_reference() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Losses and final parameters (by the plain model's names) of eager PyTorch on the plain model and the global
    batches, with AdamW."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = [step(model, opt, x, y) for x, y in batches()]
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def plain_names(model: nn.Module) -> dict[str, str]:
    """``model``'s state_dict keys (``_orig_mod.`` where torch.compile wrapped a module) -> the plain ``Net``'s."""
    return {key: key.replace("_orig_mod.", "") for key in model.state_dict()}


def stages(rank: int, world: int) -> dict:
    """Every form at once (``compiled("all")``), AdamW, ZeRO stages 0-3: each rank's losses averaged, the state
    dict's keys and whole tensors (``zgraph.full_state_dict``); at stage 3 also a checkpoint saved and loaded into
    a fresh compiled model (its ``state_dict``), and ``zgraph.consolidate``'s keys."""
    out = {}
    n = GLOBAL_BATCH // world
    for stage in range(4):
        model = compiled("all")
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        train = zgraph.distribute(zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0))(step)
        losses = []
        for x, y in batches():
            loss = train(model, opt, x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]).clone()
            dist.all_reduce(loss)
            losses.append(loss / world)
        result = {"losses": losses, "keys": list(model.state_dict()), "full": zgraph.full_state_dict(model)}
        if stage == 3:
            result.update(_save_and_load(model, opt, rank))
        out[stage] = result
    return out


def _save_and_load(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> dict:
    path = os.path.join(os.environ["COMPILED_CASES_DIR"], "checkpoint")
    zgraph.save(path, model, opt)
    fresh = compiled("all")
    zgraph.load(path, fresh, torch.optim.AdamW(fresh.parameters(), lr=0.01))
    result = {"loaded": copy.deepcopy(fresh.state_dict())}
    if rank == 0:
        result["consolidated"] = list(zgraph.consolidate(path, path + ".pt"))
    return result


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    os.environ["COMPILED_CASES_DIR"] = os.path.dirname(out_path)
    run_named(rank, world, out_path, names, globals())
