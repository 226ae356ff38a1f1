"""Pipeline parallelism on unmodified models (issue 42's exactness target): Hugging Face Llama and the demo GPT cut
into 2 stages on 2 gloo ranks, and 4 stages on 4, equal eager PyTorch on the whole batch (``pipeline_models_cases``);
Hugging Face's ``LabelSmoother`` as a pipelined loss. Needs transformers (the hf mark: run by ``.ci/run`` with
``-m hf``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from pipeline_models_cases import llama  # noqa: E402

pytestmark = pytest.mark.hf
CASES = ["llama_1f1b", "gpt_zb_h1"]


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def ranks(request, tmp_path_factory):
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("pipeline_models") / "results.pt"
    run_ranks(request.param, "pipeline_models_cases.run", str(path), CASES, timeout=300)
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("case", CASES)
def test_an_unmodified_model_in_stages_equals_eager_on_the_whole_batch(ranks, case):
    """Every rank's losses are eager's on the whole batch (the token mean over uneven label counts combined
    exactly), each parameter is held by exactly one rank, and after 3 AdamW steps the parameters a rank holds are
    eager's within 5x the largest distance fp32's order alone makes on the model: eager accumulating the same
    micro-batches' gradients (the same arithmetic in another order; AdamW turns the rounding noise of the key
    biases' zero gradients into updates of up to ``lr``, so that distance is ~3e-5 for the GPT, ~3e-6 for Llama)."""
    result = ranks[case]
    assert not (isinstance(result, dict) and "error" in result), result.get("error")
    names = sorted(n for n, _ in llama().named_parameters()) if case.startswith("llama") else None
    held = sorted(n for r in result for n in r["held"])
    assert len(held) == len(set(held)), "a parameter held by two ranks"
    if names is not None:
        assert held == names
    yardstick = max(d for r in result for d in r["order"].values())  # the model's fp32 order noise
    for r in result:
        torch.testing.assert_close(torch.stack(r["got"]), torch.stack(r["want"]), rtol=1e-5, atol=1e-6)
        assert max(r["distance"].values()) <= 5 * yardstick, (r["distance"], yardstick)


def test_hugging_faces_label_smoother_combines_over_micro_batches_as_eager(monkeypatch):
    """``LabelSmoother`` (what ``Trainer`` runs with ``label_smoothing_factor``) divides by the labels' number less
    the ignored ones' (``numel() - sum()``): counted over the whole batch before the micro-batches run, so the
    losses and parameters are eager's on the whole batch (stages on one rank, 4 micro-batches of uneven counts)."""
    import pipeline_cases
    from test_pipeline import assert_equals_eager
    from transformers.trainer_pt_utils import LabelSmoother

    smoother = LabelSmoother(epsilon=0.1)
    loss = lambda logits, y: smoother({"logits": logits}, y.masked_fill(y == 0, -100))  # noqa: E731
    monkeypatch.setitem(pipeline_cases.LOSSES, "hf_label_smoother", loss)
    config = {"schedule": "interleaved_1f1b", "pipeline_virtual_stages": 2, "microbatches": 4}
    assert_equals_eager([pipeline_cases.train(pipeline_parallel=1, loss="hf_label_smoother", **config)])
