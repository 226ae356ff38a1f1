"""A user's own accelerate loop (``accelerate_loop``) on a tiny GPT-2 (``hf_cases``' config, nothing downloaded):
run by ``ZGraphAccelerator`` at each ZeRO stage, by the plain ``Accelerator`` (DDP on spawned gloo ranks) and in
one process on the global batch, on the same data: ``gradient_accumulation_steps=2`` (``accelerator.accumulate``),
``accelerator.clip_grad_norm_`` at 1.0, AdamW, a cosine schedule with warm-up stepped once per optimizer step.

Each run records, per optimizer step, the mean over ranks of the micro-batches' losses, the gradient norm
``clip_grad_norm_`` returned and the learning rate; at the end the whole state dict and an evaluation loss.
"""

from __future__ import annotations

import os
from typing import Any

import hf_cases
import torch
import torch.distributed as dist
import trainer_hf_cases
from accelerate import Accelerator
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import get_cosine_schedule_with_warmup

import zgraph
from zgraph.integrations.accelerate import ZGraphAccelerator

PER_DEVICE = trainer_hf_cases.PER_DEVICE
ACCUMULATION = trainer_hf_cases.ACCUMULATION
STEPS = trainer_hf_cases.STEPS


def loader(per_device: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(trainer_hf_cases.dataset(), batch_size=per_device, shuffle=False)


def accelerate_loop(accelerator: Accelerator, model: nn.Module, data: torch.utils.data.DataLoader) -> dict[str, Any]:
    """The loop as accelerate's examples write it; with ZGraphAccelerator also the forward step's captures in
    training (``captures``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=STEPS)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    series: dict[str, list[float]] = {"loss": [], "grad_norm": [], "learning_rate": []}
    total = torch.zeros(())
    model.train()
    for batch in data:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            total += loss.detach() / ACCUMULATION
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                series["grad_norm"].append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
                series["learning_rate"].append(scheduler.get_last_lr()[0])
            optimizer.step()
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            series["loss"].append(float(accelerator.reduce(total, reduction="mean")))
            total = torch.zeros(())
    forward_step = getattr(model.forward, "zgraph_step", None)
    captures = None if forward_step is None else forward_step._dispatch.variants()
    model.eval()
    with torch.no_grad():
        batch = next(iter(data))
        eval_loss = float(accelerator.reduce(model(**batch).loss.detach(), reduction="mean"))
    state = {k: v.detach().clone() for k, v in zgraph.full_state_dict(accelerator.unwrap_model(model)).items()}
    return {**series, "state": state, "eval_loss": eval_loss, "captures": captures}


def plain(world: int) -> dict[str, Any]:
    """The plain ``Accelerator``: DDP on ``world`` ranks, or one process (world 1) on the global batch."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION, step_scheduler_with_optimizer=False)
    return accelerate_loop(accelerator, hf_cases.gpt2(), loader(PER_DEVICE * (2 // world)))


def zero(stage: int) -> dict[str, Any]:
    config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0)
    accelerator = ZGraphAccelerator(
        config=config, cpu=True, gradient_accumulation_steps=ACCUMULATION, step_scheduler_with_optimizer=False
    )
    model = hf_cases.gpt2()
    result = accelerate_loop(accelerator, model, loader(PER_DEVICE))
    params = list(model.parameters())
    return {**result, "sharded": sum(isinstance(p, DTensor) for p in params), "parameters": len(params)}


def run_plain(rank: int, world: int, out_path: str) -> None:
    """Worker: the plain accelerate loop on ``world`` ranks; rank 0 saves the result."""
    result = hf_cases._guarded(plain, world)
    if rank == 0:
        torch.save(result, out_path)


def run_zero(rank: int, world: int, out_path: str, stages: list[int]) -> None:
    """Worker: the ZGraphAccelerator loop at each stage; rank 0 saves ``{stage: result}``."""
    results = {}
    for stage in stages:
        results[stage] = hf_cases._guarded(zero, stage)
        dist.barrier()
    if rank == 0:
        torch.save(results, out_path)


def saved(out: str) -> dict[str, Any]:
    """Stage 3: ``save_state`` after 2 optimizer steps, ``load_state`` into a fresh accelerator and model;
    ``save_model`` read back by ``from_pretrained``."""
    config = zgraph.Config(stage=3, backend="eager", param_persistence_threshold=0)
    first = ZGraphAccelerator(config=config, cpu=True, step_scheduler_with_optimizer=False)
    model = hf_cases.gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = first.prepare(model, optimizer)
    batch = {"input_ids": trainer_hf_cases.dataset().ids[:2], "labels": trainer_hf_cases.dataset().ids[:2]}
    for _ in range(2):
        first.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        before = model(**batch).loss
        unwrapped = first.unwrap_model(model, keep_fp32_wrapper=False)  # the same model, still run by zgraph
        after = unwrapped(**batch).loss
    first.save_state(os.path.join(out, "state"))
    first.save_model(model, os.path.join(out, "model"))
    second = ZGraphAccelerator(config=config, cpu=True)
    fresh = hf_cases.gpt2()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh, fresh_opt = second.prepare(fresh, fresh_opt)
    second.load_state(os.path.join(out, "state"))
    loaded = type(hf_cases.gpt2()).from_pretrained(os.path.join(out, "model"))
    whole = {k: v.detach().clone() for k, v in zgraph.full_state_dict(model).items()}
    return {
        "state": whole,
        "resumed": {k: v.detach().clone() for k, v in zgraph.full_state_dict(fresh).items()},
        "optimizer_steps": [s["step"].item() for s in zgraph.full_state_dict(fresh, fresh_opt)[1]["state"].values()],
        "loaded": {k: v.detach().clone() for k, v in loaded.state_dict().items()},
        "get_state_dict": {k: v.detach().clone() for k, v in second.get_state_dict(fresh).items()},
        "unwrapped_loss": (before, after),
    }


def run_saved(rank: int, world: int, out_path: str) -> None:
    result = hf_cases._guarded(saved, os.path.join(os.path.dirname(out_path), "saved"))
    if rank == 0:
        torch.save(result, out_path)
