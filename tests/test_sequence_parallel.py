"""Sequence parallelism (``Config.sequence_parallel``, Ulysses) against eager PyTorch on whole sequences of the
global batch: a GPT at sequence_parallel 2 (2 ranks), 4 (4 ranks) and 2 x data 2 (4 ranks), and a Hugging Face
Llama (rotary positions, grouped-query attention, labels shifted before the cut) at 2 and 2 x 2, ZeRO stages 0-3:
losses, parameters after 3 SGD steps (momentum), and every parameter's gradient (stages 0-1, where they stay whole: a
gradient dropped on the way, as peers have had, fails here). Bad input is refused before anything runs."""

from __future__ import annotations

import pytest
import sequence_cases as sc
import torch
from dist_harness import run_ranks

import zgraph

STAGES = [0, 1, 2, 3]
LAYOUTS = {"sp2": (2, 2), "sp4": (4, 4), "dp2xsp2": (4, 2)}  # name: (world, sequence_parallel)
CASES = [f"gpt/{n}" for n in LAYOUTS] + ["llama/sp2", "llama/dp2xsp2"]  # Llama's 2 key/value heads: not over 4
REL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    found = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        runs = []
        for case in CASES:
            model, layout = case.split("/")
            w, sp = LAYOUTS[layout]
            runs += [(f"{case}/{stage}", model, sp, stage, {}) for stage in STAGES if w == world]
        if world == 2:  # composed with activation recomputation (the all-to-alls recomputed with what reads them)
            runs += [(f"gpt/sp2/3/remat-{p}", "gpt", 2, 3, {"remat": p}) for p in ("selective", "full")]
        path = tmp_path_factory.mktemp(f"sp{world}") / "results.pt"
        run_ranks(world, "sequence_cases.run", str(path), runs, timeout=600)
        found.update(torch.load(path, weights_only=False))
    return found


@pytest.fixture(scope="module")
def reference():
    return {"gpt": sc.reference("gpt"), "llama": sc.reference("llama")}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", CASES)
def test_matches_eager_on_whole_sequences(results, reference, case, stage):
    got = results[f"{case}/{stage}"]
    reference = reference[case.split("/")[0]]
    assert "error" not in got, got.get("error")
    for i, (a, b) in enumerate(zip(got["losses"], reference["losses"], strict=True)):
        assert abs(a - b) <= REL * abs(b), f"loss {i}: {a} vs {b}"
    for key, value in reference["params"].items():
        assert _rel(got["params"][key], value) <= REL, key
    if got["grads"] is not None:
        for key, value in reference["grads"].items():
            assert got["grads"][key].abs().max() > 0, f"{key}: gradient dropped"
            assert _rel(got["grads"][key], value) <= REL, f"gradient of {key}"
    assert got["collectives"].count("all_to_all") == 8 * 2  # per layer: q, k, v, out and 4 in the backward


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_composes_with_activation_recomputation(results, reference, policy):
    got = results[f"gpt/sp2/3/remat-{policy}"]
    assert "error" not in got, got.get("error")
    for i, (a, b) in enumerate(zip(got["losses"], reference["gpt"]["losses"], strict=True)):
        assert abs(a - b) <= REL * abs(b), f"loss {i}: {a} vs {b}"
    for key, value in reference["gpt"]["params"].items():
        assert _rel(got["params"][key], value) <= REL, key


def test_checkpoint_saved_with_sequence_parallelism_resumes_without(tmp_path, reference):
    """2 ranks at sequence_parallel=2 (stage 3) train 2 steps and save; one process loads and takes the third step
    on whole sequences: the parameters eager PyTorch has after 3 steps."""
    path = tmp_path / "ckpt"
    run_ranks(2, "sequence_cases.save_worker", str(path), timeout=300)
    model, opt = sc.build("gpt")
    zgraph.load(str(path), model, opt)
    zgraph.distribute(backend="eager")(sc.train_step)(model, opt, *sc.batches()[2])
    for key, value in reference["gpt"]["params"].items():
        assert _rel(model.state_dict()[key], value) <= REL, key


def test_sequence_not_dividing_is_refused():
    idx = torch.zeros(2, 15, dtype=torch.long)
    with pytest.raises(ValueError, match="length 15 .* does not divide into sequence_parallel=2"):
        zgraph.shard_sequence((idx, idx), 2, rank=0)


def test_bad_sequence_parallel_values_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="Config.sequence_parallel must be None or a positive int"):
        zgraph.Config(sequence_parallel=0)
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="Config.sequence_parallel=4 does not divide the world size 6"):
        zgraph.Config(sequence_parallel=4)
