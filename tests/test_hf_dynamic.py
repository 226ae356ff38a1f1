"""``ZGraphTrainer`` and ``ZGraphAccelerator`` with dynamic padding (issue 41, item 5).

Needs the ``hf`` extra (transformers and accelerate); skipped without them. A tiny GPT-2 classifier fine-tuned with
``DataCollatorWithPadding`` (``hf_dynamic_cases``): each rank pads each micro-batch to its own longest row, so the
shapes change from step to step and differ between the 2 ranks, as for DDP users. ZGraphTrainer and the accelerate
loop on ZGraphAccelerator at stage ``STAGE`` against Trainer + DDP and accelerate + DDP: every optimizer step's
loss, gradient norm and learning rate and the final whole state within ``hf_parity``'s bounds (DDP's own distance
to one process on the global batch). The ranks' first batches differ, so each rank captures its step once, with
those sizes symbolic (ZGraphAccelerator: its forward step, whose compiled backward serves ``accelerator.backward``,
once more for the micro-batches after the first, whose backward accumulates into ``.grad``, as with static sizes).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dist_harness import run_ranks  # noqa: E402
from hf_parity import DDP_REL, DDP_STATE_REL, SERIES, assert_close, bounds  # noqa: E402

pytestmark = pytest.mark.hf

STAGE = 3
DEADLINE = 300  # seconds for one rank group


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_dynamic")
    run_ranks(1, "hf_dynamic_cases.run_plain", str(root / "eager.pt"), timeout=DEADLINE, init_group=False)
    run_ranks(2, "hf_dynamic_cases.run_all", str(root / "runs.pt"), STAGE, timeout=DEADLINE)
    eager = torch.load(root / "eager.pt", weights_only=False)
    runs = torch.load(root / "runs.pt", weights_only=False)
    return {
        what: {"eager": eager[what], "ddp": runs[f"{what}_ddp"], "zgraph": runs[what]}
        for what in ("trainer", "accelerate")
    }


@pytest.mark.parametrize("what", ["trainer", "accelerate"])
def test_ddp_matches_one_process(results, what):
    """The reference is sound: DDP, its ranks padding each to their own longest row, equals one process."""
    result = results[what]
    limits = {**{k: DDP_STATE_REL for k in result["eager"]["state"]}, **{k: DDP_REL for k in SERIES}}
    assert_close(result["ddp"], result["eager"], limits, f"{what}: DDP vs one process")


@pytest.mark.parametrize("what", ["trainer", "accelerate"])
def test_matches_ddp_and_captures_at_most_twice(results, what):
    result = results[what]
    got = result["zgraph"]
    assert_close(got, result["ddp"], bounds(result), f"{what}: zgraph at stage {STAGE} vs DDP, dynamic padding")
    if what == "trainer":  # the ranks' first batches differ: their sizes are symbols from the first capture
        assert got["captures"] == [1, 1], got["captures"]
        shapes = got["shapes"]  # each rank saw shapes of its own, more than two
        assert shapes[0] != shapes[1] and all(len(s) > 2 for s in shapes), shapes
    else:  # the forward step is captured once more for micro-batches whose parameters' .grad it accumulates into
        assert got["captures"] == [2, 2], got["captures"]
