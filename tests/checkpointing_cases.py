"""The model, steps and eager reference of test_activation_checkpointing.py, and its multi-rank worker: bf16
compute at stages 0-3, where at stage 3 the recomputation inside backward reads parameters gathered again for
backward, in the compute dtype.

The model draws random numbers inside the checkpointed block (``nn.Dropout``, ``F.dropout`` and
``scaled_dot_product_attention``'s ``dropout_p``) and outside it: the recomputation in backward must draw the
forward's numbers, and the generator must end where eager's does. Every rank builds the model (which seeds the
generator), so all ranks draw the same numbers for their rows, as DDP ranks seeded alike do: the multi-rank
reference (``eager_reference(..., world=2)``) runs each rank's rows from the same generator state."""

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


class Block(nn.Module):
    """Two layers with dropout between, and self-attention with attention dropout over 2 positions of 2 heads."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.25)
        self.b = nn.Linear(16, 16)

    def forward(self, h):
        h = self.drop(torch.tanh(self.a(h)))
        q = h.view(-1, 2, 2, 4).transpose(1, 2)  # (rows, heads, positions, head dim)
        h = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3).transpose(1, 2).reshape(-1, 16)
        return self.b(F.dropout(h, 0.1, self.training))


class Net(nn.Module):
    """Linear, dropout, a checkpointed block, a head."""

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.embed = nn.Linear(8, 16)
        self.block = Block()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = F.dropout(torch.relu(self.embed(x)), 0.2, self.training)
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


def forward(model, x):
    """A split-mode step: the forward only; its output carries the compiled backward."""
    return model(x)


def update(opt):
    opt.step()
    opt.zero_grad()


def split_steps(config: zgraph.Config):
    """``step`` in split mode: zgraph's forward, the loss and ``backward()`` outside it, zgraph's update."""
    compiled_forward, compiled_update = zgraph.distribute(config)(forward), zgraph.distribute(config)(update)

    def run(model, opt, x, y):
        loss = F.mse_loss(compiled_forward(model, x).float(), y)
        loss.backward()
        compiled_update(opt)
        return loss.detach()

    return run


def batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def eager_reference(
    reentrant: bool, param_dtype: torch.dtype | None, autocast: bool, loss_scale: float | None, world: int = 1
):
    """Losses, final parameters and generator state of eager PyTorch with the casts zgraph applies, on the global
    batch cut into ``world`` equal rank slices, each slice's forward drawing from the generator state the step
    started in (as ranks seeded alike do); the loss is the mean of the slices' losses."""
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
        start, parts = torch.get_rng_state(), []
        for x_part, y_part in zip(x.chunk(world), y.chunk(world)):
            torch.set_rng_state(start)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                parts.append(F.mse_loss(model(x_part).float(), y_part))
        loss = sum(parts) / world
        if loss_scale is None:
            loss.backward()
        else:
            (loss * loss_scale).backward()
            for p in model.parameters():
                p.grad.mul_(1.0 / loss_scale)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [p.detach() for p in model.parameters()], torch.get_rng_state()


def stages(rank: int, world: int, split: bool = False) -> dict:
    out = {}
    n = GLOBAL_BATCH // world
    for reentrant in (True, False):
        for stage in range(4):
            model = Net(reentrant)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            config = zgraph.Config(
                stage=stage, backend="eager", param_persistence_threshold=0, param_dtype=torch.bfloat16
            )
            compiled = split_steps(config) if split else zgraph.distribute(config)(step)
            losses = []
            for x, y in batches():
                loss = compiled(model, opt, x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
                loss = loss.detach().clone()
                dist.all_reduce(loss)
                losses.append(float(loss) / world)
            state = zgraph.full_state_dict(model)
            out[(reentrant, stage)] = {"losses": losses, "params": state, "rng": torch.get_rng_state()}
    return out


def split_stages(rank: int, world: int) -> dict:
    return stages(rank, world, split=True)


class GPTBlock(nn.Module):
    """A pre-norm transformer block as users write it: causal SDPA with ``dropout_p``, dropout on both residuals."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(0.1))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        rows, seq, dim = x.shape
        q, k, v = (t.view(rows, seq, self.heads, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(dim, -1))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(rows, seq, dim)))
        return x + self.mlp(self.ln2(x))


class GPTNet(nn.Module):
    """Embedding dropout outside the checkpointed blocks, two checkpointed ``GPTBlock``s, a head (issue 40)."""

    VOCAB, SEQ = 32, 8

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.embed = nn.Embedding(self.VOCAB, 16)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(GPTBlock() for _ in range(2))
        self.head = nn.Linear(16, self.VOCAB)

    def forward(self, idx):
        h = self.drop(self.embed(idx))
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def gpt_step(model, opt, idx, labels):
    loss = F.cross_entropy(model(idx).flatten(0, 1), labels.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def gpt_batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(0, GPTNet.VOCAB, (4, GPTNet.SEQ), generator=g) for _ in range(2)) for _ in range(n)]


def gpt_adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def gpt_eager(reentrant: bool, world: int = 1) -> dict:
    """Eager PyTorch on the global batches, each of ``world`` rank slices drawing from the step's starting state
    (as ranks seeded alike do): the loss and generator state after every step, the final parameters."""
    model = GPTNet(reentrant)
    opt = gpt_adamw(model)
    losses, states = [], []
    for idx, labels in gpt_batches():
        start, parts = torch.get_rng_state(), []
        for rows, row_labels in zip(idx.chunk(world), labels.chunk(world)):
            torch.set_rng_state(start)
            parts.append(F.cross_entropy(model(rows).flatten(0, 1), row_labels.flatten()))
        loss = sum(parts) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        states.append(torch.get_rng_state())
    return {"losses": losses, "rng": states, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def gpt_zgraph(config: zgraph.Config, reentrant: bool, rank: int = 0, world: int = 1) -> dict:
    """``gpt_eager``'s quantities for zgraph's step under ``config`` on this rank's slice of each batch (the loss
    the mean over ranks)."""
    model = GPTNet(reentrant)
    opt = gpt_adamw(model)
    step = zgraph.distribute(config)(gpt_step)
    losses, states = [], []
    for idx, labels in gpt_batches():
        loss = step(model, opt, idx.chunk(world)[rank], labels.chunk(world)[rank]).detach().clone()
        if world > 1:
            dist.all_reduce(loss)
        losses.append(float(loss) / world)
        states.append(torch.get_rng_state())
    return {"losses": losses, "rng": states, "params": zgraph.full_state_dict(model)}


def inductor_gpt(rank: int, world: int) -> dict:
    """``GPTNet`` under inductor at stage 3 on every rank, both checkpoint forms."""
    config = zgraph.Config(stage=3, backend="inductor", param_persistence_threshold=0)
    return {reentrant: gpt_zgraph(config, reentrant, rank, world) for reentrant in (True, False)}


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())
