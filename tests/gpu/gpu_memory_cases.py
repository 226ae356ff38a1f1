"""The ranks' side of the GPU checks, continued: the ``fp16``, ``offload`` and ``estimate`` checks (what they check:
``gpu_cases``' docstring), which ``gpu_cases.run`` dispatches to by name. The set-up, the models, the batches and
the settings they share are ``gpu_cases``'; this module imports them from there (never the other way at import
time).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_cases import (
    ESTIMATE_BATCH,
    ESTIMATE_GPT,
    GLOBAL_BATCH,
    HOST_UPDATE,
    LR,
    OFFLOAD,
    OVERFLOW_CALL,
    STAGES,
    STEPS,
    config,
    generator,
    guarded,
    lm_batches,
    lm_step,
    local,
    make_model,
    zgraph_state,
)
from torch import Tensor, nn

import zgraph
from zgraph.demos.models import BENCH_GPT
from zgraph.runtime.memory import LiveTensorBytes, state_bytes


# ------------------------------------------------------------------------------------------------ fp16
def mlp(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 5)).to(device)


def classify_batches() -> list[tuple[Tensor, Tensor]]:
    g = generator(1)
    return [
        (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def classify_step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor) -> Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _changed(before: dict[str, Tensor], after: dict[str, Tensor], prefix: str) -> bool:
    return any(not torch.equal(after[k], v) for k, v in before.items() if k.startswith(prefix))


def fp16_run(
    rank: int, world: int, device: torch.device, stage: int, loss_scale: Any, overflow: bool
) -> list[dict[str, Any]]:
    """Per call: whether parameters / optimizer state changed, the scale after it, where the loss-scale state
    lives, this rank's loss. ``overflow``: the last rank's batch holds an ``inf`` at call ``OVERFLOW_CALL``."""
    model = mlp(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zgraph.distribute(config(stage, torch.float16, loss_scale=loss_scale))(classify_step)
    records = []
    for call, (x, y) in enumerate(classify_batches()):
        x, y = local(x, rank, world).to(device), local(y, rank, world).to(device)
        if overflow and call == OVERFLOW_CALL and rank == world - 1:
            x = x.clone()
            x[0, 0] = float("inf")
        before = zgraph_state(model, opt)
        loss = step(model, opt, x, y)
        after = zgraph_state(model, opt)
        scale = opt._zgraph_loss_scale
        records.append(
            {
                "params_changed": _changed(before, after, "param"),
                "state_changed": _changed(before, after, "opt"),
                "scale": float(scale["scale"]),
                "scale_devices": sorted({t.device.type for t in scale.values()}),
                "loss": float(loss.detach().float()),
            }
        )
    return records


def fp16(rank: int, world: int, device: torch.device) -> dict:
    policy = zgraph.DynamicLossScale(init_scale=2.0**10, hysteresis=1, growth_interval=100)
    out: dict[Any, Any] = {}
    for stage in STAGES:
        out[("overflow", stage)] = guarded(fp16_run, rank, world, device, stage, policy, True)
    for stage in (0, 3):
        out[("dynamic", stage)] = guarded(fp16_run, rank, world, device, stage, "dynamic", False)
    return out


# ------------------------------------------------------------------------------------------------ offload
def offload_run(rank: int, world: int, device: torch.device, stage: int, fields: dict[str, str]) -> dict:
    """This rank's losses, what it holds between steps, and the whole state after ``STEPS`` steps."""
    model = make_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step = zgraph.distribute(config(stage, **fields))(lm_step)
    losses = []
    for idx, tgt in lm_batches():
        loss = step(model, opt, local(idx, rank, world).to(device), local(tgt, rank, world).to(device))
        losses.append(loss.detach().float().item())
    gc.collect()
    held = state_bytes(model, opt)["total"]  # offloaded states and shards have released their device storage
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    shards = [getattr(t, "_local_tensor", t) for t in (*model.parameters(), *states)]
    on_device = sum(t.untyped_storage().nbytes() for t in shards if t.device.type != "cpu")  # the update on the host
    lines = [line.strip() for line in step.explain().splitlines() if "offload_" in line or "host memory" in line]
    return {
        "losses": losses,
        "held": held,
        "held_on_device": on_device,
        "explain": lines,
        "state": zgraph_state(model, opt),
    }


def offload(rank: int, world: int, device: torch.device) -> dict:
    out = {}
    for name, (stage, fields) in {**OFFLOAD, **HOST_UPDATE}.items():
        runs = {"plain": guarded(offload_run, rank, world, device, stage, {})}
        runs["offload"] = guarded(offload_run, rank, world, device, stage, fields)
        plain, off = runs["plain"], runs["offload"]
        equal = "error" not in plain and "error" not in off and plain["losses"] == off["losses"]
        equal = equal and plain["state"].keys() == off["state"].keys()
        equal = equal and all(torch.equal(v, off["state"][k]) for k, v in plain["state"].items())
        flag = torch.tensor([int(equal)], device=device)
        if world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        runs["every_rank_equal"] = bool(flag.item())
        out[name] = runs
    return out


# ------------------------------------------------------------------------------------------------ estimate
def estimate_cases(world: int) -> list[tuple[int, str]]:
    """``(stage, recipe)``: on one rank the stage changes nothing; on several, stages 1 and 3."""
    stages = (0,) if world == 1 else (1, 3)
    return [(stage, recipe) for stage in stages for recipe in ("fp32", "bf16")]


def estimate_one(rank: int, world: int, device: torch.device, stage: int, recipe: str) -> dict:
    """Two real calls (state and caches warm), the estimate of the next call, then that call measured.

    On CUDA the measured peak is ``max_memory_allocated`` over the call less what the device held at its start
    beyond the training state and the batch (cuBLAS workspaces and the like, which the estimate does not count:
    ``outside``); the raw peak is reported too. In the CPU rehearsal it is ``LiveTensorBytes``'s peak."""
    shape = ESTIMATE_GPT if device.type == "cuda" else BENCH_GPT
    model = make_model(device, shape)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    dtype = torch.bfloat16 if recipe == "bf16" else None
    fields = {"param_dtype": dtype} if dtype is not None else {}  # the bf16 recipe: norms kept in float32
    cfg = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0, **fields)
    step = zgraph.distribute(cfg)(lm_step)
    g = generator(100 + rank)
    idx = torch.randint(0, shape.vocab, (ESTIMATE_BATCH, shape.seq), generator=g).to(device)
    tgt = idx.roll(-1, dims=1)
    for _ in range(2):
        step(model, opt, idx, tgt)
    kwargs = {"device": device.type}  # the device whose kernels and allocator the estimate models
    estimated = step.estimate(model, opt, idx, tgt, **kwargs)
    gc.collect()
    held = state_bytes(model, opt)["total"]
    batch = idx.nbytes + tgt.nbytes
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(model, opt, idx, tgt)
        torch.cuda.synchronize(device)
        raw = torch.cuda.max_memory_allocated(device)
        outside = start - held - batch
    else:
        tracker = LiveTensorBytes()
        for t in [*model.parameters(), *model.buffers(), idx, tgt]:
            tracker.track(getattr(t, "_local_tensor", t))
        for s in opt.state.values():
            for v in s.values():
                if isinstance(v, Tensor):
                    tracker.track(getattr(v, "_local_tensor", v))
        with tracker:
            step(model, opt, idx, tgt)
        raw, outside = tracker.peak, 0
    return {
        "stage": stage,
        "recipe": recipe,
        "estimate_kwargs": kwargs,
        "estimated": estimated.peak_bytes,
        "estimated_state": dict(estimated.model_state_bytes),
        "peak_node": estimated.peak_node,
        "raw_peak": raw,
        "outside": outside,
        "measured": raw - outside,
        "held": held,
        "batch": batch,
    }


def estimate(rank: int, world: int, device: torch.device) -> dict:
    out = {}
    for stage, recipe in estimate_cases(world):
        out[(stage, recipe)] = guarded(estimate_one, rank, world, device, stage, recipe)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out
