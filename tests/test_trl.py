"""``zgraph.integrations.trl.ZGraphSFTTrainer`` (issue 28, item 3) against TRL's plain ``SFTTrainer``.

Needs the ``hf`` extra (transformers, accelerate, trl); skipped without trl. A tiny GPT-2 from a config, a
word-level tokenizer and a text dataset built offline (``trl_cases``): SFTTrainer prepares the data, pads, and
computes the loss with its fused LM head, with gradient checkpointing (its default), ``gradient_accumulation_steps=2``,
``max_grad_norm=1.0`` and a cosine schedule. ZGraphSFTTrainer on 2 spawned gloo ranks at ZeRO stages 0 and 3 against
SFTTrainer + DDP on 2 ranks: every optimizer step's logged loss, gradient norm, learning rate and SFTTrainer's
metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``: computed in the step, read after it), and the final
whole state dict, within ``NOISE_FACTOR`` times DDP's own relative distance to SFTTrainer in one process on the
global batch, never below ``REL`` (as ``test_trainer_hf``); ``evaluate()``'s metrics (SFTTrainer's ``compute_loss``
on the gathered model) within ``EVAL_REL`` of DDP's, which evaluates the same rows on the same ranks.

Dynamic padding (issue 41, item 5): TRL's default collator pads each micro-batch to its longest row, so the batch
shape changes from step to step, and differs between the ranks; ZGraphSFTTrainer at stage ``DYNAMIC_STAGE``
against SFTTrainer + DDP, bounded as above by DDP's distance to one process (the global batch padded to its
longest row), captured at most twice on each rank.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("trl")

import trl_cases as cases  # noqa: E402  (needs trl)
from dist_harness import run_ranks  # noqa: E402

pytestmark = pytest.mark.hf

STAGES = [0, 3]
DYNAMIC_STAGE = 3
REL = 1e-6
NOISE_FACTOR = 10
DDP_REL = 1e-5
DDP_STATE_REL = 1e-3  # GPT-2's c_attn.bias: its gradient is round-off, Adam's update of it follows reduction order
EVAL_REL = 1e-5
DEADLINE = 300  # seconds for one rank group; about 60 s for both on 2 idle cores


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trl")
    run_ranks(1, "trl_cases.run_plain", str(root / "eager.pt"), timeout=DEADLINE, init_group=False)
    run_ranks(2, "trl_cases.run_ddp_and_zero", str(root / "runs.pt"), STAGES, DYNAMIC_STAGE, timeout=DEADLINE)
    runs = torch.load(root / "runs.pt", weights_only=False)
    plain = torch.load(root / "eager.pt", weights_only=False)
    eager = {"eager": plain["padded"], "eager_dynamic": plain["dynamic"], "eager_padding_free": plain["padding_free"]}
    return {**eager, **runs}


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-12)).item()


def _series_rel(actual: list[float], expected: list[float]) -> float:
    return _rel(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64))


def bounds(ddp: dict, eager: dict) -> dict[str, float]:
    """Each logged series' and state tensor's bound: ``NOISE_FACTOR`` times DDP's distance to one process."""
    for run in (ddp, eager):
        assert "error" not in run, run.get("error")
    noise = {k: _series_rel(ddp[k], eager[k]) for k in cases.SERIES}
    noise.update({k: _rel(v, eager["state"][k]) for k, v in ddp["state"].items()})
    return {k: max(REL, NOISE_FACTOR * n) for k, n in noise.items()}


def assert_close(got: dict, want: dict, limits: dict[str, float], what: str, steps: int = cases.STEPS) -> None:
    assert "error" not in got, f"{what} failed:\n{got.get('error')}"
    for key in cases.SERIES:
        assert len(got[key]) == len(want[key]) == steps, (what, key, got[key])
        err = _series_rel(got[key], want[key])
        assert err <= limits[key], f"{what}: {key} {got[key]} vs {want[key]}: {err:.2e} (bound {limits[key]:.2e})"
    assert got["state"].keys() == want["state"].keys(), what
    for key, value in want["state"].items():
        err = _rel(got["state"][key], value)
        assert err <= limits[key], f"{what}: state_dict[{key!r}] off by {err:.2e} (bound {limits[key]:.2e})"


def test_ddp_matches_one_process(results):
    """The reference is sound: SFTTrainer + DDP on 2 ranks equals SFTTrainer in one process on the global batch."""
    limits = {**{k: DDP_STATE_REL for k in results["eager"]["state"]}, **{k: DDP_REL for k in cases.SERIES}}
    assert_close(results["ddp"], results["eager"], limits, "SFTTrainer + DDP vs one process")


@pytest.mark.parametrize("stage", STAGES)
def test_sft_trainer_matches_ddp(results, stage):
    got, ddp = results[stage], results["ddp"]
    assert_close(got, ddp, bounds(ddp, results["eager"]), f"ZGraphSFTTrainer stage {stage} vs SFTTrainer + DDP")
    for key in cases.EVAL:
        assert got[key] == pytest.approx(ddp[key], rel=EVAL_REL), (key, got[key], ddp[key])
    assert got["sharded"] == (got["parameters"] if stage == 3 else 0) and got["parameters"] > 0, got


def test_dynamic_padding_matches_ddp(results):
    """Batches padded to their longest row (a new shape every step, each rank's own): every logged series and the
    final state equal SFTTrainer + DDP's; each rank did see more than two shapes."""
    got, ddp = results["dynamic"], results["ddp_dynamic"]
    limits = bounds(ddp, results["eager_dynamic"])
    what = f"ZGraphSFTTrainer stage {DYNAMIC_STAGE}, dynamic padding, vs SFTTrainer + DDP"
    assert_close(got, ddp, limits, what, steps=cases.DYNAMIC_STEPS)
    assert all(len(shapes) > 2 for shapes in got["shapes"]), got["shapes"]


def test_dynamic_padding_captures_at_most_twice(results):
    got = results["dynamic"]
    assert "error" not in got, got.get("error")
    assert max(got["captures"]) <= 2, (got["captures"], got["shapes"])


def test_padding_free_matches_ddp_and_captures_at_most_twice(results):
    """``padding_free=True``: each rank's rows concatenated into one (its length the rank's own, every step),
    packed sequences told apart by ``position_ids`` (SDPA here; flash attention's Python-int maximum lengths are
    left out of the step where the attention does not read them): SFTTrainer + DDP's series and state, at most two
    captures on each rank."""
    got, ddp = results["padding_free"], results["ddp_padding_free"]
    limits = bounds(ddp, results["eager_padding_free"])
    what = f"ZGraphSFTTrainer stage {DYNAMIC_STAGE}, padding-free, vs SFTTrainer + DDP"
    assert_close(got, ddp, limits, what, steps=cases.DYNAMIC_STEPS)
    assert all(len(shapes) > 2 for shapes in got["shapes"]), got["shapes"]
    assert max(got["captures"]) <= 2, (got["captures"], got["shapes"])


@pytest.mark.parametrize("autocast", [False, True])
def test_chunked_logprob_op_is_trls_kernel(autocast):
    """The op the step traces in place of TRL's chunked log-prob kernel (``zgraph.integrations.trl_logprob``) gives
    the kernel's outputs and gradients bit for bit: more tokens than one of its tiles, two vocabulary tiles, a
    temperature, soft-capping and a logit scale, entropy's gradient; in fp32 and under bf16 autocast."""
    from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE, ChunkedLogProbFunction

    from zgraph.integrations.trl_logprob import ChunkedLogProb

    g = torch.Generator().manual_seed(0)
    n, hidden_size, vocab = TOKEN_CHUNK_SIZE + 5, 8, 23
    hidden, weight = torch.randn(n, hidden_size, generator=g), torch.randn(vocab, hidden_size, generator=g)
    bias, targets = torch.randn(vocab, generator=g), torch.randint(0, vocab, (n,), generator=g)
    results = []
    for function in (ChunkedLogProbFunction, ChunkedLogProb):
        x, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = function.apply(x, w, b, targets, 0.7, 16, 30.0, 1.5, ("entropy", "is_top1"))
        logprobs, entropy, log_sum_sq, mean_logits, is_top1 = out
        assert log_sum_sq is None and mean_logits is None
        (logprobs.sum() + 0.5 * entropy.sum()).backward()
        results.append([logprobs, entropy, is_top1, x.grad, w.grad, b.grad])
    for kernel, op in zip(*results, strict=True):
        assert torch.equal(kernel, op)


# ------------------------------------------------------------------------ arguments, and what is refused when built
@pytest.fixture
def no_telemetry(monkeypatch):
    """TRL's trainers ping the Hub when built (a daemon thread): not from tests (the workers set it by env)."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_TELEMETRY", True)


def _build(args, **kwargs):
    import hf_cases

    from zgraph.integrations.trl import ZGraphSFTTrainer

    data, tokenizer = cases.texts(8, seed=1), cases.tokenizer()
    return ZGraphSFTTrainer(hf_cases.gpt2(), args, train_dataset=data, processing_class=tokenizer, **kwargs)


def test_deepspeed_json_read_by_zgraph(tmp_path, no_telemetry):
    """ZGraphSFTConfig(deepspeed=...) needs no DeepSpeed package: the JSON is zgraph's Config (stage 2, the
    arguments' clipping for "auto"); plain TrainingArguments whose deepspeed is set are rebuilt as ZGraphSFTConfig
    (SFTTrainer would rebuild them as SFTConfig, whose deepspeed is DeepSpeed's)."""
    from transformers import TrainingArguments

    from zgraph.integrations.trl import ZGraphSFTConfig

    json = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    trainer = _build(cases.arguments(str(tmp_path), cls=ZGraphSFTConfig, deepspeed=json))
    assert (trainer.zgraph_setup.config.stage, trainer.zgraph_setup.max_grad_norm) == (2, 1.0)
    plain = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], gradient_accumulation_steps=2)
    plain.deepspeed = json
    trainer = _build(plain)
    assert isinstance(trainer.args, ZGraphSFTConfig) and trainer.args.deepspeed == json
    assert trainer.zgraph_setup.config.stage == 2 and trainer.args.gradient_accumulation_steps == 2


REFUSED = {
    "label_smoothing_factor": (dict(label_smoothing_factor=0.1), {}, "label_smoothing_factor: deprecated"),
    "activation_offloading": (dict(activation_offloading=True), {}, "activation_offloading=True"),
    "compute_loss_func": ({}, dict(compute_loss_func=lambda *a, **k: None), "compute_loss_func: deprecated"),
}


@pytest.mark.parametrize("case", list(REFUSED))
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_refused_when_built(tmp_path, no_telemetry, case):
    import zgraph
    from zgraph.integrations.trl import ZGraphSFTConfig

    changes, kwargs, message = REFUSED[case]
    args = cases.arguments(str(tmp_path), cls=ZGraphSFTConfig, **changes)
    with pytest.raises(ValueError, match=message):
        _build(args, zgraph_config=zgraph.Config(backend="eager"), **kwargs)
