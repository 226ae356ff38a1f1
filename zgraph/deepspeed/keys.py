"""Every key DeepSpeed 0.19.8 reads, and what ``Config.from_deepspeed`` does with it.

Enumerated from DeepSpeed 0.19.8's source: ``DeepSpeedConfig._initialize_params`` (``deepspeed/runtime/config.py``)
for the top level, ``DeepSpeedZeroConfig`` (``deepspeed/runtime/zero/config.py``, fields and their ``stage3_``
aliases) for ``zero_optimization``, ``DeepSpeedBF16Config`` / ``DeepSpeedFP16Config``
(``deepspeed/runtime/precision_config.py``) for ``bf16`` / ``fp16``. A key is mapped to a ``Config`` field
(``zgraph.deepspeed.config``), accepted (zgraph does what it asks anyway, or it only concerns DeepSpeed's engine:
logging, its data loader, its checkpoint files), accepted only while it says "off", or rejected with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zgraph.deepspeed.values import boolean, choice, integer, is_auto, number, section, unknown

GRADIENT_CLIPPING_DEFAULT = 1.0  # deepspeed/runtime/constants.py, 0.19.8

MAPPED_TOP = {
    "zero_optimization",
    "bf16",
    "bfloat16",  # DeepSpeed's old name of the bf16 section, read when "bf16" is absent
    "fp16",
    "torch_autocast",
    "gradient_clipping",
    "communication_data_type",
    "gradient_accumulation_steps",  # 1 (or "auto") only
    "optimizer",  # read by zgraph.optimizer_from_deepspeed
    "scheduler",  # read by zgraph.optimizer_from_deepspeed
    "gradient_allreduce_op",  # "mean" (the default) only
    "data_types",  # DeepSpeed's defaults only
}
# Accepted without effect: they concern DeepSpeed's engine only, or zgraph does what they ask anyway.
ACCEPTED_TOP = {
    "train_batch_size": "batch sizes are the data you pass to the step",
    "train_micro_batch_size_per_gpu": "batch sizes are the data you pass to the step",
    "steps_per_print": "logging",
    "wall_clock_breakdown": "profiling",
    "memory_breakdown": "profiling",
    "flops_profiler": "profiling",
    "dump_state": "logging",
    "log_level": "logging",
    "timers": "profiling",
    "comms_logger": "logging",
    "tensorboard": "monitoring",
    "wandb": "monitoring",
    "csv_monitor": "monitoring",
    "comet": "monitoring",
    "autotuning": "DeepSpeed's launcher",
    "zero_allow_untested_optimizer": "zgraph shards any torch.optim optimizer",
    "zero_force_ds_cpu_optimizer": "only with offload, which is rejected",
    "prescale_gradients": "the same average, divided before instead of after the reduction",
    "gradient_predivide_factor": "the same average, divided partly before the reduction",
    "managed_gradient_accumulation": "the engine's accumulation bookkeeping",
    "disable_allgather": "a communication choice of DeepSpeed's stage 1/2 engine",
    "disable_python_gc": "the engine's garbage-collection calls",
    "dataloader_drop_last": "DeepSpeed's data loader",
    "checkpoint": "DeepSpeed's checkpoint files (zgraph.save writes zgraph's)",
    "datastates_ckpt": "DeepSpeed's checkpoint engine",
    "aio": "NVMe I/O for offload",
    "compile": "zgraph compiles the whole step itself (Config.backend)",
    "seq_parallel_communication_data_type": "sequence parallelism only",
    "use_data_before_expert_parallelism": "expert-parallel topology only",
    "vocabulary_size": "DeepSpeed's data pipeline",
}
# Accepted only while off; otherwise a feature zgraph does not have.
OFF_ONLY_TOP = {
    "activation_checkpointing": "configures deepspeed.checkpointing; use torch.utils.checkpoint in the model",
    "pipeline": "pipeline parallelism (DeepSpeed's PipelineEngine)",
    "tensor_parallel": "tensor parallelism (AutoTP)",
    "expert_parallel": "expert parallelism (AutoEP)",
    "hybrid_engine": "DeepSpeed's RLHF hybrid engine",
    "data_efficiency": "DeepSpeed's data sampling and routing",
    "weight_quantization": "quantized weights",
}
# Removed from DeepSpeed 0.19.8 (it raises for them; deepspeed/runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS).
REMOVED_TOP = {
    "amp": "NVIDIA Apex AMP was removed; use fp16, bf16 or torch_autocast",
    "nebula": "Nebula checkpointing was removed",
    "compression_training": "the compression library was removed",
    "quantize_training": "Mixture-of-Quantization was removed",
    "sparse_gradients": "sparse embedding-gradient compression was removed",
    "eigenvalue": "eigenvalue MoQ was removed",
    "sparse_attention": "Sparse Attention was removed",
    "elasticity": "elastic training was removed; set the batch sizes directly",
    "graph_harvesting": "graph harvesting was removed",
    "curriculum_learning": "top-level curriculum_learning was removed (data_efficiency replaces it)",
    "progressive_layer_drop": "Progressive Layer Dropping was removed",
}
BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
             "bf16_optimizer_states"}  # fmt: skip
FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}  # fmt: skip
FP16_RENAMED = {"fp16_master_weights_and_gradients": "fp16_master_weights_and_grads"}

# zero_optimization: DeepSpeed's alias → its field name (pydantic populate_by_name: either spelling).
ZERO_ALIASES = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential": "allgather_sequential",
}
ZERO_MAPPED = {"stage", "reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size",
               "param_persistence_threshold", "max_reuse_distance"}  # fmt: skip
# Booleans with no effect for zgraph: it overlaps, buckets and schedules communication itself, and keeps the
# shards of one flat layout; the rest concern DeepSpeed's checkpoint files or its module hooks.
ZERO_ACCEPTED_BOOLS = {
    "contiguous_gradients",
    "reduce_scatter",
    "use_multi_rank_bucket_allreduce",
    "allgather_partitions",
    "overlap_comm",
    "compute_grad_norm",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
    "ignore_unused_parameters",
    "legacy_stage1",
    "round_robin_gradients",
    "parameter_alignment",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory",
    "cpu_offload_use_pin_memory",
}
# Counts with no effect for zgraph: its schedule pass decides what stays gathered (within prefetch_bytes).
ZERO_ACCEPTED_COUNTS = {"sub_group_size", "model_persistence_threshold", "max_live_parameters",
                        "module_granularity_threshold"}  # fmt: skip
ZERO_ACCEPTED_OTHER = {"leaf_module"}  # ZeRO-3 hook granularity; zgraph captures the whole step as one graph
# Accepted while false; true asks for a feature zgraph does not have.
ZERO_FALSE_ONLY = {
    "zero_quantized_weights": "quantized weights",
    "zero_quantized_nontrainable_weights": "quantized weights",
    "zero_quantized_gradients": "quantized gradients",
    "cpu_offload": 'the deprecated offload flag (write offload_optimizer: {"device": "cpu"} instead)',
    "cpu_offload_param": 'the deprecated offload flag (write offload_param: {"device": "cpu"} instead)',
}
ZERO_REMOVED = {
    "mics_shard_size": "MiCS sharding was removed from DeepSpeed",
    "mics_hierarchical_params_gather": "MiCS sharding was removed from DeepSpeed",
    "zeropp_loco_param": "LoCo-ZeRO++ was removed from DeepSpeed",
}


def _off(value: Any) -> bool:
    """A section that asks for nothing: absent, false, empty, or ``{"enabled": false, ...}``."""
    if value is None or value is False or is_auto(value):
        return True
    if isinstance(value, Mapping):
        return not value or value.get("enabled") is False
    return False


def check_top_level(data: Mapping[str, Any]) -> None:
    """Reject what zgraph cannot honour at the top level, naming the key and the reason."""
    for key, reason in REMOVED_TOP.items():
        if key in data and not _off(data[key]):
            raise ValueError(f"DeepSpeed config '{key}': removed in DeepSpeed 0.19.8 ({reason}); remove it")
    for key, reason in OFF_ONLY_TOP.items():
        if key in data and not _off(data[key]):
            raise ValueError(f"DeepSpeed config '{key}': {reason} is not supported by zgraph; remove it")
    legacy = {"allgather_size"} if isinstance(data.get("zero_optimization"), bool) else set()
    known = MAPPED_TOP | set(ACCEPTED_TOP) | set(OFF_ONLY_TOP) | set(REMOVED_TOP) | legacy
    unknown("top level", set(data) - known)
    accumulation = data.get("gradient_accumulation_steps", 1)
    if accumulation is not None and not is_auto(accumulation):
        if integer("gradient_accumulation_steps", accumulation, minimum=1) != 1:
            raise ValueError(
                f"DeepSpeed config gradient_accumulation_steps={accumulation}: write the micro-batch loop inside "
                "the step (loss / n, backward per micro-batch, one opt.step()); zgraph compiles it as one graph"
            )
    op = data.get("gradient_allreduce_op", "mean")
    if choice("gradient_allreduce_op", op, ("mean", "sum")) == "sum":
        raise ValueError("DeepSpeed config gradient_allreduce_op='sum': zgraph averages gradients; remove the key")
    _check_data_types(section("data_types", data.get("data_types")))


def _check_data_types(types: Mapping[str, Any]) -> None:
    unknown("data_types", set(types) - {"grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules"})
    for key in ("grad_accum_dtype", "param_dtype", "buffer_dtype"):
        if types.get(key) is not None and not is_auto(types[key]):
            raise ValueError(
                f"DeepSpeed config data_types.{key}={types[key]!r}: zgraph sets dtypes with Config.param_dtype, "
                "reduce_dtype and master_dtype (or the bf16 / fp16 sections); remove the key and set those"
            )
    if types.get("keep_in_fp32_modules", "auto") != "auto":
        raise ValueError(
            "DeepSpeed config data_types.keep_in_fp32_modules: only DeepSpeed's default 'auto' is honoured; remove it"
        )


def check_zero(zero: Mapping[str, Any]) -> dict[str, Any]:
    """``zero_optimization`` with DeepSpeed's aliases resolved to its field names, every other key checked."""
    canonical: dict[str, Any] = {}
    for key, value in zero.items():
        name = ZERO_ALIASES.get(key, key)
        if name in canonical:
            raise ValueError(f"DeepSpeed config zero_optimization: {name} is given twice (once as {key}); give one")
        canonical[name] = value
    for key, reason in ZERO_REMOVED.items():
        if key in canonical:
            raise ValueError(f"DeepSpeed config zero_optimization.{key}: {reason} in 0.19.8; remove it")
    known = ZERO_MAPPED | ZERO_ACCEPTED_BOOLS | ZERO_ACCEPTED_COUNTS | ZERO_ACCEPTED_OTHER | set(ZERO_FALSE_ONLY)
    unknown("zero_optimization", set(canonical) - known - {"offload_optimizer", "offload_param", "zenflow",
                                                           "zero_hpz_partition_size"})  # fmt: skip
    for key, value in canonical.items():
        where = f"zero_optimization.{key}"
        if is_auto(value):
            continue
        if key in ZERO_ACCEPTED_BOOLS and value is not None:
            boolean(where, value)
        elif key in ZERO_ACCEPTED_COUNTS:
            integer(where, value)
        elif key in ZERO_FALSE_ONLY and value is not None and boolean(where, value):
            raise ValueError(f"DeepSpeed config {where}: {ZERO_FALSE_ONLY[key]} is not supported by zgraph")
    _check_zero_features(canonical)
    return canonical


def _check_zero_features(zero: Mapping[str, Any]) -> None:
    offload_fields(zero)
    if zero.get("zenflow") is not None:
        raise ValueError("DeepSpeed config zero_optimization.zenflow: ZenFlow offloading is not supported by zgraph")
    if "leaf_module" in zero:
        section("zero_optimization.leaf_module", zero["leaf_module"])


# DeepSpeed 0.19.8's offload sections (DeepSpeedZeroOffloadOptimizerConfig / ...ParamConfig): the keys that map,
# and those accepted with no effect, with the reason.
OFFLOAD_MAPPED = {"device": "offload_optimizer / offload_params", "nvme_path": "offload_dir",
                  "ratio": "offload_fraction (offload_optimizer only)"}  # fmt: skip
OFFLOAD_ACCEPTED = {
    "pin_memory": "pinned host buffers are how the cpu tier copies on CUDA; on the CPU there is nothing to pin",
    "buffer_count": "zgraph reads and writes one block per state buffer, no staging buffer pool",
    "buffer_size": "zgraph reads and writes one block per state buffer, no staging buffer pool",
    "max_in_cpu": "zgraph keeps no host cache of NVMe parameters",
    "pipeline_read": "I/O overlap changes speed, not results",
    "pipeline_write": "I/O overlap changes speed, not results",
    "fast_init": "optimizer initialisation speed only",
}
_OFFLOAD_SECTIONS = {"offload_optimizer": ("offload_optimizer", True), "offload_param": ("offload_params", False)}


def offload_fields(zero: Mapping[str, Any]) -> dict[str, Any]:
    """The ``Config`` offload fields of ``zero_optimization.offload_optimizer`` / ``offload_param``."""
    fields: dict[str, Any] = {}
    for key, (field, has_ratio) in _OFFLOAD_SECTIONS.items():
        where = f"zero_optimization.{key}"
        offload = section(where, zero.get(key))
        allowed = set(OFFLOAD_MAPPED) | set(OFFLOAD_ACCEPTED)
        unknown(
            where,
            set(offload)
            - (allowed if has_ratio else allowed - {"ratio", "pipeline_read", "pipeline_write", "fast_init"}),
        )
        device = offload.get("device", "none")
        device = (
            "none" if device is None or is_auto(device) else choice(f"{where}.device", device, ("none", "cpu", "nvme"))
        )
        for name in ("pin_memory", "pipeline_read", "pipeline_write", "fast_init"):
            if offload.get(name) is not None and not is_auto(offload[name]):
                boolean(f"{where}.{name}", offload[name])
        for name in ("buffer_count", "buffer_size", "max_in_cpu"):
            if offload.get(name) is not None and not is_auto(offload[name]):
                integer(f"{where}.{name}", offload[name])
        if device == "none":
            continue
        fields[field] = device
        path = offload.get("nvme_path")
        if path is not None and device == "nvme":
            if not isinstance(path, str):
                raise ValueError(f"DeepSpeed config {where}.nvme_path: expected a directory path, got {path!r}")
            if fields.get("offload_dir", path) != path:
                raise ValueError(
                    f"DeepSpeed config: offload_optimizer.nvme_path and offload_param.nvme_path differ "
                    f"({fields['offload_dir']!r}, {path!r}); zgraph writes both in one offload_dir: give one path"
                )
            fields["offload_dir"] = path
        ratio = offload.get("ratio")
        if has_ratio and ratio is not None and not is_auto(ratio):
            fields["offload_fraction"] = float(number(f"{where}.ratio", ratio, minimum=0.0))
    return fields
