"""Mixed precision, fp16 loss scaling and clipping on several ranks (run by test_precision.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_named
from torch import nn

import zgraph
from zgraph.graph import collective_kind

STEPS = 8
GLOBAL_BATCH = 8
LR = 1e-2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 5))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def clipped_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
    opt.step()
    opt.zero_grad()
    return loss, norm


def plain_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def reference(param_dtype: torch.dtype | None) -> dict:
    """One process, the global batch: eager PyTorch with the parameters (and inputs) used in ``param_dtype``,
    as FSDP2's mixed precision uses them; gradients land on the float32 parameters."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for x, y in batches():
        if param_dtype is None:
            out = model(x)
        else:
            params = {n: p.to(param_dtype) for n, p in model.named_parameters()}
            out = torch.func.functional_call(model, params, (x.to(param_dtype),))
        loss = F.cross_entropy(out, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach().float()))
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _local(batch: tuple, rank: int, world: int) -> tuple:
    n = GLOBAL_BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def _collectives(step: zgraph.DistributedStep) -> list[tuple[str, str, str]]:
    out = []
    for node in step.graphs["final"].graph.nodes:
        kind = collective_kind(node)
        if kind is not None:
            source = node.args[0][0] if isinstance(node.args[0], (list, tuple)) else node.args[0]
            out.append((kind, str(source.meta["val"].dtype), node.meta.get("phase")))
    return out


def mixed(rank: int, world: int) -> dict:
    """bf16 compute / fp32 master (and fp32 as control), stages 0-3, with clip_grad_norm_ in the step."""
    out = {}
    for dtype in (None, torch.bfloat16):
        for stage in range(4):
            model = make_model()
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0, param_dtype=dtype)
            step = zgraph.distribute(config)(clipped_step)
            losses, norms = [], []
            for batch in batches():
                loss, norm = step(model, opt, *_local(batch, rank, world))
                total = loss.detach().float().clone()
                dist.all_reduce(total)
                losses.append(float(total) / world)
                norms.append(float(norm))
            out[(str(dtype), stage)] = {
                "losses": losses,
                "norms": norms,
                "params": zgraph.full_state_dict(model),
                "param_dtypes": {n: str(p.dtype) for n, p in model.named_parameters()},
                "collectives": _collectives(step),
            }
    return out


def low_precision_state(rank: int, world: int) -> dict:
    """bf16 master weights, gradients and optimizer states (DeepSpeed's bf16_master_weights_and_grads +
    bf16_optimizer_states) with bf16 compute, stage 3: what is stored, in which dtype."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    config = zgraph.Config(
        stage=3,
        backend="eager",
        param_persistence_threshold=0,
        param_dtype=torch.bfloat16,
        master_dtype=torch.bfloat16,
        optimizer_state_dtype=torch.bfloat16,
    )

    def step(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # leaves .grad (zeros) to look at
        return loss

    compiled = zgraph.distribute(config)(step)
    losses = [float(compiled(model, opt, *_local(b, rank, world))) for b in batches()]
    state = {}
    for name, p in model.named_parameters():
        state[name] = {
            "param": (type(p).__name__, str(p.dtype), str(p._local_tensor.dtype)),
            "grad": (type(p.grad).__name__, str(p.grad.dtype)),
            "optimizer": {k: str(v.dtype) for k, v in opt.state[p].items()},
        }
    return {"losses": losses, "state": state, "collectives": _collectives(compiled)}


def overflow(rank: int, world: int) -> dict:
    """fp16 compute with dynamic loss scaling; on call 3 rank 1's batch holds an inf: every rank must skip
    that update (parameters and optimizer state unchanged) and lower the scale."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    policy = zgraph.DynamicLossScale(init_scale=2.0**10, hysteresis=1, growth_interval=100)
    config = zgraph.Config(
        stage=2, backend="eager", param_persistence_threshold=0, param_dtype=torch.float16, loss_scale=policy
    )
    step = zgraph.distribute(config)(plain_step)
    records = []
    for i, batch in enumerate(batches()[:5]):
        x, y = _local(batch, rank, world)
        if i == 3 and rank == 1:
            x = x.clone()
            x[0, 0] = float("inf")
        before = zgraph.full_state_dict(model, opt)
        before = ({k: v.clone() for k, v in before[0].items()}, _clone_optim(before[1]))
        step(model, opt, x, y)
        after = zgraph.full_state_dict(model, opt)
        changed = any(not torch.equal(after[0][k], v) for k, v in before[0].items())
        state_changed = any(
            not torch.equal(after[1]["state"][i][k], v)
            for i, s in before[1]["state"].items()
            for k, v in s.items()
            if isinstance(v, torch.Tensor)
        )
        records.append(
            {"changed": changed, "state_changed": state_changed, "scale": float(opt._zgraph_loss_scale["scale"])}
        )
    return {"records": records, "collectives": _collectives(step)}


def _clone_optim(state: dict) -> dict:
    return {
        "state": {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def max_grad_norm(rank: int, world: int) -> dict:
    """``Config.max_grad_norm`` on sharded gradients (stage 2) vs eager clip_grad_norm_ on the global batch."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    config = zgraph.Config(stage=2, backend="eager", param_persistence_threshold=0, max_grad_norm=0.3)
    step = zgraph.distribute(config)(plain_step)
    for batch in batches():
        step(model, opt, *_local(batch, rank, world))
    return {"params": zgraph.full_state_dict(model), "collectives": _collectives(step)}


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())
