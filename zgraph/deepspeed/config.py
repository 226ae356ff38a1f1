"""``zgraph.Config.from_deepspeed``: read a DeepSpeed 0.19.8 JSON config as a ``zgraph.Config``.

Every key DeepSpeed 0.19.8 reads is accounted for (``zgraph.deepspeed.keys`` lists them with the reasons): a key
with a zgraph meaning becomes a ``Config`` field, a key whose behaviour zgraph has anyway (or that only concerns
DeepSpeed's engine, such as logging) is accepted, and a key zgraph cannot honour raises ``ValueError`` naming it
and saying why — never silently dropped. Values are read strictly (``zgraph.deepspeed.values``): ``"false"`` is
not false, ``2.9`` is not a stage, ``inf`` is not a loss scale. A missing key means DeepSpeed's default; Hugging
Face's ``"auto"`` means the same (DeepSpeed drops ``"auto"`` values too), except for bucket sizes, where it is
zgraph's ``"auto"`` (sized from the cost model).

Mapping (DeepSpeed → zgraph):

- ``zero_optimization.stage`` → ``stage``; ``reduce_bucket_size``, ``allgather_bucket_size``,
  ``prefetch_bucket_size`` (DeepSpeed counts elements) → ``reduce_bucket_bytes``, ``allgather_bucket_bytes``,
  ``prefetch_bytes`` (bytes: elements × the size of the dtype that moves); ``param_persistence_threshold`` →
  ``param_persistence_threshold`` (same default, 100000). Each ``stage3_``-prefixed name is DeepSpeed's alias of
  the same field. ``max_reuse_distance`` → ``max_reuse_distance`` (elements; left out, DeepSpeed's default
  1e9, ``DEEPSPEED_MAX_REUSE_DISTANCE``: every parameter of a model under a billion is gathered once per step). Bucket
  sizes left out are zgraph's ``"auto"`` (DeepSpeed's fixed defaults, 5e8 / 5e8 / 5e7
  elements, are tuned for its own engine; they change speed, not results).
- ``bf16.enabled`` (or the old ``bfloat16`` section) → ``param_dtype=torch.bfloat16`` (compute in bf16, fp32
  master weights), unless ``torch_autocast`` is enabled (then autocast picks compute dtypes and the parameters
  keep the master dtype); ``bf16_master_weights_and_grads`` → ``master_dtype``; ``bf16_optimizer_states`` →
  ``optimizer_state_dtype``.
- ``fp16.enabled`` → ``param_dtype=torch.float16`` (same rule) with ``loss_scale``: ``fp16.loss_scale`` 0 (the
  default) is dynamic scaling with ``initial_scale_power`` (16), ``loss_scale_window`` (1000), ``hysteresis`` (2),
  ``min_loss_scale`` (1); another value a static scale. ``fp16_master_weights_and_grads`` →
  ``master_dtype=torch.float16``.
- ``torch_autocast.enabled`` / ``dtype`` → ``autocast_dtype`` (bfloat16 when no dtype is given; DeepSpeed then
  uses the device's autocast default, float16 on CUDA: give the dtype to be explicit).
- ``gradient_clipping`` → ``max_grad_norm``: left out, DeepSpeed's default 1.0 (``GRADIENT_CLIPPING_DEFAULT``);
  0: none. ``communication_data_type`` → ``reduce_dtype``.
- The ``optimizer`` and ``scheduler`` sections are ignored here: ``zgraph.optimizer_from_deepspeed`` builds them.

- ``zero_optimization.offload_optimizer`` / ``offload_param``: ``device`` (``"none"``, ``"cpu"``, ``"nvme"``) →
  ``offload_optimizer`` / ``offload_params``; ``nvme_path`` → ``offload_dir``; ``offload_optimizer.ratio`` →
  ``offload_fraction``; ``pin_memory``, ``buffer_count``, ``buffer_size``, ``max_in_cpu``, ``pipeline_read`` /
  ``pipeline_write``, ``fast_init`` are accepted with no effect (``zgraph.deepspeed.keys.OFFLOAD_ACCEPTED`` says
  why). ``Config`` then checks them as for any Config (stage >= 1, a directory for ``"nvme"``...).

Rejected: ``gradient_accumulation_steps`` above 1 (write the micro-batch loop in the step), features zgraph does not
have (quantized weights or gradients, ZeRO++ hierarchical partitions, pipeline or tensor parallelism, DeepSpeed's own
activation checkpointing...), keys DeepSpeed 0.19.8 removed (``amp``, ``sparse_gradients``..., with DeepSpeed's
reason) unless they say "off", and keys DeepSpeed does not have.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, TypedDict

import torch

from zgraph.deepspeed import keys
from zgraph.deepspeed.values import boolean, choice, dtype, integer, is_auto, number, section, unknown

DEEPSPEED_MAX_REUSE_DISTANCE = 1_000_000_000
"""DeepSpeed's default ``stage3_max_reuse_distance`` (elements), applied when a DeepSpeed config leaves it out."""

_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class DynamicLossScaleArgs(TypedDict):
    """The keyword arguments of ``zgraph.DynamicLossScale`` an fp16 section with dynamic scaling stands for: the
    ``loss_scale`` field is returned as these, plain values, and ``Config.from_deepspeed`` builds the object."""

    init_scale: float
    growth_interval: int
    hysteresis: int
    min_scale: float


def load_json(source: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A DeepSpeed config as a dict: a mapping copied, or a JSON file's top-level object."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{os.fspath(source)}: a DeepSpeed config is a JSON object, got {type(data).__name__}")
        return data
    raise ValueError(f"Config.from_deepspeed expects a dict or a path to a JSON file, got {type(source).__name__}")


def _flag(where: str, data: Mapping[str, Any], key: str, default: bool = False) -> bool:
    """A boolean key; ``"auto"`` or absent is DeepSpeed's default."""
    value = data.get(key, default)
    return default if is_auto(value) else boolean(f"{where}.{key}", value)


def _int(where: str, data: Mapping[str, Any], key: str, default: int, minimum: int = 0) -> int:
    value = data.get(key, default)
    return default if is_auto(value) else integer(f"{where}.{key}", value, minimum=minimum)


def config_fields_from_deepspeed(source: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """The ``zgraph.Config`` fields a DeepSpeed config (a dict or a JSON file) stands for (module docstring), as
    plain values: a dynamic ``loss_scale`` is a ``DynamicLossScaleArgs`` dict, which ``Config.from_deepspeed``
    turns into a ``zgraph.DynamicLossScale``."""
    data = load_json(source)
    keys.check_top_level(data)
    fields: dict[str, Any] = {}
    _read_autocast(data, fields)
    _read_precision(data, fields)
    clip = data.get("gradient_clipping", keys.GRADIENT_CLIPPING_DEFAULT)
    clip = keys.GRADIENT_CLIPPING_DEFAULT if is_auto(clip) else number("gradient_clipping", clip, minimum=0)
    fields["max_grad_norm"] = clip if clip > 0 else None
    comm = data.get("communication_data_type")
    if comm is not None and not is_auto(comm):
        if not isinstance(comm, str):
            choice("communication_data_type", comm, tuple(_COMM_DTYPES))
        fields["reduce_dtype"] = _COMM_DTYPES[choice("communication_data_type", comm.lower(), tuple(_COMM_DTYPES))]
    _read_zero(data, fields)
    return fields


def _read_autocast(data: Mapping[str, Any], fields: dict[str, Any]) -> None:
    autocast = section("torch_autocast", data.get("torch_autocast"))
    unknown("torch_autocast", set(autocast) - {"enabled", "dtype", "lower_precision_safe_modules"})
    modules = autocast.get("lower_precision_safe_modules")
    if modules is not None and not (isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
        raise ValueError(
            f"DeepSpeed config torch_autocast.lower_precision_safe_modules: expected a list of module class "
            f"names, got {modules!r}"
        )
    if _flag("torch_autocast", autocast, "enabled"):
        value = autocast.get("dtype")
        fields["autocast_dtype"] = torch.bfloat16 if value is None else dtype("torch_autocast.dtype", value)


def _read_precision(data: Mapping[str, Any], fields: dict[str, Any]) -> None:
    bf16_key = "bf16" if data.get("bf16") is not None else "bfloat16"
    bf16, fp16 = section(bf16_key, data.get(bf16_key)), section("fp16", data.get("fp16"))
    unknown(bf16_key, set(bf16) - keys.BF16_KEYS)
    unknown("fp16", set(fp16) - keys.FP16_KEYS - set(keys.FP16_RENAMED))
    for key, right in keys.FP16_RENAMED.items():
        if key in fp16:
            raise ValueError(f"DeepSpeed config fp16.{key}: DeepSpeed 0.19.8 spells it fp16.{right}")
    for key in ("immediate_grad_update", "check_grad_overflow"):
        _flag(bf16_key, bf16, key)
    bf16_on, fp16_on = _flag(bf16_key, bf16, "enabled"), _flag("fp16", fp16, "enabled")
    if bf16_on and fp16_on:
        raise ValueError("DeepSpeed config enables both bf16 and fp16; enable one (DeepSpeed rejects it too)")
    master_bf16 = _flag(bf16_key, bf16, "bf16_master_weights_and_grads")
    states_bf16 = _flag(bf16_key, bf16, "bf16_optimizer_states")
    if bf16_on:
        if "autocast_dtype" not in fields:
            fields["param_dtype"] = torch.bfloat16
        if master_bf16:
            fields["master_dtype"] = torch.bfloat16
        if states_bf16:
            fields["optimizer_state_dtype"] = torch.bfloat16
    scale = _read_loss_scale(fp16)
    if _flag("fp16", fp16, "auto_cast"):
        raise ValueError(
            "DeepSpeed config fp16.auto_cast=true (cast every floating input to fp16): zgraph does not cast the "
            "step's inputs; cast them in the step, or use torch_autocast, and remove the key"
        )
    if _flag("fp16", fp16, "consecutive_hysteresis"):
        raise ValueError(
            "DeepSpeed config fp16.consecutive_hysteresis=true: zgraph's DynamicLossScale refills hysteresis only "
            "when the scale grows (DeepSpeed's default, false); remove the key"
        )
    master_fp16 = _flag("fp16", fp16, "fp16_master_weights_and_grads")
    if fp16_on:
        if "autocast_dtype" not in fields:
            fields["param_dtype"] = torch.float16
        if master_fp16:
            fields["master_dtype"] = torch.float16
        fields["loss_scale"] = scale


def _read_loss_scale(fp16: Mapping[str, Any]) -> float | DynamicLossScaleArgs:
    """fp16's loss scale: a static scale (a float), or 0 (the default): dynamic, with DeepSpeed's defaults for the
    other keys (returned as ``DynamicLossScale``'s keyword arguments)."""
    scale = fp16.get("loss_scale", 0)
    scale = 0.0 if is_auto(scale) else number("fp16.loss_scale", scale, minimum=0)
    power = _int("fp16", fp16, "initial_scale_power", 16)
    window = _int("fp16", fp16, "loss_scale_window", 1000, minimum=1)
    hysteresis = _int("fp16", fp16, "hysteresis", 2, minimum=1)
    floor = fp16.get("min_loss_scale", 1)
    floor = 1.0 if is_auto(floor) else number("fp16.min_loss_scale", floor, positive=True)
    if scale > 0:
        return scale
    if floor > 2.0**power:
        raise ValueError(
            f"DeepSpeed config fp16.min_loss_scale={floor:g} is above the initial scale 2**{power}; lower it"
        )
    return DynamicLossScaleArgs(init_scale=2.0**power, growth_interval=window, hysteresis=hysteresis, min_scale=floor)


def _read_zero(data: Mapping[str, Any], fields: dict[str, Any]) -> None:
    raw = data.get("zero_optimization")
    if isinstance(raw, bool):  # DeepSpeed's deprecated form: true is stage 1, with top-level allgather_size
        zero = {"stage": int(raw)}
        if raw and "allgather_size" in data:
            zero["allgather_bucket_size"] = data["allgather_size"]
    else:
        zero = keys.check_zero(section("zero_optimization", raw))
    stage = zero.get("stage", 0)
    if not is_auto(stage):
        stage = integer("zero_optimization.stage", stage)
        if stage > 3:
            raise ValueError(f"DeepSpeed config zero_optimization.stage: expected 0, 1, 2 or 3, got {stage}")
        fields["stage"] = stage
    moved = fields.get("reduce_dtype") or fields.get("param_dtype") or torch.float32
    element = torch.empty((), dtype=moved).element_size()
    gathered = torch.empty((), dtype=fields.get("param_dtype") or torch.float32).element_size()
    sizes = {
        "reduce_bucket_size": ("reduce_bucket_bytes", element, 1),
        "allgather_bucket_size": ("allgather_bucket_bytes", gathered, 0),
        "prefetch_bucket_size": ("prefetch_bytes", gathered, 0),
        "param_persistence_threshold": ("param_persistence_threshold", 1, 0),
        "max_reuse_distance": ("max_reuse_distance", 1, 0),
    }
    for key, (field, size, minimum) in sizes.items():
        if key in zero and not is_auto(zero[key]):
            fields[field] = integer(f"zero_optimization.{key}", zero[key], minimum=minimum) * size
    fields.setdefault("max_reuse_distance", DEEPSPEED_MAX_REUSE_DISTANCE)
    hpz = zero.get("zero_hpz_partition_size", 1)
    hpz = 1 if is_auto(hpz) else integer("zero_optimization.zero_hpz_partition_size", hpz, minimum=1)
    if hpz > 1:  # ZeRO++ hpZ (1 is off); Config checks stage 3 and the world size
        fields["secondary_shard_group_size"] = hpz
    fields.update(keys.offload_fields(zero))
