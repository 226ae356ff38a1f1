"""A DeepSpeed JSON's ``"auto"`` values filled from ``TrainingArguments``, as transformers' DeepSpeed integration
fills them (``HfTrainerDeepSpeedConfig.trainer_config_process`` and ``trainer_config_finalize``, transformers 5),
on plain dicts: this file imports neither transformers nor DeepSpeed (``"auto"``: ``zgraph.deepspeed.values``).

A value that is not ``"auto"`` and differs from the argument it stands for is a mismatch, refused with every
mismatch named, as transformers refuses it. What is filled when the trainer is built (``fill_from_arguments``):
batch sizes, ``gradient_accumulation_steps``, ``gradient_clipping``, the optimizer's ``lr`` / ``betas`` / ``eps``
/ ``weight_decay``, the scheduler's ``warmup_min_lr`` / ``warmup_max_lr``, ``fp16`` / ``bf16.enabled``, and the
hidden-size-based ZeRO sizes; what needs the number of training steps (``fill_schedule``): the scheduler's
``total_num_steps`` and ``warmup_num_steps``.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from typing import Any

from zgraph.deepspeed.values import is_auto

_HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


class _Filler:
    """One config being filled; mismatches are collected and raised together (``check``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.mismatches: list[str] = []

    def _node(self, key: str) -> tuple[dict[str, Any] | None, str]:
        node: Any = self.config
        *path, last = key.split(".")
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        return (node if isinstance(node, dict) else None), last

    def is_auto(self, key: str) -> bool:
        node, last = self._node(key)
        return node is not None and is_auto(node.get(last))

    def fill(self, key: str, value: Any, argument: str | None = None) -> None:
        """``"auto"`` becomes ``value``; another value must equal it (unless ``argument`` is None: fill only)."""
        node, last = self._node(key)
        if node is None:
            return
        if is_auto(node.get(last)):
            node[last] = value
        elif argument is not None and node.get(last) is not None and node[last] != value:
            self.mismatches.append(f"- ds {key}={node[last]} vs hf {argument}={value}")

    def check(self) -> None:
        if self.mismatches:
            raise ValueError(
                "DeepSpeed config values mismatch the TrainingArguments:\n"
                + "\n".join(self.mismatches)
                + "\nSet these DeepSpeed config values to 'auto' (or to the arguments' values)."
            )


def load(source: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A deep copy of a DeepSpeed config (a mapping, or the path of a JSON file)."""
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    with open(source) as f:
        return json.load(f)


def fill_from_arguments(config: dict[str, Any], args: Any, model: Any) -> dict[str, Any]:
    """``config`` (changed in place, and returned) with the ``"auto"`` values the arguments and the model give."""
    filler = _Filler(config)
    accumulation = args.gradient_accumulation_steps
    filler.fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size")
    filler.fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    total = args.world_size * args.per_device_train_batch_size * accumulation
    filler.fill("train_batch_size", total, "train_batch_size (calculated)")
    filler.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    filler.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    filler.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    filler.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    filler.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    filler.fill("scheduler.params.warmup_min_lr", 0)
    filler.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    filler.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    filler.fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    _fill_hidden_size(filler, model)
    filler.check()
    return config


def _fill_hidden_size(filler: _Filler, model: Any) -> None:
    if not any(filler.is_auto(key) for key in _HIDDEN_SIZE_KEYS):
        return
    hidden = _hidden_size(getattr(model, "config", None))
    if hidden is None:
        raise ValueError(
            "DeepSpeed config: the model's config has no hidden_size (or hidden_sizes) to fill "
            f"{[k for k in _HIDDEN_SIZE_KEYS if filler.is_auto(k)]} from; give these keys numbers"
        )
    filler.fill("zero_optimization.reduce_bucket_size", hidden * hidden)
    filler.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
    filler.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)


def _hidden_size(config: Any) -> int | None:
    for source in (config, getattr(config, "text_config", None)):
        if hasattr(source, "hidden_size"):
            return source.hidden_size
        if hasattr(source, "hidden_sizes"):
            return max(source.hidden_sizes)
    return None


def fill_schedule(config: dict[str, Any], args: Any, num_training_steps: int) -> dict[str, Any]:
    """``config`` (in place) with the scheduler's step counts: ``total_num_steps``, ``warmup_num_steps``."""
    filler = _Filler(config)
    filler.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
    warmup = max(1, args.get_warmup_steps(num_training_steps))
    filler.fill("scheduler.params.warmup_num_steps", warmup, "warmup_steps")
    filler.check()
    return config


def without_accumulation(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config for ``Config.from_deepspeed``: the trainer writes the micro-batch loop into its step, so
    ``gradient_accumulation_steps`` (already matched with the arguments) is not zgraph's to refuse."""
    return {k: v for k, v in config.items() if k != "gradient_accumulation_steps"}
