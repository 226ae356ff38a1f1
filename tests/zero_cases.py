"""Training-step cases run under ZeRO stages 0-3 on several ranks, and eagerly on one process for reference.

Each case builds its state for a given world size (so shapes can depend on it), defines a plain PyTorch step,
and a list of *global* batches. Rank ``r`` of ``W`` gets slice ``r`` of every batch tensor (dim 0); the eager
reference runs the same step on the whole batch. Every loss is a mean over its batch, so the average of the
ranks' losses and gradients is the global-batch loss and gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zgraph
from zgraph.demos.models import GPT, GPTConfig, lm_loss

STEPS = 10
GLOBAL_BATCH = 8  # divisible by every world size tested (1, 2, 4)


def slice_batch(batch: tuple, rank: int, world: int) -> tuple:
    """Rank ``rank``'s share of every tensor in the batch (dim 0)."""
    out = []
    for t in batch:
        if isinstance(t, torch.Tensor):
            n = t.shape[0] // world
            out.append(t[rank * n : (rank + 1) * n])
        else:
            out.append(t)
    return tuple(out)


@dataclass(frozen=True)
class Case:
    """A step to check: ``make(world) -> state tuple``, ``step(*state, *batch) -> loss``, global batches."""

    name: str
    make: Callable[[int], tuple]
    step: Callable
    batches: Callable[[], list[tuple]]
    local: Callable[[tuple, int, int], tuple] = slice_batch
    between: Callable[[tuple], None] | None = None
    steps: int = STEPS
    extra: dict = field(default_factory=dict)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _classification_batches(d_in: int = 8, classes: int = 4, seed: int = 1) -> list[tuple]:
    g = _gen(seed)
    return [
        (torch.randn(GLOBAL_BATCH, d_in, generator=g), torch.randint(0, classes, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def mlp(seed: int = 0, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


def classify_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


# --------------------------------------------------------------------------------------------------- cases
def _adamw(world):
    model = mlp()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _groups(cls: type, **kw: Any) -> Callable[[int], tuple]:
    def make(world: int) -> tuple:
        model = mlp()
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
        groups = [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]
        return model, cls(groups, **kw)

    return make


def _loss_outside_step(model, opt, x, y):
    def loss_fn(logits, target):
        return F.cross_entropy(logits, target) + 0.1 * logits.pow(2).mean()

    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _nonscalar_step(model, opt, x, g):
    out = model(x)
    out.backward(gradient=g)
    opt.step()
    opt.zero_grad()
    return out.detach().pow(2).mean()  # a mean over the batch, as the ranks' losses are averaged


def _nonscalar_batches() -> list[tuple]:
    g = _gen(2)
    # ``g`` is d(loss)/d(out) of a mean over the global batch: 1/B of a per-sample weight
    return [
        (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g) / GLOBAL_BATCH)
        for _ in range(STEPS)
    ]


def _nonscalar_local(batch: tuple, rank: int, world: int) -> tuple:
    x, g = slice_batch(batch, rank, world)
    return x, g * world  # the same per-sample weight, over the rank's 1/world of the batch


def _two_backward_step(model, opt, x, y):
    half = x.shape[0] // 2
    loss1 = F.cross_entropy(model(x[:half]), y[:half]) / 2
    loss1.backward()
    loss2 = F.cross_entropy(model(x[half:]), y[half:]) / 2
    loss2.backward()
    opt.step()
    opt.zero_grad()
    return loss1 + loss2


def _accumulation_step(model, opt, x, y):
    micro = 2
    total = 0.0
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        loss = F.cross_entropy(model(xs), ys) / micro
        loss.backward()
        total = total + loss.detach()
    opt.step()
    opt.zero_grad()
    return total


def _autograd_grad_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    params = list(model.parameters())
    for p, g in zip(params, torch.autograd.grad(loss, params)):
        p.grad = g
    opt.step()
    opt.zero_grad()
    return loss


def _two_models(world):
    encoder, head = mlp(0, 8, 16, 8), mlp(1, 8, 8, 4)
    return (
        encoder,
        head,
        torch.optim.AdamW(encoder.parameters(), lr=1e-2),
        torch.optim.SGD(head.parameters(), lr=0.05, momentum=0.9),
    )


def _two_models_step(encoder, head, opt_e, opt_h, x, y):
    z = encoder(x)
    loss = F.cross_entropy(head(z), y) + 0.01 * z.pow(2).mean()
    loss.backward()
    opt_e.step()
    opt_h.step()
    opt_e.zero_grad()
    opt_h.zero_grad()
    return loss


def _frozen(world):
    model = mlp()
    model[0].weight.requires_grad_(False)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


class EmaNet(nn.Module):
    """A model with buffers updated in forward: a call counter and an EMA of its weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("ema", self.fc.weight.detach().clone())

    def forward(self, x):
        self.calls += 1
        with torch.no_grad():
            self.ema.mul_(0.9).add_(self.fc.weight, alpha=0.1)
        return self.fc(x)


def _buffers(world):
    model = EmaNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _scheduled(world):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _scheduled_step(model, opt, scheduler, x, y):
    return classify_step(model, opt, x, y)


class Awkward(nn.Module):
    """Parameters of shapes no world size divides: (16, 17), (7, 15), a bias of 5, a vocab of 4W + 1, and two
    0-d learnable scalars (never sharded: all-reduced, together in one bucket where they share one)."""

    def __init__(self, world: int):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(4 * world + 1, 17)
        self.l1 = nn.Linear(17, 16)
        self.l2 = nn.Linear(16, 15)
        self.l3 = nn.Linear(15, 7)
        self.l4 = nn.Linear(7, 5)
        self.temperature = nn.Parameter(torch.tensor(0.7))
        self.scale = nn.Parameter(torch.tensor(1.3))

    def forward(self, ids):
        h = self.emb(ids).mean(1) * self.scale
        return self.l4(torch.tanh(self.l3(torch.tanh(self.l2(torch.tanh(self.l1(h))))))) / self.temperature


def _awkward(world):
    model = Awkward(world)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _token_batches(vocab_for_world: int = 1, classes: int = 5) -> list[tuple]:
    g = _gen(3)
    return [
        (torch.randint(0, 5, (GLOBAL_BATCH, 6), generator=g), torch.randint(0, classes, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


TIED = GPTConfig(vocab=37, d_model=16, layers=1, heads=2, seq=8, tie_weights=True)


def _tied(world):
    # SGD, not Adam: in attention the key bias gets a zero gradient up to rounding noise, and Adam's
    # normalisation turns noise that differs between any two reduction orders into lr-sized steps.
    torch.manual_seed(0)
    model = GPT(TIED)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _lm_step(model, opt, idx, tgt):
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _lm_batches() -> list[tuple]:
    g = _gen(4)
    return [
        (
            torch.randint(0, TIED.vocab, (GLOBAL_BATCH, TIED.seq), generator=g),
            torch.randint(0, TIED.vocab, (GLOBAL_BATCH, TIED.seq), generator=g),
        )
        for _ in range(STEPS)
    ]


CASES: dict[str, Case] = {
    c.name: c
    for c in [
        Case("adamw", _adamw, classify_step, _classification_batches),
        Case("loss_fn_outside", _adamw, _loss_outside_step, _classification_batches),
        Case("nonscalar_backward", _adamw, _nonscalar_step, _nonscalar_batches, local=_nonscalar_local),
        Case("two_backward_calls", _adamw, _two_backward_step, _classification_batches),
        Case("accumulation_loop", _adamw, _accumulation_step, _classification_batches),
        Case("autograd_grad", _adamw, _autograd_grad_step, _classification_batches),
        Case("two_models", _two_models, _two_models_step, _classification_batches),
        Case("frozen", _frozen, classify_step, _classification_batches),
        Case("buffers", _buffers, classify_step, _classification_batches),
        Case("sgd_groups", _groups(torch.optim.SGD, lr=0.05, momentum=0.9), classify_step, _classification_batches),
        Case("adam_groups", _groups(torch.optim.Adam, lr=1e-2), classify_step, _classification_batches),
        Case("adamw_groups", _groups(torch.optim.AdamW, lr=1e-2), classify_step, _classification_batches),
        Case("lr_scheduler", _scheduled, _scheduled_step, _classification_batches, between=lambda s: s[2].step()),
        Case("awkward_shapes", _awkward, classify_step, _token_batches),
        Case("tied_weights", _tied, _lm_step, _lm_batches),
    ]
}


def _models_and_optimizers(state: tuple) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    return (
        [m for m in state if isinstance(m, nn.Module)],
        [o for o in state if isinstance(o, torch.optim.Optimizer)],
    )


def reference(case: Case, world: int, rotate: bool = False) -> dict:
    """The case run eagerly on one process with the global batches. ``rotate``: each batch's rank slices
    rotated by one (rank 1's rows first): the same sums in another order, which measures how far float
    reduction order alone moves the results on this machine."""
    state = case.make(world)
    losses = []
    for batch in case.batches():
        if rotate:
            batch = tuple(_rotate_ranks(t, world) for t in batch)
        losses.append(float(case.step(*state, *batch).detach()))
        if case.between:
            case.between(state)
    models, opts = _models_and_optimizers(state)
    return {
        "losses": losses,
        "models": [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models],
        "optimizers": [o.state_dict() for o in opts],
    }


def _rotate_ranks(t: object, world: int) -> object:
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or world == 1 or t.shape[0] % world:
        return t
    chunks = t.chunk(world)
    return torch.cat([*chunks[1:], chunks[0]])


def run_case(case: Case, stage: int, rank: int, world: int, backend: str = "eager", **fields: Any) -> dict:
    """The case under zgraph on this rank (``fields``: more ``zgraph.Config`` fields); returns (on every rank)
    the averaged losses and whole state."""
    state = case.make(world)
    # every parameter sharded in stage 3, however small: the cases check sharding, not the threshold
    config = zgraph.Config(stage=stage, backend=backend, param_persistence_threshold=0, **fields)
    step = zgraph.distribute(config)(case.step)
    losses = []
    for batch in case.batches():
        loss = step(*state, *case.local(batch, rank, world)).detach().clone()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
        if case.between:
            case.between(state)
    models, opts = _models_and_optimizers(state)
    whole_models = [zgraph.full_state_dict(model) for model in models]
    whole_opts = []
    for opt in opts:
        owner = next(m for m in models if {id(p) for p in m.parameters()} >= {id(p) for p in _params(opt)})
        whole_opts.append(zgraph.full_state_dict(owner, opt)[1])
    return {"losses": losses, "models": whole_models, "optimizers": whole_opts, "step": step}


def _params(opt: torch.optim.Optimizer) -> list:
    return [p for g in opt.param_groups for p in g["params"]]


def run_cases(rank: int, world: int, out_path: str, stages: list[int], names: list[str]) -> None:
    """Worker: run the named cases at each stage; rank 0 saves ``{(stage, name): result or error}``."""
    import traceback

    results: dict = {}
    for stage in stages:
        for name in names:
            try:
                result = run_case(CASES[name], stage, rank, world)
                result.pop("step")
                results[(stage, name)] = result
            except Exception:
                results[(stage, name)] = {"error": traceback.format_exc()}
    if rank == 0:
        torch.save(results, out_path)
