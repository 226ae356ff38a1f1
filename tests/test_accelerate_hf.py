"""``zgraph.integrations.accelerate.ZGraphAccelerator`` (issue 28, item 2): a user's own accelerate loop, unchanged,
run as zgraph steps, against the plain ``Accelerator`` (DDP).

Needs the ``hf`` extra (transformers and accelerate); skipped without them. The loop (``accelerate_hf_cases``):
tiny GPT-2 from a config, ``accelerator.accumulate`` over 2 micro-batches, ``accelerator.backward``,
``accelerator.clip_grad_norm_`` at 1.0, AdamW, a cosine schedule with warm-up, then an evaluation under
``torch.no_grad``. ZGraphAccelerator on 2 spawned gloo ranks at ZeRO stages 0-3 against the plain Accelerator
(DDP) on 2 ranks, both held to one process on the global batch as in ``test_trainer_hf`` (``hf_parity``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dist_harness import run_ranks  # noqa: E402
from hf_parity import DDP_REL, DDP_STATE_REL, SERIES, assert_close, bounds, rel  # noqa: E402

pytestmark = pytest.mark.hf

STAGES = [0, 1, 2, 3]
DEADLINE = 300  # seconds for one rank group; about 60 s for four stages on 2 idle cores


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("accelerate")
    run_ranks(1, "accelerate_hf_cases.run_plain", str(root / "eager.pt"), timeout=DEADLINE, init_group=False)
    run_ranks(2, "accelerate_hf_cases.run_plain", str(root / "ddp.pt"), timeout=DEADLINE)
    run_ranks(2, "accelerate_hf_cases.run_zero", str(root / "zero.pt"), STAGES, timeout=DEADLINE)
    return {
        "eager": torch.load(root / "eager.pt", weights_only=False),
        "ddp": torch.load(root / "ddp.pt", weights_only=False),
        **torch.load(root / "zero.pt", weights_only=False),
    }


def test_ddp_matches_one_process(result):
    """The reference is sound: accelerate + DDP on 2 ranks equals the loop in one process on the global batch."""
    limits = {**{k: DDP_STATE_REL for k in result["eager"]["state"]}, **{k: DDP_REL for k in SERIES}}
    assert_close(result["ddp"], result["eager"], limits, "accelerate: DDP vs one process")


@pytest.mark.parametrize("stage", STAGES)
def test_loop_matches_ddp(result, stage):
    got = result[stage]
    assert_close(got, result["ddp"], bounds(result), f"ZGraphAccelerator stage {stage} vs accelerate + DDP")
    assert rel(torch.tensor(got["eval_loss"]), torch.tensor(result["ddp"]["eval_loss"])) <= DDP_REL, got["eval_loss"]
    if stage == 3:  # every parameter sharded (param_persistence_threshold=0), none left whole
        assert got["sharded"] == got["parameters"] > 0, got


def test_save_state_load_state_and_save_model(tmp_path):
    """Stage 3: ``load_state`` of ``save_state``'s checkpoint gives a fresh model and optimizer the trained ones;
    ``save_model``'s safetensors load with ``from_pretrained``; ``get_state_dict`` is the whole state;
    ``unwrap_model(model, keep_fp32_wrapper=False)`` is the same model, still run by zgraph."""
    run_ranks(2, "accelerate_hf_cases.run_saved", str(tmp_path / "saved.pt"), timeout=DEADLINE)
    got = torch.load(tmp_path / "saved.pt", weights_only=False)
    assert "error" not in got, got.get("error")
    for other in ("resumed", "loaded", "get_state_dict"):
        assert got[other].keys() >= got["state"].keys(), other
        for key, value in got["state"].items():
            assert torch.equal(got[other][key], value), f"{other}: {key}"
    assert got["optimizer_steps"] and set(got["optimizer_steps"]) == {2.0}, got["optimizer_steps"]
    before, after = got["unwrapped_loss"]
    assert torch.equal(before, after), "unwrap_model(keep_fp32_wrapper=False) left the model running as it was"


# ------------------------------------------------------------------------------------ refused when built
REFUSED = {
    "deepspeed plugin": (dict(deepspeed_plugin=object()), r"\(deepspeed_plugin=\.\.\.\): zgraph shards the model"),
    "fsdp plugin": (dict(fsdp_plugin=object()), r"\(fsdp_plugin=\.\.\.\)"),
    "parallelism_config": (dict(parallelism_config=object()), r"\(parallelism_config=\.\.\.\): tensor, context"),
    "fp16": (dict(mixed_precision="fp16"), 'mixed_precision="fp16" scales losses'),
    "dynamo": (dict(dynamo_backend="inductor"), "dynamo_backend is set"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_when_built(case):
    from zgraph.integrations.accelerate import ZGraphAccelerator

    changes, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        ZGraphAccelerator(cpu=True, **changes)


def test_closure_refused():
    import zgraph
    from zgraph.integrations.accelerate import ZGraphAccelerator

    accelerator = ZGraphAccelerator(config=zgraph.Config(backend="eager"), cpu=True)
    model = torch.nn.Linear(2, 2)
    _, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="cannot re-run a closure"):
        optimizer.step(lambda: 0.0)
