"""``benchmarks.big_model`` at a tiny size (2 ranks, zgraph's route, one repeat; ~20 s): every phase ran on every
rank and measured something, and the saved files hold the checkpoint's tensors. No timing is checked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.hf
pytest.importorskip("transformers")  # the benchmark builds its Llama with transformers
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import big_model  # noqa: E402

TINY = ["--hidden", "128", "--intermediate", "320", "--layers", "2", "--heads", "4", "--kv-heads", "2"]


def test_big_model_benchmark_runs_at_a_tiny_size(tmp_path):
    argv = TINY + ["--vocab", "1024", "--worlds", "2", "--routes", "zgraph", "--repeats", "1"]
    result = big_model.main(argv + ["--save-repeats", "1", "--dir", str(tmp_path), "--no-write", "--timeout", "300"])
    assert [run["error"] for run in result["runs"]] == [None]
    assert all(run["saved_equal"] for run in result["runs"])
    phases = {(row["route"], row["phase"]) for row in result["summary"]}
    assert {("zgraph", "load"), ("zgraph", "save"), ("zgraph", "read_all")} <= phases
    for row in result["summary"]:
        assert row["hwm_abs"] > 0 and row["seconds"][1] > 0, row
    assert list(tmp_path.iterdir()) == [], "the checkpoint and the saves are removed"
