"""A residual MLP of four blocks trained with pipeline parallelism (``Config.pipeline_parallel``) against eager
PyTorch on the whole batch, and the workers of ``test_pipeline.py``: every rank runs the same cases; each returns
its losses, the parameters its stages own, and their largest distance from eager's after the steps."""

from __future__ import annotations

import copy
import functools
import gc
import tempfile
from collections.abc import Callable

import torch
import torch.nn.functional as F
from dist_harness import all_gather_values, run_named
from torch import nn

import zgraph
from zgraph.runtime.memory import LiveTensorBytes, state_bytes

STEPS = 3
BATCH = 8
LR = 1e-2


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class Net(nn.Module):
    def __init__(self, d: int = 8, blocks: int = 4, classes: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(blocks)])
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def step_of(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], set_to_none: bool = True) -> Callable:
    """The training step of a loss ``loss_fn(logits, labels)``, zeroing the gradients with ``set_to_none``."""

    def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return loss.detach()

    return step


step = step_of(F.cross_entropy)
LOSSES = {
    "sum": lambda logits, y: F.cross_entropy(logits, y, reduction="sum"),
    "token_mean": lambda logits, y: F.cross_entropy(logits, y.masked_fill(y == 0, -100)),  # uneven counts
    "scaled_mean": lambda logits, y: 0.5 * F.mse_loss(logits, F.one_hot(y, 3).float()) + logits.pow(2).mean(),
    # a token mean and a masked sum over the labels' count (its smoothing term): both counted before the schedule
    "label_smoothing": lambda logits, y: F.cross_entropy(logits, y.masked_fill(y == 0, -100), label_smoothing=0.1),
    "masked_mean": lambda logits, y: (logits.sum(-1) * (y > 0)).sum() / (y > 0).sum(),  # a ratio over a count
    "token_mean_plus_sum": lambda logits, y: F.cross_entropy(logits, y) + 1e-3 * logits.pow(2).sum(),
    "complement_count": lambda logits, y: _smoothed_over_kept(logits, y.masked_fill(y == 0, -100)),
}


def _smoothed_over_kept(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Label smoothing as Hugging Face's ``LabelSmoother`` writes it: sums over the labels kept, divided by the
    number of labels less the number ignored (``m.numel() - m.sum()``), and by it times the classes."""
    ignored = labels.eq(-100).unsqueeze(-1)
    log_probs = -F.log_softmax(logits, dim=-1)
    nll = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).masked_fill(ignored, 0.0)
    smooth = log_probs.sum(-1, keepdim=True).masked_fill(ignored, 0.0)
    kept = ignored.numel() - ignored.long().sum()
    return 0.9 * nll.sum() / kept + 0.1 * smooth.sum() / (kept * logits.shape[-1])


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 4, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(STEPS)]


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=LR),
    # its momentum buffers are made in its first step, each by the rank whose stage updates the parameter
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9),
}


def train(
    make: Callable[[], nn.Module] = Net,
    loss: str = "",
    set_to_none: bool = True,
    optimizer: str = "adamw",
    **config: object,
) -> dict:
    """Eager and pipelined runs of the same steps of ``make()``: losses, and for the parameters this rank's stages
    update, the largest distance between the two; ``set_to_none``: as the step's ``opt.zero_grad`` is called;
    ``optimizer``: a key of ``OPTIMIZERS``."""
    eager_model = make()
    model = copy.deepcopy(eager_model)
    eager_opt, opt = OPTIMIZERS[optimizer](eager_model.parameters()), OPTIMIZERS[optimizer](model.parameters())
    run = step_of(LOSSES[loss] if loss else F.cross_entropy, set_to_none)
    compiled = zgraph.distribute(zgraph.Config(**{"backend": "eager", **config}))(run)
    want, got = [], []
    for x, y in batches():
        want.append(run(eager_model, eager_opt, x, y))
        got.append(compiled(model, opt, x, y))
    owned = [role.name for name, gm in compiled.graphs.items() if name.endswith(".update") for role in _params(gm)]
    eager = dict(eager_model.named_parameters())
    distance = max((p - eager[name]).abs().max().item() for name, p in model.named_parameters() if name in owned)
    stage = next(iter(compiled._dispatch.last.pipeline.stages.values()))  # this rank's first stage
    parts = ("forward", "backward", "input_grad", "weight_grad", "update")
    backends = {name: getattr(stage, name).backend for name in parts}
    plan = compiled.memory_plan.chosen.changes if compiled.memory_plan is not None else None
    return {"want": want, "got": got, "owned": owned, "distance": distance, "backends": backends, "plan": plan}


def _params(gm: torch.fx.GraphModule) -> list:
    from zgraph.graph import output_roles

    return [role for role in output_roles(gm) if role.kind == "param"]


def on_ranks(**config: object):
    def case(rank: int, world: int) -> list[dict]:
        return all_gather_values(train(pipeline_parallel=world, **config))

    return case


gpipe = on_ranks(schedule="gpipe", microbatches=4)
one_f_one_b = on_ranks(schedule="1f1b", microbatches=4)
zb_h1 = on_ranks(schedule="zb_h1", microbatches=4)
interleaved = on_ranks(schedule="interleaved_1f1b", pipeline_virtual_stages=2, microbatches=4)
split = on_ranks(schedule="1f1b", microbatches=2, pipeline_split=("blocks.1",))
sum_loss = on_ranks(schedule="1f1b", microbatches=4, loss="sum")
token_mean = on_ranks(schedule="zb_h1", microbatches=4, loss="token_mean")
kept_grads = on_ranks(schedule="1f1b", microbatches=2, set_to_none=False)  # zero_grad leaves zeros in .grad
momentum = on_ranks(schedule="1f1b", microbatches=2, optimizer="sgd_momentum")
inductor = on_ranks(schedule="zb_h1", microbatches=2, backend="inductor")
# one pipeline: ZeRO 3 has nothing to shard over within a stage (plan_stage: laid out as stage 0, parameters whole)
stage_three = on_ranks(schedule="1f1b", microbatches=2, stage=3, param_persistence_threshold=0)


def memory_budget(rank: int, world: int) -> list[dict]:
    """``Config.memory_budget`` between rank 0's peak with and without full remat, above rank 1's without it (1F1B
    holds more micro-batches on rank 0): the plan recomputes rank 0's blocks only (issue 42, item 4)."""
    pipeline = {"pipeline_parallel": world, "schedule": "1f1b", "microbatches": 4}
    none, full = (budget_estimate(world, remat=remat, **pipeline) for remat in (None, "full"))
    budget = max(full.stages[0].peak_bytes, none.stages[1].peak_bytes)
    return all_gather_values({**train(memory_budget=budget, **pipeline), "budget": budget})


def budget_estimate(world: int, **config: object) -> zgraph.Estimate:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    compiled = zgraph.distribute(zgraph.Config(backend="eager", **config))(step)
    return compiled.estimate(model, opt, *batches()[0], world_size=world)


CLIP = 0.05  # below every step's gradient norm: each step clips


def clipped(rank: int, world: int) -> list[dict]:
    """``Config.max_grad_norm`` with pipelines (issue 42, item 2): SGD (its update follows the clip
    coefficient, which Adam's would mostly cancel) against ``clip_grad_norm_`` on the whole batch."""
    norms: list[float] = []
    config = {"pipeline_parallel": world, "schedule": "1f1b", "microbatches": 4, "max_grad_norm": CLIP}
    out = against(clipping_step(norms), SGD, batches(), **config)
    return all_gather_values({**out, "norms": norms})


SGD = functools.partial(torch.optim.SGD, lr=0.1)


def clipping_step(norms: list[float]) -> Callable:
    """Eager's step clipping to ``CLIP`` (``clip_grad_norm_``), each step's norm appended to ``norms``."""

    def eager(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return eager


OVERFLOW = zgraph.DynamicLossScale(init_scale=2.0**127, backoff_factor=2.0**-100, hysteresis=1)


def loss_scaled(rank: int, world: int) -> list[dict]:
    """Dynamic loss scaling with pipelines (issue 42, item 2): on the first step only stage 0's gradients overflow
    (its input weight's: a large input column; in eager on the whole batch too, and in each micro-batch: each is
    seeded with its share of the batch, and its contributions unscaled before they are summed), so every stage skips
    the update and the scale backs off on every rank; the next steps update. Against eager scaling by the same
    rule."""
    scales: list[float] = []
    skipped: list[bool] = []

    def eager(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scale = scales[-1] if scales else OVERFLOW.init_scale
        loss = F.cross_entropy(model(x), y)
        (loss.float() * scale).backward()
        grads = [p.grad for p in model.parameters()]
        skipped.append(not all(bool(torch.isfinite(g).all()) for g in grads))
        if skipped[-1]:
            scale = max(scale * OVERFLOW.backoff_factor, OVERFLOW.min_scale)
        else:
            for g in grads:
                g.mul_(1.0 / scale)
            opt.step()
        opt.zero_grad()
        scales.append(scale)
        return loss.detach()

    data = batches()
    data[0][0][:, 0] *= 1000
    adamw = functools.partial(torch.optim.AdamW, lr=LR)
    config = {"pipeline_parallel": world, "schedule": "1f1b", "microbatches": 2, "loss_scale": OVERFLOW}
    out = against(eager, adamw, data, **config)
    return all_gather_values({**out, "eager_scales": scales, "skipped": skipped})


def low_precision_states(rank: int, world: int) -> list[dict]:
    """bf16 optimizer states and full remat with pipelines (issue 42, item 2), against the same Config without
    pipelines on the whole batch (zgraph's bf16 states: the update in float32, rounded once when stored)."""
    options = {"optimizer_state_dtype": torch.bfloat16, "remat": "full"}
    reference = zgraph.distribute(zgraph.Config(backend="eager", **options))(step)
    adamw = functools.partial(torch.optim.AdamW, lr=LR)
    config = {"pipeline_parallel": world, "schedule": "1f1b", "microbatches": 4, **options}
    return all_gather_values(against(reference, adamw, batches(), **config))


def against(eager: Callable, make_opt: Callable, data: list, **config: object) -> dict:
    """The pipelined ``step`` and ``eager`` (a step of the same signature) on the same batches: losses, the
    parameters this rank's stages update and their largest distance from eager's, the loss scale after each step,
    the dtypes of the optimizer states (but ``step``)."""
    eager_model = Net()
    model = copy.deepcopy(eager_model)
    eager_opt, opt = make_opt(eager_model.parameters()), make_opt(model.parameters())
    compiled = zgraph.distribute(zgraph.Config(**{"backend": "eager", **config}))(step)
    want, got, scales = [], [], []
    for x, y in data:
        want.append(eager(eager_model, eager_opt, x, y))
        got.append(compiled(model, opt, x, y))
        scales.append(float(getattr(opt, "_zgraph_loss_scale", {}).get("scale", 0.0)))
    owned = [role.name for name, gm in compiled.graphs.items() if name.endswith(".update") for role in _params(gm)]
    eager_params = dict(eager_model.named_parameters())
    distance = max((p - eager_params[n]).abs().max().item() for n, p in model.named_parameters() if n in owned)
    dtypes = sorted({str(v.dtype) for state in opt.state.values() for k, v in state.items() if k != "step"})
    return {"want": want, "got": got, "owned": owned, "distance": distance, "scales": scales, "state_dtypes": dtypes}


def varying_lengths(rank: int, world: int) -> list[dict]:
    """The demo GPT (2 blocks, a stage each, 1F1B, 2 micro-batches) on sequences of 8, 12, 5 and 12 tokens (a
    quarter of the labels ignored): each step's loss and the parameters a rank's stage owns against eager's, and
    how many times the step was captured."""
    from zgraph.demos.models import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    eager_model = GPT(GPTConfig(vocab=32, d_model=16, layers=2, heads=2, seq=16))
    model = copy.deepcopy(eager_model)
    eager_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager_model, model))
    run = step_of(lm_loss)
    config = zgraph.Config(backend="eager", pipeline_parallel=world, schedule="1f1b", microbatches=2)
    compiled = zgraph.distribute(config)(run)
    g = torch.Generator().manual_seed(1)
    want, got = [], []
    for length in (8, 12, 5, 12):
        ids = torch.randint(0, 32, (4, length), generator=g)
        labels = ids.masked_fill(torch.rand(4, length, generator=g) < 0.25, -100)
        want.append(run(eager_model, eager_opt, ids, labels))
        got.append(compiled(model, opt, ids, labels))
    eager = dict(eager_model.named_parameters())
    owned = {n: p for n, p in model.named_parameters() if p.device.type != "meta"}
    distance = max((p - eager[n]).abs().max().item() for n, p in owned.items())
    result = {"want": want, "got": got, "owned": sorted(owned), "distance": distance}
    return all_gather_values({**result, "variants": compiled._dispatch.variants()})


def different_rows(rank: int, world: int) -> list[str]:
    """Each rank of the pipeline passes rows of its own (a sampler's share per rank): the error each raises, and
    whether the parameters it holds are as they were and its optimizer's state a fresh one's."""
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    compiled = zgraph.distribute(zgraph.Config(backend="eager", pipeline_parallel=world, microbatches=2))(step)
    x, y = batches()[rank]
    try:
        compiled(model, opt, x, y)
        error = "no error"
    except zgraph.RankMismatchError as e:
        error = str(e)
    kept = all(torch.equal(p, before[n]) for n, p in model.named_parameters() if p.device.type != "meta")
    held = [v for state in opt.state.values() for v in state.values() if v.device.type != "meta"]
    fresh = not any(v.any() for v in held)  # zgraph binds its stage's state as zeros, step 0
    return all_gather_values({"error": error, "kept": kept and fresh})


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named cases; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())


def stage_state(rank: int, world: int) -> dict:
    """Each rank holds its stages' parameters and optimizer state only (1F1B, 3 steps); the whole model still
    comes out of ``zgraph.full_state_dict``, ``zgraph.gather`` and ``zgraph.save`` (loaded into a fresh model, and
    into the pipelined model after a 4th step, which then trains on as eager from the checkpoint)."""
    eager_model, tracker = Net(), LiveTensorBytes()
    with tracker:
        model = copy.deepcopy(eager_model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        config = zgraph.Config(backend="eager", pipeline_parallel=world, schedule="1f1b", microbatches=4)
        compiled = zgraph.distribute(config)(step)
        for x, y in batches():
            del_me = compiled(model, opt, x, y)
        del del_me
        gc.collect()
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=LR)
    for x, y in batches():
        step(eager_model, eager_opt, x, y)
    owned = [role.name for name, gm in compiled.graphs.items() if name.endswith(".update") for role in _params(gm)]
    out: dict = {"owned": owned, "state": state_bytes(model, opt), "whole": state_bytes(eager_model, eager_opt)}
    out["tracked"] = tracker.current
    out["distance"] = max(
        (p - eager_model.get_parameter(n)).abs().max().item() for n, p in model.named_parameters() if n in owned
    )
    full, full_opt = zgraph.full_state_dict(model, opt)
    out["full"] = _distance(full, eager_model.state_dict())
    out["full_opt"] = _distance(_by_name(full_opt, model), _by_name(eager_opt.state_dict(), eager_model))
    x = batches()[0][0]
    with zgraph.gather(model):
        out["gathered"] = (model(x) - eager_model(x)).abs().max().item()
    out["after_gather"] = state_bytes(model, opt)
    path = all_gather_values(tempfile.mkdtemp() if rank == 0 else None)[0]
    zgraph.save(f"{path}/ckpt", model, opt)
    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
    zgraph.load(f"{path}/ckpt", fresh, fresh_opt)
    out["loaded"] = _distance(fresh.state_dict(), eager_model.state_dict())
    out["loaded_opt"] = _distance(
        _by_name(fresh_opt.state_dict(), fresh), _by_name(eager_opt.state_dict(), eager_model)
    )
    zgraph.save_pretrained(model, f"{path}/hf")
    exported = Net()
    zgraph.load_pretrained(exported, f"{path}/hf")
    out["exported"] = _distance(exported.state_dict(), eager_model.state_dict())
    x, y = batches()[0]
    compiled(model, opt, x, y)  # a 4th step: the state moves on from the checkpoint's
    zgraph.load_pretrained(model, f"{path}/hf")  # the weights alone, into the placed model
    out["pretrained"] = _distance(zgraph.full_state_dict(model), eager_model.state_dict())
    zgraph.load(f"{path}/ckpt", model, opt)  # into the placed model: each rank reads its own stages' tensors
    out["after_load"] = state_bytes(model, opt)
    reloaded, reloaded_opt = zgraph.full_state_dict(model, opt)
    out["reloaded"] = _distance(reloaded, eager_model.state_dict())
    out["reloaded_opt"] = _distance(_by_name(reloaded_opt, model), _by_name(eager_opt.state_dict(), eager_model))
    compiled(model, opt, x, y)
    step(eager_model, eager_opt, x, y)
    out["continued"] = _distance(zgraph.full_state_dict(model), eager_model.state_dict())
    return all_gather_values(out)


def _by_name(optim_state: dict, model: nn.Module) -> dict[str, torch.Tensor]:
    """An optimizer's ``state_dict()`` state as ``{"<param name>.<field>": tensor}``."""
    names = [n for n, _ in model.named_parameters()]
    return {f"{names[i]}.{k}": v for i, fields in optim_state["state"].items() for k, v in fields.items()}


def _distance(got: dict, want: dict) -> float:
    """The largest difference between two dicts of tensors with the same keys (inf if the keys differ)."""
    if sorted(got) != sorted(want):
        return float("inf")
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)
