"""Saving a ZeRO-3 Hugging Face model with ``save_pretrained`` (issue 16, item 4): zgraph's error where the
parameters are sharded, a loadable checkpoint from ``zgraph.full_state_dict``. Needs the ``models`` extra."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from dist_harness import run_ranks  # noqa: E402


def test_save_pretrained_needs_whole_tensors_and_then_round_trips(tmp_path):
    run_ranks(2, "hf_save_cases.save_pretrained_at_stage3", str(tmp_path), timeout=600)
