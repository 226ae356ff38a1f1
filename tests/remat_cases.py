"""A small transformer-ish model with dropout, trained under ``Config.remat`` policies at ZeRO stages 0-3 (the
worker ``run`` for ``dist_harness.run_ranks``), for ``test_remat``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import zgraph
from zgraph.graph import MADE_BY

POLICIES = (None, "selective", "full")
STEPS = 3
BATCH, SEQ, D_MODEL = 4, 6, 16


class Block(nn.Module):
    """Pre-LayerNorm block: causal attention and a GELU MLP, each with dropout on its residual branch."""

    def __init__(self, d_model: int, heads: int = 2, p: float = 0.1):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.fc, self.fc2 = nn.Linear(d_model, 2 * d_model), nn.Linear(2 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + F.dropout(self.proj(attn), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc(self.ln2(x)))), self.p, self.training)


class Net(nn.Module):
    def __init__(self, d_model: int = D_MODEL, layers: int = 2, classes: int = 5):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, d_model)
        self.blocks = nn.ModuleList([Block(d_model) for _ in range(layers)])
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = F.dropout(torch.tanh(self.inp(x)), 0.1, self.training)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h)).mean(1)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor) -> Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def batches(batch: int = BATCH, seq: int = SEQ) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, seq, 8, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(STEPS)]


def train(config: zgraph.Config, rank: int = 0, world: int = 1) -> tuple[list[Tensor], dict[str, Tensor], int]:
    """Losses of ``STEPS`` calls (each drawing from the global generator seeded alike), the whole parameters, and
    how many nodes the ``remat`` pass added."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = zgraph.distribute(config)(step)
    losses = []
    for call, (x, y) in enumerate(batches()):
        n = x.shape[0] // world
        torch.manual_seed(10 + call)
        losses.append(compiled(model, opt, x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]).clone())
    made = [n for n in compiled.graphs["remat"].graph.nodes if n.meta.get(MADE_BY) == "remat"]
    return losses, zgraph.full_state_dict(model), len(made)


def train_split(config: zgraph.Config, rank: int = 0, world: int = 1) -> tuple[list[Tensor], dict[str, Tensor], int]:
    """``train`` in split mode: zgraph's forward (its output carries the compiled backward), the loss and
    ``backward()`` outside it, zgraph's update."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward, update = zgraph.distribute(config)(_forward), zgraph.distribute(config)(_update)
    losses = []
    for call, (x, y) in enumerate(batches()):
        n = x.shape[0] // world
        torch.manual_seed(10 + call)
        loss = F.cross_entropy(forward(model, x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
        loss.backward()
        update(opt)
        losses.append(loss.detach())
    made = [n for n in forward.graphs["remat"].graph.nodes if n.meta.get(MADE_BY) == "remat"]
    return losses, zgraph.full_state_dict(model), len(made)


def _forward(model: nn.Module, x: Tensor) -> Tensor:
    return model(x)


def _update(opt: torch.optim.Optimizer) -> None:
    opt.step()
    opt.zero_grad()


def run(rank: int, world: int, out_path: str, stages: list[int], split_stages: list[int]) -> None:
    """Worker: every policy at every stage, and in split mode at ``split_stages``; rank 0 saves
    ``{(mode, stage, policy): train(...) or {"error": ...}}`` (mode ``"step"`` or ``"split"``)."""
    import traceback

    results: dict = {}
    runs = [("step", stage, train) for stage in stages] + [("split", stage, train_split) for stage in split_stages]
    for mode, stage, fn in runs:
        for policy in POLICIES:
            config = zgraph.Config(stage=stage, backend="eager", remat=policy, param_persistence_threshold=0)
            try:
                results[(mode, stage, policy)] = fn(config, rank, world)
            except Exception:
                results[(mode, stage, policy)] = {"error": traceback.format_exc()}
    if rank == 0:
        torch.save(results, out_path)
