"""``zgraph.integrations.transformers.ZGraphTrainer`` (issue 28, item 1) against the plain ``transformers.Trainer``.

Needs the ``hf`` extra (transformers and accelerate); skipped without them. Tiny GPT-2 and Llama from configs
(``trainer_hf_cases``), ``gradient_accumulation_steps=2``, ``max_grad_norm=1.0``, a cosine schedule with warm-up,
the same data: ZGraphTrainer on 2 spawned gloo ranks at ZeRO stages 0-3 against Trainer + DDP on 2 ranks. The
logged losses, gradient norms and learning rates of every optimizer step and the final whole state dict must
equal DDP's within a bound per quantity: ``NOISE_FACTOR`` times DDP's own relative distance to Trainer in one
process on the global batch (``bounds``), never below ``REL``. DDP is held to that one-process run in turn (it
differs only in the order of float reductions): the logged series within ``DDP_REL``, the state within
``DDP_STATE_REL`` — looser, because an attention key bias has a gradient that is zero but for round-off, so
Adam's normalised update of it follows the reduction order (GPT-2's ``c_attn.bias``: 1.1e-4 of its scale; every
other tensor about 1e-7). The per-tensor bounds of ZGraphTrainer against DDP come from that same distance
(``hf_parity``, shared with the accelerate loop's tests).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainer_hf_cases as cases  # noqa: E402  (needs transformers)
from dist_harness import run_ranks  # noqa: E402
from hf_parity import DDP_REL, DDP_STATE_REL, SERIES, assert_close, bounds  # noqa: E402

pytestmark = pytest.mark.hf

STAGES = [0, 1, 2, 3]
DEADLINE = 300  # seconds for one rank group; about 40 s for four stages on 2 idle cores


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            run_ranks(1, "trainer_hf_cases.run_plain", str(root / "eager.pt"), name, timeout=DEADLINE, init_group=False)
            run_ranks(2, "trainer_hf_cases.run_plain", str(root / "ddp.pt"), name, timeout=DEADLINE)
            runs = [*STAGES, "deepspeed"] if name == "gpt2" else STAGES
            run_ranks(2, "trainer_hf_cases.run_zero", str(root / "zero.pt"), name, runs, timeout=DEADLINE)
            cache[name] = {
                "eager": torch.load(root / "eager.pt", weights_only=False),
                "ddp": torch.load(root / "ddp.pt", weights_only=False),
                **torch.load(root / "zero.pt", weights_only=False),
            }
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(cases.MODELS))
def test_ddp_matches_one_process(results, name):
    """The reference is sound: Trainer + DDP on 2 ranks equals Trainer in one process on the global batch."""
    result = results(name)
    limits = {**{k: DDP_STATE_REL for k in result["eager"]["state"]}, **{k: DDP_REL for k in SERIES}}
    assert_close(result["ddp"], result["eager"], limits, f"{name}: DDP vs one process")


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", list(cases.MODELS))
def test_trainer_matches_ddp(results, name, stage):
    result = results(name)
    assert_close(result[stage], result["ddp"], bounds(result), f"{name}: ZGraphTrainer stage {stage} vs DDP")
    if stage == 3:  # every parameter sharded (param_persistence_threshold=0), none left whole
        assert result[stage]["sharded"] == result[stage]["parameters"] > 0, result[stage]


def test_deepspeed_json_with_auto_values_matches_ddp(results):
    """TrainingArguments(deepspeed=...) with "auto" values (``trainer_hf_cases.DEEPSPEED``: ZeRO-3, its optimizer
    section, every value the arguments know left "auto") trains as Trainer + DDP; stage 3's persistence threshold,
    filled as transformers fills it (10 x hidden size = 160 elements), leaves the small tensors whole."""
    result = results("gpt2")
    got = result["deepspeed"]
    assert_close(got, result["ddp"], bounds(result), "gpt2: ZGraphTrainer from a DeepSpeed JSON vs DDP")
    assert 0 < got["sharded"] < got["parameters"], got


# ------------------------------------------------------------------------------ refused when the trainer is built
def _build(tmp_path, config=None, **changes):
    from zgraph.integrations.transformers import ZGraphTrainer, ZGraphTrainingArguments

    args = cases.arguments(str(tmp_path), cls=ZGraphTrainingArguments, **changes)
    return ZGraphTrainer(model=cases.MODELS["gpt2"](), args=args, train_dataset=cases.dataset(), zgraph_config=config)


EAGER = {"backend": "eager"}
DEEPSPEED = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto"}
REFUSED = {
    "deepspeed and fsdp": (None, dict(deepspeed=DEEPSPEED, fsdp="full_shard"), "deepspeed and fsdp are both set"),
    "fsdp": (EAGER, dict(fsdp="full_shard"), "TrainingArguments fsdp="),
    "torch_compile, eager backend": (EAGER, dict(torch_compile=True), "torch_compile=True .* the eager backend"),
    "torch_compile, inductor": ({}, dict(torch_compile=True), "torch_compile=True .* compiles the whole step"),
    "fp16 without loss scaling": (EAGER, dict(fp16=True), "fp16=True: .*GradScaler"),
    "bf16_full_eval": (EAGER, dict(bf16_full_eval=True), "bf16_full_eval=True"),
    "zgraph_config and deepspeed": (EAGER, dict(deepspeed=DEEPSPEED), "both zgraph_config and TrainingArguments deep"),
    "clip norms differ": ({"backend": "eager", "max_grad_norm": 0.5}, {}, "max_grad_norm=0.5 and TrainingArguments"),
    "deepspeed value mismatch": (
        None,
        dict(deepspeed={**DEEPSPEED, "gradient_accumulation_steps": 4}),
        "ds gradient_accumulation_steps=4 vs hf gradient_accumulation_steps=2",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_when_built(tmp_path, case):
    """An option zgraph cannot honour is refused by the constructor, with a ValueError naming it."""
    import zgraph

    config, changes, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        _build(tmp_path, None if config is None else zgraph.Config(**config), **changes)


# ------------------------------------------------------------------------------------- DeepSpeed "auto" values
def test_auto_values_filled_as_transformers_fills_them(tmp_path):
    from zgraph.integrations import hf_deepspeed
    from zgraph.integrations.transformers import ZGraphTrainingArguments

    args = cases.arguments(str(tmp_path), cls=ZGraphTrainingArguments, warmup_steps=0.25, weight_decay=0.1)
    auto = "auto"
    config = {
        "train_micro_batch_size_per_gpu": auto,
        "train_batch_size": auto,
        "gradient_accumulation_steps": auto,
        "gradient_clipping": auto,
        "fp16": {"enabled": auto},
        "bf16": {"enabled": auto},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": auto,
            "stage3_prefetch_bucket_size": auto,
            "stage3_param_persistence_threshold": auto,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": auto, "betas": auto, "eps": auto, "weight_decay": auto}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": auto, "warmup_max_lr": auto, "warmup_num_steps": auto, "total_num_steps": auto},
        },
    }
    filled = hf_deepspeed.fill_from_arguments(hf_deepspeed.load(config), args, cases.MODELS["gpt2"]())
    hf_deepspeed.fill_schedule(filled, args, 8)
    assert filled == {
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 4,  # world 1 x 2 rows x 2 micro-batches
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 256,  # hidden size 16, squared
            "stage3_prefetch_bucket_size": 230,
            "stage3_param_persistence_threshold": 160,
        },
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2, "total_num_steps": 8},
        },
    }
    assert config["optimizer"]["params"]["lr"] == "auto"  # the user's dict is not changed


def test_deepspeed_sections_build_optimizer_and_scheduler(tmp_path):
    """A DeepSpeed JSON file (a path, as TrainingArguments takes it) whose optimizer and scheduler sections say
    "auto": the trainer builds them with zgraph.optimizer_from_deepspeed, filled from the arguments; the Config is
    the file's (stage 2), with zgraph_options over it."""
    import json

    from zgraph.deepspeed.optim import DeepSpeedWarmupSchedule
    from zgraph.integrations.transformers import ZGraphTrainer, ZGraphTrainingArguments

    path = tmp_path / "ds.json"
    sections = {
        "zero_optimization": {"stage": 2},
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    }
    path.write_text(json.dumps(sections))
    args = cases.arguments(str(tmp_path), cls=ZGraphTrainingArguments, deepspeed=str(path))
    model = cases.MODELS["gpt2"]()
    trainer = ZGraphTrainer(model=model, args=args, train_dataset=cases.dataset(), zgraph_options={"backend": "eager"})
    assert (trainer.zgraph_setup.config.stage, trainer.zgraph_setup.config.backend) == (2, "eager")
    assert trainer.zgraph_setup.max_grad_norm == 1.0  # DeepSpeed's default clipping: the key is absent
    trainer.create_optimizer_and_scheduler(num_training_steps=8)
    assert type(trainer.optimizer) is torch.optim.AdamW and trainer.optimizer.defaults["lr"] == 1e-2
    assert type(trainer.lr_scheduler) is DeepSpeedWarmupSchedule and trainer.lr_scheduler.optimizer is trainer.optimizer
    assert trainer.zgraph_setup.deepspeed["scheduler"]["params"] == {"warmup_max_lr": 1e-2, "warmup_num_steps": 1}


# --------------------------------------------------------------------------- checkpoints, save_model, evaluation
@pytest.mark.parametrize("stage", [0, 3])
def test_resume_and_save_model(tmp_path, stage):
    """save_steps=2 writes zgraph checkpoints (``checkpoint-N/zgraph``); a fresh trainer resumed from step 2 logs
    the uninterrupted run's losses, gradient norms and learning rates for steps 3 and 4 and ends with its state,
    bitwise; ``save_model`` writes files ``from_pretrained`` reads back as the trained model; ``evaluate`` on the
    sharded model gives the plain Trainer's loss on the model read back."""
    path = tmp_path / "result.pt"
    run_ranks(2, "trainer_hf_cases.run_resume", str(path), "gpt2", stage, timeout=DEADLINE)
    result = torch.load(path, weights_only=False)
    assert "error" not in result, result["error"]
    assert {"checkpoint-2", "checkpoint-4", "final"} <= set(result["checkpoints"])
    assert {"zgraph", "model.safetensors", "config.json", "trainer_state.json"} <= set(result["in_checkpoint"])
    full, resumed = result["full"], result["resumed"]
    for key in SERIES:
        assert resumed[key] == full[key], (key, resumed[key], full[key])  # log_history is restored with the state
    for key, value in full["state"].items():
        assert torch.equal(resumed["state"][key], value), key
        assert torch.equal(result["loaded"][key], value), key
    assert result["eval_loss"] == pytest.approx(result["loaded_eval_loss"], rel=1e-6)


def test_model_built_on_meta_and_loaded_into_shards(tmp_path):
    """A model built on the meta device, its stage-3 shards filled by zgraph.load_pretrained, trains under
    ZGraphTrainer exactly as the same files read by from_pretrained."""
    path = tmp_path / "result.pt"
    run_ranks(2, "trainer_hf_cases.run_meta", str(path), "gpt2", timeout=DEADLINE)
    result = torch.load(path, weights_only=False)
    assert "error" not in result, result["error"]
    meta, pretrained = result["meta"], result["from_pretrained"]
    for key in SERIES:
        assert meta[key] == pretrained[key], (key, meta[key], pretrained[key])
    for key, value in pretrained["state"].items():
        assert torch.equal(meta["state"][key], value), key


def test_plain_training_arguments_with_deepspeed_are_rebuilt(tmp_path):
    """Plain TrainingArguments whose deepspeed is set (where the DeepSpeed package is installed, they built
    DeepSpeed's own config; here set after construction) are rebuilt as ZGraphTrainingArguments and read by zgraph."""
    from zgraph.integrations.transformers import ZGraphTrainer, ZGraphTrainingArguments

    args = cases.arguments(str(tmp_path))
    args.deepspeed = DEEPSPEED
    trainer = ZGraphTrainer(model=cases.MODELS["gpt2"](), args=args, train_dataset=cases.dataset())
    assert isinstance(trainer.args, ZGraphTrainingArguments) and trainer.args.deepspeed == DEEPSPEED
    assert trainer.zgraph_setup.config.stage == 2 and trainer.args.gradient_accumulation_steps == 2


def test_bf16_is_autocast_in_the_step(tmp_path):
    """TrainingArguments bf16=True: the step runs under bf16 autocast (Config.autocast_dtype), as Trainer runs the
    model under accelerate's; the losses agree within bf16's unit round-off (observed: 1.2e-5 relative)."""
    got = cases.bf16_losses("llama", str(tmp_path))
    for a, b in zip(got["zgraph"], got["plain"], strict=True):
        assert abs(a - b) <= 2**-8 * abs(b), (got["zgraph"], got["plain"])


def test_pipeline_parallelism_in_the_trainers_step_trains_as_without_it(tmp_path):
    """``zgraph_config=Config(pipeline_parallel=...)``: the Llama's layers cut into 2 stages (on one process), each
    of the step's 2 accumulated batches in 2 micro-batches: the logged losses and gradient norms (the step's own
    ``clip_grad_norm_``, made once from every stage's gradients) and the final state equal ZGraphTrainer's without
    pipelines (the same arithmetic, summed in another order)."""
    import hf_cases
    from transformers import LlamaForCausalLM

    import zgraph
    from zgraph.integrations.transformers import ZGraphTrainer

    config = hf_cases._llama_config()
    config.num_hidden_layers = 2  # a layer per stage
    pipelined = dict(pipeline_parallel=1, pipeline_virtual_stages=2, schedule="interleaved_1f1b", microbatches=2)
    runs = []
    for options in ({}, pipelined):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        args = cases.arguments(str(tmp_path / str(len(runs))), per_device=4)
        step = zgraph.Config(backend="eager", **options)
        trainer = ZGraphTrainer(model=model, args=args, train_dataset=cases.dataset(), zgraph_config=step)
        trainer.train()
        runs.append((cases.history(trainer), cases.whole_state(trainer.model)))
    (want, want_state), (got, got_state) = runs
    for key in ("loss", "grad_norm", "learning_rate"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), rtol=1e-5, atol=0)
    for name, value in want_state.items():
        torch.testing.assert_close(got_state[name], value, rtol=1e-5, atol=1e-5)
