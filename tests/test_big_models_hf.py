"""Hugging Face models end to end through zgraph's big-model routes (issue 27, item 4): meta ``from_config`` →
``load_pretrained`` → stage-3 training → ``save_pretrained`` → plain ``from_pretrained``, equal to eager."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.hf
pytest.importorskip("transformers")

from dist_harness import run_ranks  # noqa: E402


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_meta_pretrained_train_export(tmp_path, tie):
    run_ranks(2, "big_model_cases.pretrained_to_trained", str(tmp_path), tie, timeout=300)


def test_from_pretrained_on_every_rank_is_neither_copied_nor_written(tmp_path):
    run_ranks(2, "big_model_cases.from_pretrained_everywhere", str(tmp_path), timeout=300)
