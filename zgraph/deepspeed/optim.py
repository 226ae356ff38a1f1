"""``zgraph.optimizer_from_deepspeed``: the ``torch.optim`` optimizer and LR scheduler of a DeepSpeed config.

What DeepSpeed 0.19.8 builds (``DeepSpeedEngine._configure_basic_optimizer``, ``deepspeed/runtime/lr_schedules.py``):

- ``"Adam"`` / ``"AdamW"`` (any case): AdamW semantics (decoupled weight decay) unless ``adam_w_mode`` is false
  for ``"Adam"`` (then L2 weight decay, ``torch.optim.Adam``). Without ``torch_adam`` DeepSpeed builds its
  ``FusedAdam``, whose defaults zgraph keeps: ``lr`` 1e-3, ``betas`` (0.9, 0.999), ``eps`` 1e-8,
  ``weight_decay`` 0 (not torch AdamW's 0.01), bias correction on. With ``torch_adam: true`` it builds
  ``torch.optim.AdamW`` / ``Adam`` with torch's own defaults, and so does zgraph.
- ``"SGD"`` (DeepSpeed looks it up in ``torch.optim``, so the case matters): ``torch.optim.SGD``.
- Schedulers ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` with DeepSpeed's formulas, step for step
  (``scheduler.step()`` once per optimizer step, as DeepSpeed's engine calls it). Their ``state_dict`` is plain
  numbers and strings, so ``zgraph.save`` stores it as JSON.

Anything else (other optimizer or scheduler types, unknown parameters, ``max_grad_norm`` in the optimizer's
parameters, which DeepSpeed rejects too) raises ``ValueError`` naming it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from zgraph.deepspeed.config import load_json
from zgraph.deepspeed.values import boolean, choice, fail, integer, is_auto, number, section, unknown

_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad",
              "foreach", "fp32_optimizer_states"}  # fmt: skip
_SGD_KEYS = {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach"}
_SCHEDULER_KEYS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
    "WarmupDecayLR": {
        "total_num_steps",
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "last_batch_iteration",
    },  # fmt: skip
    "WarmupCosineLR": {
        "total_num_steps",
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
        "last_batch_iteration",
    },  # fmt: skip
}


def optimizer_from_deepspeed(
    config: Mapping[str, Any] | str | os.PathLike, params: Iterable[Any]
) -> tuple[torch.optim.Optimizer, LRScheduler | None]:
    """The optimizer and LR scheduler a DeepSpeed config's ``optimizer`` / ``scheduler`` sections build, for
    ``params`` (tensors or param-group dicts); the scheduler is None without a ``scheduler`` section. See
    ``zgraph.deepspeed.optim`` for what each type builds."""
    data = load_json(config)
    spec = section("optimizer", data.get("optimizer"))
    if not spec:
        raise ValueError("DeepSpeed config has no 'optimizer' section; optimizer_from_deepspeed needs one")
    unknown("optimizer", set(spec) - {"type", "params", "legacy_fusion"})
    if spec.get("legacy_fusion") not in (None, False):
        raise ValueError("DeepSpeed config optimizer.legacy_fusion: only false (the default) is supported")
    name = spec.get("type")
    args = {k: v for k, v in section("optimizer.params", spec.get("params")).items() if not is_auto(v)}
    if "max_grad_norm" in args:
        raise ValueError(
            "DeepSpeed config optimizer.params.max_grad_norm: use the top-level 'gradient_clipping' (DeepSpeed "
            "rejects it too); Config.from_deepspeed maps that to Config.max_grad_norm"
        )
    if isinstance(name, str) and name.lower() in ("adam", "adamw"):
        optimizer = _adam(name.lower(), args, params)
    elif name == "SGD":
        unknown("optimizer.params (SGD)", set(args) - _SGD_KEYS)
        optimizer = torch.optim.SGD(params, **_checked(args, "SGD"))
    else:
        raise ValueError(
            f"DeepSpeed config optimizer.type {name!r}: zgraph builds 'Adam', 'AdamW' and 'SGD'; build other "
            "optimizers with torch.optim yourself and remove the section"
        )
    scheduler_spec = section("scheduler", data.get("scheduler"))
    return optimizer, (_scheduler(scheduler_spec, optimizer) if scheduler_spec else None)


def scheduler_from_deepspeed(
    config: Mapping[str, Any] | str | os.PathLike, optimizer: torch.optim.Optimizer
) -> LRScheduler | None:
    """The LR scheduler a DeepSpeed config's ``scheduler`` section builds for an optimizer made elsewhere (None
    without the section): transformers' DeepSpeed integration pairs Trainer's optimizer with it."""
    spec = section("scheduler", load_json(config).get("scheduler"))
    return _scheduler(spec, optimizer) if spec else None


def _checked(args: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Optimizer arguments with strict types, named ``optimizer.params.<key>``."""
    out: dict[str, Any] = {}
    for key, value in args.items():
        where = f"optimizer.params.{key}"
        if key in ("nesterov", "maximize", "amsgrad"):
            out[key] = boolean(where, value)
        elif key == "foreach":
            out[key] = None if value is None else boolean(where, value)
        elif key == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise fail(where, "a list of two numbers", value)
            out[key] = tuple(number(where, b, minimum=0) for b in value)
            if not all(b < 1 for b in out[key]):
                raise fail(where, "two numbers below 1", value)
        else:
            out[key] = number(where, value, minimum=0)
    return out


def _adam(name: str, args: dict[str, Any], params: Iterable[Any]) -> torch.optim.Optimizer:
    unknown(f"optimizer.params ({name})", set(args) - _ADAM_KEYS)
    adam_w_mode = boolean("optimizer.params.adam_w_mode", args.pop("adam_w_mode", True))
    torch_adam = boolean("optimizer.params.torch_adam", args.pop("torch_adam", False))
    fp32_states = args.pop("fp32_optimizer_states", None)  # DeepSpeedCPUAdam's (offload only): no effect here
    if fp32_states is not None:
        boolean("optimizer.params.fp32_optimizer_states", fp32_states)
    decoupled = name == "adamw" or adam_w_mode
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    if torch_adam:  # DeepSpeed passes the rest to torch as it is
        return cls(params, **_checked(args, name))
    # FusedAdam: bias correction on/off, no amsgrad, no foreach; its defaults where torch's differ
    if not boolean("optimizer.params.bias_correction", args.pop("bias_correction", True)):
        raise ValueError("DeepSpeed config optimizer.params.bias_correction=false: torch.optim's Adam always corrects")
    if args.pop("amsgrad", False) is not False:
        raise ValueError("DeepSpeed config optimizer.params.amsgrad: DeepSpeed's FusedAdam rejects AMSGrad")
    if "foreach" in args:
        raise ValueError("DeepSpeed config optimizer.params.foreach: a torch_adam parameter (FusedAdam has none)")
    fused = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    return cls(params, **{**fused, **_checked(args, name)})


def _per_group(key: str, value: Any, groups: int) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"DeepSpeed config {key}: {len(value)} values for {groups} parameter groups")
        return [number(key, v, minimum=0) for v in value]
    return [number(key, value, minimum=0)] * groups


def _scheduler(spec: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> LRScheduler:
    unknown("scheduler", set(spec) - {"type", "params"})
    kind = spec.get("type")
    if kind not in _SCHEDULER_KEYS:
        raise ValueError(
            f"DeepSpeed config scheduler.type {kind!r}: zgraph builds {sorted(_SCHEDULER_KEYS)}; build other "
            "schedulers with torch.optim.lr_scheduler yourself and remove the section"
        )
    args = {k: v for k, v in section("scheduler.params", spec.get("params")).items() if not is_auto(v)}
    unknown(f"scheduler.params ({kind})", set(args) - _SCHEDULER_KEYS[kind])
    if kind != "WarmupLR" and "total_num_steps" not in args:
        raise ValueError(f"DeepSpeed config scheduler.params.total_num_steps: {kind} needs it")
    groups = len(optimizer.param_groups)
    where = "scheduler.params."
    settings = {
        "kind": kind,
        "warmup_num_steps": max(2, integer(where + "warmup_num_steps", args.get("warmup_num_steps", 1000), minimum=1)),
        "warmup_type": choice(where + "warmup_type", args.get("warmup_type", "log"), ("log", "linear")),
        "total_num_steps": integer(where + "total_num_steps", args.get("total_num_steps", 0)),
        "min_lrs": _per_group(where + "warmup_min_lr", args.get("warmup_min_lr", 0.0), groups),
        "max_lrs": None,
        "warmup_min_ratio": number(where + "warmup_min_ratio", args.get("warmup_min_ratio", 0.0), minimum=0),
        "cos_min_ratio": number(where + "cos_min_ratio", args.get("cos_min_ratio", 0.0001), minimum=0),
    }
    max_lr = args.get("warmup_max_lr", None if kind == "WarmupLR" else 0.001)  # WarmupLR: the groups' lr
    if max_lr is not None:
        settings["max_lrs"] = _per_group(where + "warmup_max_lr", max_lr, groups)
    last = integer(where + "last_batch_iteration", args.get("last_batch_iteration", -1), minimum=-1)
    return DeepSpeedWarmupSchedule(optimizer, settings, last_batch_iteration=last)


class DeepSpeedWarmupSchedule(LRScheduler):
    """DeepSpeed's ``WarmupLR`` / ``WarmupDecayLR`` / ``WarmupCosineLR`` as a torch ``LRScheduler``.

    DeepSpeed's ``last_batch_iteration`` is ``last_epoch - 1`` here: torch's scheduler steps once when it is
    built, DeepSpeed's sets the iteration -1 learning rate instead. Every attribute is a number, a string or a list
    of numbers, so ``state_dict()`` is JSON data.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, settings: Mapping[str, Any], last_batch_iteration: int = -1):
        self.kind = settings["kind"]
        self.warmup_num_steps = settings["warmup_num_steps"]
        self.warmup_type = settings["warmup_type"]
        self.total_num_steps = settings["total_num_steps"]
        self.warmup_min_ratio = settings["warmup_min_ratio"]
        self.cos_min_ratio = settings["cos_min_ratio"]
        self.min_lrs = list(settings["min_lrs"])
        given = settings["max_lrs"]
        self.max_lrs = list(given) if given is not None else [float(g["lr"]) for g in optimizer.param_groups]
        before = [g["lr"] for g in optimizer.param_groups]
        super().__init__(optimizer)
        if last_batch_iteration != -1:  # resuming: DeepSpeed leaves the groups' lr until the next step()
            for group, lr in zip(optimizer.param_groups, before):
                group["lr"] = lr
            self.last_epoch = last_batch_iteration + 1
            self._last_lr = list(before)

    def _warmup(self, iteration: int) -> float:
        if self.warmup_type == "log":
            return 1.0 / math.log(self.warmup_num_steps) * math.log(iteration + 1)
        return iteration / self.warmup_num_steps

    def get_lr(self) -> list[float]:
        """The learning rate of each group at DeepSpeed iteration ``last_epoch - 1``."""
        iteration = self.last_epoch - 1
        if self.kind == "WarmupCosineLR":
            if iteration < 0:
                return [0.0 for _ in self.base_lrs]
            return [base * self._cosine_ratio(iteration) for base in self.base_lrs]
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.warmup_num_steps:
            gamma = self._warmup(iteration)
        elif self.kind == "WarmupDecayLR":
            gamma = max(
                0.0,
                float(self.total_num_steps - iteration) / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
            )
        else:
            gamma = 1.0
        return [low + ((high - low) * gamma) for low, high in zip(self.min_lrs, self.max_lrs)]

    def _cosine_ratio(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup(iteration) * (1.0 - self.warmup_min_ratio)
        real_last_step = iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)
