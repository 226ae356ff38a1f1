"""``Config.from_deepspeed`` against DeepSpeed 0.19.8: its defaults, every key it reads, strict types naming the key
(issue 16, "DeepSpeed configs")."""

from __future__ import annotations

import pytest
import torch

import zgraph
from zgraph.deepspeed import keys

# Every top-level key DeepSpeed 0.19.8's DeepSpeedConfig reads (recorded from DeepSpeedConfig(...) reading a dict
# that logs its lookups, plus the sections read through .keys(): optimizer, scheduler, aio, activation_checkpointing,
# flops_profiler, autotuning), and every field and alias of its DeepSpeedZeroConfig / BF16 / FP16 models.
DEEPSPEED_TOP_LEVEL = {
    "amp", "bf16", "bfloat16", "checkpoint", "comet", "comms_logger", "communication_data_type", "compile",
    "compression_training", "csv_monitor", "curriculum_learning", "data_efficiency", "data_types",
    "dataloader_drop_last", "datastates_ckpt", "disable_allgather", "disable_python_gc", "dump_state", "eigenvalue",
    "elasticity", "expert_parallel", "fp16", "gradient_accumulation_steps", "gradient_allreduce_op",
    "gradient_clipping", "gradient_predivide_factor", "graph_harvesting", "hybrid_engine", "log_level",
    "managed_gradient_accumulation", "memory_breakdown", "nebula", "pipeline", "prescale_gradients",
    "progressive_layer_drop", "quantize_training", "seq_parallel_communication_data_type", "sparse_attention",
    "sparse_gradients", "steps_per_print", "tensor_parallel", "tensorboard", "timers", "torch_autocast",
    "train_batch_size", "train_micro_batch_size_per_gpu", "use_data_before_expert_parallelism", "vocabulary_size",
    "wall_clock_breakdown", "wandb", "weight_quantization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "zero_optimization", "optimizer", "scheduler", "aio", "activation_checkpointing",
    "flops_profiler", "autotuning",
}  # fmt: skip
DEEPSPEED_ZERO_FIELDS = {
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "compute_grad_norm", "load_from_fp32_weights",
    "elastic_checkpoint", "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size", "param_persistence_threshold",
    "model_persistence_threshold", "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients",
    "parameter_alignment", "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
}  # fmt: skip
DEEPSPEED_ZERO_ALIASES = {
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
}  # fmt: skip


def _zero_fields_and_aliases_from_deepspeed():
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    fields = config.DeepSpeedZeroConfig.model_fields
    return set(fields), {f.alias for f in fields.values() if f.alias}


def test_the_key_lists_are_deepspeeds_own():
    """Where DeepSpeed installs, the lists above are its pydantic model's fields and aliases."""
    fields, aliases = _zero_fields_and_aliases_from_deepspeed()
    assert fields == DEEPSPEED_ZERO_FIELDS and aliases == DEEPSPEED_ZERO_ALIASES
    precision = pytest.importorskip("deepspeed.runtime.precision_config")
    assert set(precision.DeepSpeedBF16Config.model_fields) == keys.BF16_KEYS
    assert set(precision.DeepSpeedFP16Config.model_fields) == keys.FP16_KEYS


def test_every_deepspeed_key_is_accounted_for():
    top = keys.MAPPED_TOP | set(keys.ACCEPTED_TOP) | set(keys.OFF_ONLY_TOP) | set(keys.REMOVED_TOP)
    assert top == DEEPSPEED_TOP_LEVEL
    zero = keys.ZERO_MAPPED | keys.ZERO_ACCEPTED_BOOLS | keys.ZERO_ACCEPTED_COUNTS | keys.ZERO_ACCEPTED_OTHER
    zero |= set(keys.ZERO_FALSE_ONLY) | {"offload_optimizer", "offload_param", "zenflow", "zero_hpz_partition_size"}
    assert zero == DEEPSPEED_ZERO_FIELDS
    assert set(keys.ZERO_ALIASES) == DEEPSPEED_ZERO_ALIASES


@pytest.mark.parametrize("key", sorted(DEEPSPEED_ZERO_FIELDS | DEEPSPEED_ZERO_ALIASES))
def test_no_valid_zero_key_is_unknown(key):
    """Each zero_optimization field and alias, at DeepSpeed's default, is accepted or mapped, never "unknown"."""
    defaults = {"offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}, "zenflow": None}
    defaults |= {"zero_hpz_partition_size": 1, "leaf_module": {}, "stage": 3}
    counts = {k for k in DEEPSPEED_ZERO_FIELDS | DEEPSPEED_ZERO_ALIASES if "size" in k or "threshold" in k}
    counts |= {"max_live_parameters", "max_reuse_distance", "stage3_max_live_parameters"}
    counts |= {"stage3_max_reuse_distance"}
    value = defaults.get(key, 1_000_000 if key in counts and key != "zero_hpz_partition_size" else False)
    zgraph.Config.from_deepspeed({"zero_optimization": {key: value}})


@pytest.mark.parametrize(
    "key",
    [
        "stage3_model_persistence_threshold",
        "stage3_module_granularity_threshold",
        "prefetch_bucket_size",
        "max_live_parameters",
        "max_reuse_distance",
    ],
)
def test_issue_keys_once_unknown_are_accepted(key):
    zgraph.Config.from_deepspeed({"zero_optimization": {"stage": 3, key: 1000}})


def test_top_level_compile_and_hpz_are_accepted_and_amp_says_why():
    zgraph.Config.from_deepspeed(
        {"compile": {"deepcompile": False}, "zero_optimization": {"zero_hpz_partition_size": 1}}
    )
    zgraph.Config.from_deepspeed({"amp": {"enabled": False}})
    with pytest.raises(ValueError, match=r"'amp': removed in DeepSpeed 0.19.8 \(NVIDIA Apex AMP"):
        zgraph.Config.from_deepspeed({"amp": {"enabled": True}})
    # hpZ is mapped (Config.secondary_shard_group_size), and needs stage 3 (DeepSpeed's default stage is 0)
    with pytest.raises(ValueError, match="secondary_shard_group_size=8 .DeepSpeed's zero_hpz_partition_size. needs"):
        zgraph.Config.from_deepspeed({"zero_optimization": {"zero_hpz_partition_size": 8}})


def test_defaults_are_deepspeeds():
    config = zgraph.Config.from_deepspeed({})
    assert config.max_grad_norm == keys.GRADIENT_CLIPPING_DEFAULT == 1.0
    assert zgraph.Config.from_deepspeed({"gradient_clipping": 0}).max_grad_norm is None
    assert zgraph.Config.from_deepspeed({"gradient_clipping": 0.5}).max_grad_norm == 0.5
    assert config.param_persistence_threshold == 100_000 and config.stage == 0
    fp16 = zgraph.Config.from_deepspeed({"fp16": {"enabled": True}}).loss_scale
    assert fp16 == zgraph.DynamicLossScale(init_scale=2.0**16, growth_interval=1000, hysteresis=2, min_scale=1.0)


def test_defaults_against_deepspeeds_source():
    constants = pytest.importorskip("deepspeed.runtime.constants")
    zero = pytest.importorskip("deepspeed.runtime.zero.config").DeepSpeedZeroConfig()
    fp16 = pytest.importorskip("deepspeed.runtime.precision_config").DeepSpeedFP16Config()
    assert constants.GRADIENT_CLIPPING_DEFAULT == keys.GRADIENT_CLIPPING_DEFAULT
    assert zero.param_persistence_threshold == zgraph.Config().param_persistence_threshold
    assert zero.zero_hpz_partition_size == 1 and zero.stage == 0
    scale = zgraph.Config.from_deepspeed({"fp16": {"enabled": True}}).loss_scale
    assert (scale.init_scale, scale.growth_interval, scale.hysteresis, scale.min_scale) == (
        fp16.initial_dynamic_scale(),
        fp16.loss_scale_window,
        fp16.hysteresis,
        fp16.min_loss_scale,
    )


def test_aliases_map_like_their_fields():
    a = zgraph.Config.from_deepspeed({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1000}})
    b = zgraph.Config.from_deepspeed({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000}})
    assert a.prefetch_bytes == b.prefetch_bytes == 4000
    c = zgraph.Config.from_deepspeed({"zero_optimization": {"param_persistence_threshold": 7}})
    assert c.param_persistence_threshold == 7
    with pytest.raises(ValueError, match="given twice"):
        zgraph.Config.from_deepspeed(
            {"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 1}}
        )


@pytest.mark.parametrize(
    ("ds", "message"),
    [
        ({"fp16": {"enabled": "false"}}, r"fp16\.enabled: expected true or false, got 'false'"),
        ({"bf16": {"enabled": "true"}}, r"bf16\.enabled: expected true or false"),
        ({"zero_optimization": {"stage": 2.9}}, r"zero_optimization\.stage: expected an integer, got 2\.9"),
        ({"zero_optimization": {"stage": True}}, r"zero_optimization\.stage: expected an integer, got True"),
        ({"zero_optimization": {"stage": 4}}, r"zero_optimization\.stage: expected 0, 1, 2 or 3"),
        ({"fp16": {"enabled": True, "loss_scale": float("inf")}}, r"fp16\.loss_scale: expected a finite number"),
        ({"fp16": {"enabled": True, "loss_scale": float("nan")}}, r"fp16\.loss_scale: expected a finite number"),
        ({"gradient_clipping": float("inf")}, r"gradient_clipping: expected a finite number"),
        ({"gradient_clipping": -1}, r"gradient_clipping: expected a number of at least 0"),
        ({"zero_optimization": {"reduce_bucket_size": -5}}, r"reduce_bucket_size: expected an integer of at least"),
        ({"zero_optimization": {"allgather_bucket_size": "5e8x"}}, r"allgather_bucket_size: expected an integer"),
        ({"zero_optimization": {"stage3_max_live_parameters": -1}}, r"max_live_parameters: expected an integer"),
        ({"fp16": 1}, r"fp16: expected a JSON object, got 1 \(int\)"),
        ({"zero_optimization": {"offload_param": 3}}, r"offload_param: expected a JSON object"),
        ({"gradient_accumulation_steps": "4"}, r"gradient_accumulation_steps: expected an integer"),
        ({"fp16": {"enabled": True, "initial_scale_power": "16"}}, r"fp16\.initial_scale_power: expected an integer"),
        ({"communication_data_type": "float32"}, r"communication_data_type: expected one of 'fp32', 'fp16', 'bf16'"),
        ({"zero_optimization": {"overlap_comm": "yes"}}, r"zero_optimization\.overlap_comm: expected true or false"),
    ],
)
def test_strict_types_name_the_key(ds, message):
    with pytest.raises(ValueError, match=message):
        zgraph.Config.from_deepspeed(ds)


@pytest.mark.parametrize(
    ("ds", "message"),
    [
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "requires ZeRO >= 1"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/x"}}}, "stage 3"),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}}, "needs offload_dir"),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}}, r"\[0, 1\]"),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "bogus": 1}}}, "bogus"),
        ({"zero_optimization": {"cpu_offload": True}}, "offload"),
        ({"zero_optimization": {"mics_shard_size": 2}}, "MiCS sharding was removed"),
        ({"sparse_gradients": True}, "removed in DeepSpeed 0.19.8"),
        ({"pipeline": {"stages": 2}}, "pipeline parallelism"),
        ({"gradient_allreduce_op": "sum"}, "averages"),
        ({"data_types": {"grad_accum_dtype": "fp32"}}, "data_types.grad_accum_dtype"),
        ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, "consecutive_hysteresis"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_gradients": True}}, "fp16_master_weights_and_grads"),
        ({"moe": {}}, r"unknown key\(s\) \['moe'\]"),
    ],
)
def test_what_zgraph_cannot_honour_says_why(ds, message):
    with pytest.raises(ValueError, match=message):
        zgraph.Config.from_deepspeed(ds)


def test_off_values_are_accepted():
    config = zgraph.Config.from_deepspeed(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "none"},
                "offload_param": {"device": "none", "pin_memory": True},
                "cpu_offload": False,
                "zero_quantized_weights": False,
            },
            "activation_checkpointing": {},
            "tensor_parallel": None,
            "sparse_gradients": False,
            "bfloat16": {"enabled": True},
            "fp16": {"enabled": True, "fp16_master_weights_and_grads": True} | {"enabled": False},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "scheduler": {"type": "WarmupLR"},
        }
    )
    assert config.stage == 3 and config.param_dtype == torch.bfloat16, "the old 'bfloat16' section is read"


def test_deprecated_boolean_zero_optimization_is_stage_one():
    assert zgraph.Config.from_deepspeed({"zero_optimization": True, "allgather_size": 100}).stage == 1
    assert zgraph.Config.from_deepspeed({"zero_optimization": False}).stage == 0


def test_hugging_face_auto_is_deepspeeds_default():
    config = zgraph.Config.from_deepspeed(
        {"gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": "auto"}}
    )
    assert config.max_grad_norm == 1.0 and config.param_dtype is None and config.stage == 0
