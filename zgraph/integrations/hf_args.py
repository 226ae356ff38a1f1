"""What a ``ZGraphTrainer`` runs with: the TrainingArguments zgraph cannot honour, refused when the trainer is built
(each naming the option), and the zgraph ``Config`` (from a ``zgraph.Config``, a DeepSpeed JSON or the defaults)
with the clipping norm the trainer's step applies.

Clipping: the step clips with ``torch.nn.utils.clip_grad_norm_`` (the global norm over every rank's shards, which
Trainer logs as ``grad_norm``), at ``max_grad_norm`` — a DeepSpeed JSON's ``gradient_clipping`` (filled from
``max_grad_norm`` when ``"auto"``, DeepSpeed's 1.0 when absent), else the TrainingArguments'. The Config the step
is built with has ``max_grad_norm=None``, so nothing clips twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zgraph.config import Config
from zgraph.integrations import hf_deepspeed


@dataclass(frozen=True)
class TrainerSetup:
    """``config``: the step's Config; ``max_grad_norm``: the step's clipping norm (0: none); ``deepspeed``: the
    filled DeepSpeed JSON (its ``optimizer`` / ``scheduler`` sections build those), or None."""

    config: Config
    max_grad_norm: float
    deepspeed: dict[str, Any] | None


def refuse_arguments(args: Any, config: Config | None) -> None:
    """Raise ``ValueError`` naming the first TrainingArguments option a zgraph step cannot honour."""
    backend = config.backend if config is not None else None
    if args.deepspeed and args.fsdp:
        raise ValueError(
            "TrainingArguments: deepspeed and fsdp are both set; ZGraphTrainer reads deepspeed as zgraph's ZeRO "
            "config and shards the model itself: remove fsdp"
        )
    if args.fsdp:
        raise ValueError(
            f"TrainingArguments fsdp={args.fsdp!r}: zgraph shards the model itself (ZeRO stage 3 is FSDP's full "
            "sharding); remove fsdp and set the stage in the zgraph Config or the DeepSpeed JSON"
        )
    if args.torch_compile:
        how = (
            'the eager backend runs ops one by one; use Config(backend="inductor")'
            if backend == "eager"
            else ('zgraph compiles the whole step itself (Config(backend="inductor"))')
        )
        raise ValueError(f"TrainingArguments torch_compile=True cannot be honoured: {how}, and remove torch_compile")
    for name in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, name):
            raise ValueError(
                f"TrainingArguments {name}=True: Trainer casts the model itself for evaluation, which would cast "
                "zgraph's gathered parameters and write them back into the shards; remove it (evaluate under the "
                "zgraph Config's precision)"
            )
    if getattr(args, "parallelism_config", None) is not None:
        raise ValueError(
            "TrainingArguments parallelism_config: tensor, context and sequence parallelism are not zgraph's; "
            "zgraph shards data-parallel ranks (ZeRO): remove it"
        )
    if args.n_gpu > 1:
        raise ValueError(
            f"TrainingArguments: {args.n_gpu} GPUs in one process (torch.nn.DataParallel): run one process per "
            "GPU (torchrun, accelerate launch); zgraph shards across those ranks"
        )


def _refuse_precision(args: Any, config: Config) -> None:
    if args.fp16 and config.loss_scale is None:
        raise ValueError(
            "TrainingArguments fp16=True: Trainer scales fp16 losses with torch.amp.GradScaler, which a zgraph step "
            "cannot run; give ZGraphTrainer a zgraph.Config(param_dtype=torch.float16, loss_scale='dynamic') or a "
            "DeepSpeed JSON with an fp16 section"
        )


def setup(args: Any, config: Config | None, model: Any, options: dict[str, Any] | None = None) -> TrainerSetup:
    """The Config, clipping norm and filled DeepSpeed JSON a trainer with ``args`` and ``model`` runs with
    (``config``: the user's zgraph Config, or None; ``options``: Config fields set over it, or over what the
    DeepSpeed JSON gives — ``{"backend": "eager"}``, say)."""
    refuse_arguments(args, config.replace(**options) if config is not None and options else config)
    deepspeed = None
    if args.deepspeed:
        if config is not None:
            raise ValueError("ZGraphTrainer got both zgraph_config and TrainingArguments deepspeed: give one of them")
        deepspeed = hf_deepspeed.fill_from_arguments(hf_deepspeed.load(args.deepspeed), args, model)
        config = Config.from_deepspeed(hf_deepspeed.without_accumulation(deepspeed), **(options or {}))
        clip = config.max_grad_norm or 0.0
    else:
        config = (config if config is not None else Config()).replace(**(options or {}))
        if config.max_grad_norm is not None and config.max_grad_norm != args.max_grad_norm:
            raise ValueError(
                f"zgraph Config.max_grad_norm={config.max_grad_norm} and TrainingArguments "
                f"max_grad_norm={args.max_grad_norm} differ: the trainer clips once; make them equal"
            )
        clip = float(args.max_grad_norm or 0.0)
    _refuse_precision(args, config)
    if args.bf16 and config.param_dtype is None and config.autocast_dtype is None:
        config = config.replace(autocast_dtype=torch.bfloat16)  # Trainer's bf16 is autocast; zgraph runs it
    return TrainerSetup(config.replace(max_grad_norm=None), clip, deepspeed)
