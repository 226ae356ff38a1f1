"""``zgraph.Config.from_deepspeed``: read a DeepSpeed JSON config as a ``zgraph.Config``.

Every key is accounted for: a key with a zgraph meaning becomes a ``Config`` field, a key whose behaviour zgraph
has anyway (or that only concerns DeepSpeed's engine, such as logging) is accepted, and a key zgraph cannot honour
raises ``ValueError`` naming it and saying what to do instead — never silently dropped. Hugging Face's ``"auto"``
values leave zgraph's default.

Mapping (DeepSpeed → zgraph):

- ``zero_optimization.stage`` → ``stage``; ``reduce_bucket_size``, ``allgather_bucket_size``,
  ``stage3_prefetch_bucket_size`` (DeepSpeed counts elements) → ``reduce_bucket_bytes``,
  ``allgather_bucket_bytes``, ``prefetch_bytes`` (bytes: elements × the size of the dtype that moves);
  ``stage3_param_persistence_threshold`` → ``param_persistence_threshold``.
- ``bf16.enabled`` → ``param_dtype=torch.bfloat16`` (compute in bf16, fp32 master weights), unless
  ``torch_autocast`` is enabled (then autocast picks compute dtypes and the parameters keep the master dtype);
  ``bf16.bf16_master_weights_and_grads`` → ``master_dtype``; ``bf16.bf16_optimizer_states`` →
  ``optimizer_state_dtype``.
- ``fp16.enabled`` → ``param_dtype=torch.float16`` (same rule) with ``loss_scale``: ``fp16.loss_scale`` 0 (the
  default) is dynamic scaling with ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
  ``min_loss_scale``; another value a static scale. ``fp16.fp16_master_weights_and_gradients`` →
  ``master_dtype=torch.float16``.
- ``torch_autocast.enabled`` / ``dtype`` → ``autocast_dtype``.
- ``gradient_clipping`` → ``max_grad_norm`` (0: none). ``communication_data_type`` → ``reduce_dtype``.

Rejected: offload (``offload_optimizer`` / ``offload_param`` with a device), the ``optimizer`` and ``scheduler``
sections (a zgraph step uses the ``torch.optim`` objects it is given), ``gradient_accumulation_steps`` above 1
(write the micro-batch loop in the step), and features zgraph does not have (quantized weights or gradients,
ZeRO++ hierarchical partitions, activation checkpointing by config, sparse gradients...).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

# Keys accepted without effect: zgraph always does what they ask, or they only concern DeepSpeed's engine.
_ACCEPTED_TOP = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "dump_state",
    "prescale_gradients",
    "gradient_predivide_factor",
    "memory_breakdown",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "checkpoint",
    "data_types",
}
_ACCEPTED_ZERO = {
    "overlap_comm",
    "contiguous_gradients",
    "reduce_scatter",
    "allgather_partitions",
    "round_robin_gradients",
    "sub_group_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "elastic_checkpoint",
    "load_from_fp32_weights",
    "ignore_unused_parameters",
    "legacy_stage1",
    "cpu_offload",  # False only (checked below)
    "log_trace_cache_warnings",
    "use_all_reduce_for_fetch_params",
}
_REJECTED_ZERO = {
    "zero_quantized_weights": "quantized weights",
    "zero_quantized_nontrainable_weights": "quantized weights",
    "zero_quantized_gradients": "quantized gradients",
    "zero_hpz_partition_size": "ZeRO++ hierarchical partitioning",
    "mics_shard_size": "MiCS sharding",
}
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def _load(source: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{os.fspath(source)}: a DeepSpeed config is a JSON object, got {type(data).__name__}")
        return data
    raise ValueError(f"Config.from_deepspeed expects a dict or a path to a JSON file, got {type(source).__name__}")


def _auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _enabled(section: Mapping[str, Any]) -> bool:
    value = section.get("enabled", False)
    if _auto(value):
        return False  # Hugging Face fills "auto" from its own arguments; zgraph has none to read
    return bool(value)


def _dtype(name: str, value: Any) -> torch.dtype:
    dtype = _DTYPES.get(str(value).replace("torch.", "").lower())
    if dtype is None:
        raise ValueError(f"DeepSpeed config {name}: unknown dtype {value!r}; expected one of {sorted(_DTYPES)}")
    return dtype


def _unknown(where: str, keys: set[str]) -> None:
    if keys:
        raise ValueError(
            f"DeepSpeed config {where}: unknown key(s) {sorted(keys)}. zgraph accounts for every key it reads; "
            "remove the key, or map it to a zgraph.Config field yourself"
        )


def config_fields_from_deepspeed(source: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """The ``zgraph.Config`` fields a DeepSpeed config (a dict or a JSON file) stands for (module docstring)."""
    data = _load(source)
    fields: dict[str, Any] = {}
    handled = {"zero_optimization", "bf16", "fp16", "torch_autocast", "gradient_clipping", "communication_data_type"}
    for key in ("optimizer", "scheduler"):
        if key in data:
            raise ValueError(
                f"DeepSpeed config '{key}' section: a zgraph step uses the torch.optim optimizer and LR scheduler "
                f"it is given; build them in your script (e.g. torch.optim.AdamW(model.parameters(), lr=...)) and "
                f"remove the '{key}' section"
            )
    accumulation = data.get("gradient_accumulation_steps", 1)
    if not _auto(accumulation) and int(accumulation) != 1:
        raise ValueError(
            f"DeepSpeed config gradient_accumulation_steps={accumulation}: write the micro-batch loop inside the "
            "step (loss / n, backward per micro-batch, one opt.step()); zgraph compiles it as one graph"
        )
    handled.add("gradient_accumulation_steps")
    for key in ("activation_checkpointing", "sparse_gradients", "compression_training", "pipeline", "moe"):
        if data.get(key):
            raise ValueError(f"DeepSpeed config '{key}' is not supported by zgraph; remove it")
        handled.add(key)
    _unknown("top level", set(data) - handled - _ACCEPTED_TOP)

    autocast = data.get("torch_autocast") or {}
    _unknown("torch_autocast", set(autocast) - {"enabled", "dtype", "lower_precision_safe_modules"})
    if _enabled(autocast):
        fields["autocast_dtype"] = _dtype("torch_autocast.dtype", autocast.get("dtype", "bfloat16"))

    bf16, fp16 = data.get("bf16") or {}, data.get("fp16") or {}
    _unknown(
        "bf16",
        set(bf16) - {"enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states", "immediate_grad_update"},
    )
    fp16_keys = {
        "enabled",
        "auto_cast",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
        "fp16_master_weights_and_gradients",
    }
    _unknown("fp16", set(fp16) - fp16_keys)
    if _enabled(bf16) and _enabled(fp16):
        raise ValueError("DeepSpeed config enables both bf16 and fp16; enable one")
    if _enabled(bf16):
        if "autocast_dtype" not in fields:
            fields["param_dtype"] = torch.bfloat16
        if bf16.get("bf16_master_weights_and_grads"):
            fields["master_dtype"] = torch.bfloat16
        if bf16.get("bf16_optimizer_states"):
            fields["optimizer_state_dtype"] = torch.bfloat16
    if _enabled(fp16):
        if "autocast_dtype" not in fields:
            fields["param_dtype"] = torch.float16
        if fp16.get("fp16_master_weights_and_gradients"):
            fields["master_dtype"] = torch.float16
        from zgraph.config import DynamicLossScale

        scale = fp16.get("loss_scale", 0)
        if _auto(scale) or not scale:
            fields["loss_scale"] = DynamicLossScale(
                init_scale=2.0 ** int(fp16.get("initial_scale_power", 16)),
                growth_interval=int(fp16.get("loss_scale_window", 1000)),
                hysteresis=int(fp16.get("hysteresis", 2)),
                min_scale=float(fp16.get("min_loss_scale", 1)),
            )
        else:
            fields["loss_scale"] = float(scale)

    clip = data.get("gradient_clipping", 0)
    if not _auto(clip) and clip:
        fields["max_grad_norm"] = float(clip)
    if data.get("communication_data_type") is not None:
        fields["reduce_dtype"] = _dtype("communication_data_type", data["communication_data_type"])

    zero = data.get("zero_optimization") or {}
    sizes = {
        "stage": None,
        "reduce_bucket_size": "reduce_bucket_bytes",
        "allgather_bucket_size": "allgather_bucket_bytes",
        "stage3_prefetch_bucket_size": "prefetch_bytes",
        "stage3_param_persistence_threshold": "param_persistence_threshold",
        "param_persistence_threshold": "param_persistence_threshold",
        "offload_optimizer": None,
        "offload_param": None,
    }
    for key, reason in _REJECTED_ZERO.items():
        if zero.get(key):
            raise ValueError(f"DeepSpeed config zero_optimization.{key}: {reason} are not supported by zgraph")
    _unknown("zero_optimization", set(zero) - set(sizes) - _ACCEPTED_ZERO - set(_REJECTED_ZERO))
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in (None, "none"):
            raise ValueError(
                f"DeepSpeed config zero_optimization.{key} (device {device!r}): zgraph does not offload state yet; "
                "remove the section"
            )
    if zero.get("cpu_offload"):
        raise ValueError("DeepSpeed config zero_optimization.cpu_offload: zgraph does not offload state yet")
    if "stage" in zero and not _auto(zero["stage"]):
        fields["stage"] = int(zero["stage"])
    moved = fields.get("reduce_dtype") or fields.get("param_dtype") or torch.float32
    element = torch.empty((), dtype=moved).element_size()
    gathered = torch.empty((), dtype=fields.get("param_dtype") or torch.float32).element_size()
    for key, field in sizes.items():
        if field is None or key not in zero or _auto(zero[key]):
            continue
        count = int(float(zero[key]))
        if field == "param_persistence_threshold":
            fields[field] = count
        else:
            fields[field] = count * (gathered if field != "reduce_bucket_bytes" else element)
    return fields
