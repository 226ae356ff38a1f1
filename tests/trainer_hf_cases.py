"""Tiny GPT-2 and Llama (``hf_cases``' configs, nothing downloaded) trained by ``ZGraphTrainer`` and by the plain
``transformers.Trainer`` (DDP on spawned gloo ranks; one process on the global batch), on the same data, with
``gradient_accumulation_steps=2``, ``max_grad_norm=1.0`` and a cosine schedule with warm-up.

Every run logs each optimizer step (``logging_steps=1``): ``loss`` (Trainer's mean over ranks), ``grad_norm``
and ``learning_rate``, taken from ``trainer.state.log_history``; the final whole state dict is
``zgraph.full_state_dict`` of the model (the plain model's ``state_dict()`` for Trainer).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import hf_cases
import hf_parity
import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainingArguments

import zgraph
from zgraph.integrations.transformers import ZGraphTrainer, ZGraphTrainingArguments

transformers.logging.set_verbosity_error()

PER_DEVICE = 2  # rows per rank and micro-batch; one process on the global batch takes PER_DEVICE * world
ACCUMULATION = 2
STEPS = hf_parity.STEPS  # optimizer steps
SEQ = hf_cases.SEQ
MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": hf_cases.gpt2, "llama": hf_cases.llama}


class Rows(torch.utils.data.Dataset):
    """``n`` causal-LM rows (``input_ids`` = ``labels``), seeded."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, hf_cases.VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def dataset(world: int = 2) -> Rows:
    return Rows(STEPS * ACCUMULATION * PER_DEVICE * world)


def arguments(out: str, per_device: int = PER_DEVICE, cls: type = TrainingArguments, **changes: Any) -> Any:
    settings: dict[str, Any] = dict(
        output_dir=out,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=ACCUMULATION,
        max_grad_norm=1.0,
        learning_rate=1e-2,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        dataloader_drop_last=True,
        seed=0,
        data_seed=0,
        optim="adamw_torch",
    )
    settings.update(changes)
    return cls(**settings)


def history(trainer: Trainer) -> dict[str, list[float]]:
    rows = [r for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    return {key: [float(r[key]) for r in rows] for key in ("loss", "grad_norm", "learning_rate")}


def whole_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in zgraph.full_state_dict(model).items()}


def plain(name: str, out: str, world: int) -> dict:
    """Trainer as it is: DDP on ``world`` ranks, or one process (world 1) on the global batch."""
    model = MODELS[name]()
    args = arguments(out, per_device=PER_DEVICE * (2 // world))
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train()
    return {**history(trainer), "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


# A DeepSpeed JSON as transformers' examples write them: "auto" wherever the Trainer's arguments know the value
# (batch sizes, accumulation, clipping, precision, the optimizer's hyper-parameters, the hidden-size-based ZeRO
# sizes). Its optimizer section builds torch's AdamW with the arguments' values, the scheduler is Trainer's cosine:
# the run must equal Trainer + DDP.
DEEPSPEED = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
    },
}


def zero(name: str, stage: int | str, out: str, **changes: Any) -> dict:
    """ZGraphTrainer at ``stage``, or (``stage="deepspeed"``) configured by ``DEEPSPEED``."""
    model = MODELS[name]()
    if stage == "deepspeed":
        args = arguments(out, cls=ZGraphTrainingArguments, deepspeed=DEEPSPEED, **changes)
        trainer = ZGraphTrainer(model=model, args=args, train_dataset=dataset(), zgraph_options={"backend": "eager"})
    else:
        config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0)
        args = arguments(out, **changes)
        trainer = ZGraphTrainer(model=model, args=args, train_dataset=dataset(), zgraph_config=config)
    trainer.train()
    params = list(trainer.model.parameters())
    sharded = {"sharded": sum(isinstance(p, DTensor) for p in params), "parameters": len(params)}
    return {**history(trainer), "state": whole_state(trainer.model), **sharded}


def _guarded(fn: Callable, *args: Any, **kwargs: Any) -> dict:
    try:
        return fn(*args, **kwargs)
    except Exception:
        return {"error": traceback.format_exc()}


def run_plain(rank: int, world: int, out_path: str, name: str) -> None:
    """Worker: Trainer on ``world`` ranks (DDP when 2); rank 0 saves the result."""
    result = _guarded(plain, name, os.path.join(os.path.dirname(out_path), f"plain-{world}"), world)
    if rank == 0:
        torch.save(result, out_path)


def run_zero(rank: int, world: int, out_path: str, name: str, stages: list[int | str]) -> None:
    """Worker: ZGraphTrainer at each stage (or ``"deepspeed"``); rank 0 saves ``{stage: result}``."""
    results = {}
    for stage in stages:
        results[stage] = _guarded(zero, name, stage, os.path.join(os.path.dirname(out_path), f"zero-{stage}"))
        dist.barrier()
    if rank == 0:
        torch.save(results, out_path)


def _trainer(name: str, stage: int, out: str, **changes: Any) -> ZGraphTrainer:
    config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0)
    args = arguments(out, **changes)
    return ZGraphTrainer(model=MODELS[name](), args=args, train_dataset=dataset(), zgraph_config=config)


def resume(name: str, stage: int, out: str) -> dict:
    """A run saving a checkpoint every 2 steps; a fresh trainer resumed from step 2's; ``save_model`` read back by
    ``from_pretrained``; evaluation of the trained (sharded) model and of the one read back."""
    full = _trainer(name, stage, out, save_strategy="steps", save_steps=2)
    full.train()
    eval_loss = full.evaluate(eval_dataset=dataset())["eval_loss"]
    full.save_model(os.path.join(out, "final"))
    resumed = _trainer(name, stage, out)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    loaded = MODELS[name]().from_pretrained(os.path.join(out, "final"))
    plain_eval = Trainer(model=loaded, args=arguments(os.path.join(out, "plain")))
    return {
        "full": {**history(full), "state": whole_state(full.model)},
        "resumed": {**history(resumed), "state": whole_state(resumed.model)},
        "checkpoints": sorted(os.listdir(out)),
        "in_checkpoint": sorted(os.listdir(os.path.join(out, "checkpoint-2"))),
        "loaded": {k: v.detach().clone() for k, v in loaded.state_dict().items()},
        "eval_loss": eval_loss,
        "loaded_eval_loss": plain_eval.evaluate(eval_dataset=dataset())["eval_loss"],
    }


def run_resume(rank: int, world: int, out_path: str, name: str, stage: int) -> None:
    """Worker: ``resume`` on every rank; rank 0 saves the result."""
    result = _guarded(resume, name, stage, os.path.join(os.path.dirname(out_path), f"resume-{stage}"))
    if rank == 0:
        torch.save(result, out_path)


def meta_loaded(name: str, out: str) -> dict:
    """The same pretrained files trained at stage 3 from ``from_pretrained`` and from a model built on the meta
    device whose shards ``zgraph.load_pretrained`` filled (no rank ever holds the whole model)."""
    pretrained = os.path.join(out, "pretrained")
    if dist.get_rank() == 0:
        MODELS[name]().save_pretrained(pretrained)
    dist.barrier()
    config = zgraph.Config(stage=3, backend="eager", param_persistence_threshold=0)
    runs = {}
    for how in ("from_pretrained", "meta"):
        if how == "meta":
            template = MODELS[name]()  # its config only
            with torch.device("meta"):
                model = type(template)(template.config)
            zgraph.load_pretrained(model, pretrained, config=config)
        else:
            model = MODELS[name]().from_pretrained(pretrained)
        args = arguments(os.path.join(out, how))
        trainer = ZGraphTrainer(model=model, args=args, train_dataset=dataset(), zgraph_config=config)
        trainer.train()
        runs[how] = {**history(trainer), "state": whole_state(trainer.model)}
    return runs


def run_meta(rank: int, world: int, out_path: str, name: str) -> None:
    """Worker: ``meta_loaded``; rank 0 saves the result."""
    result = _guarded(meta_loaded, name, os.path.join(os.path.dirname(out_path), "meta"))
    if rank == 0:
        torch.save(result, out_path)


def bf16_losses(name: str, out: str) -> dict[str, list[float]]:
    """One process, ``bf16=True``: Trainer (accelerate's autocast) and ZGraphTrainer (zgraph's autocast)."""
    plain_trainer = Trainer(model=MODELS[name](), args=arguments(out + "/plain", bf16=True), train_dataset=dataset())
    plain_trainer.train()
    config = zgraph.Config(backend="eager")
    args = arguments(out + "/zgraph", bf16=True)
    trainer = ZGraphTrainer(model=MODELS[name](), args=args, train_dataset=dataset(), zgraph_config=config)
    trainer.train()
    assert trainer.zgraph_setup.config.autocast_dtype == torch.bfloat16
    return {"plain": history(plain_trainer)["loss"], "zgraph": history(trainer)["loss"]}
