"""One rank's failure ends every rank with an error naming the cause, within Config.collective_timeout; ranks
start from rank 0's weights. The ranks run ``failure_cases``; these tests read what each rank raised."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from failure_cases import TIMEOUT

LIMIT = TIMEOUT + 6  # the timeout, the grace for a failure record, and the work of the call itself


def _records(tmp_path, target: str, world: int = 2, fresh: bool = True) -> list[dict]:
    out = tmp_path / "record"
    # fresh ranks: each failure case breaks its group on purpose (zgraph refuses every later call in it)
    run_ranks(world, f"failure_cases.{target}", str(out), timeout=180, fresh=fresh)
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]


def test_a_rank_failing_mid_graph_ends_every_rank(tmp_path):
    rank0, rank1 = _records(tmp_path, "mid_graph_failure")
    kind, message = rank1["first"]["error"]
    assert kind == "RuntimeError" and "boom on rank 1" in message
    kind, message = rank0["first"]["error"]
    assert kind == "RankFailedError", message
    assert "rank 1 failed" in message and "boom on rank 1" in message and "call 1 of step" in message
    assert rank0["first"]["seconds"] < LIMIT
    # rank 1 caught its error and called again: refused at once, naming the earlier failure (no hang)
    kind, message = rank1["again"]["error"]
    assert kind == "RankFailedError" and "boom on rank 1" in message
    assert rank1["again"]["seconds"] < 1


def test_a_pipeline_stage_failing_mid_schedule_ends_every_rank(tmp_path):
    """Rank 0 waits for a gradient the failing rank never sends: its receive is bounded by the timeout, as a
    collective's, and it raises naming rank 1's error (issue 42, pipeline item 3)."""
    rank0, rank1 = _records(tmp_path, "pipeline_stage_failure")
    kind, message = rank1["first"]["error"]
    assert kind == "RuntimeError" and "boom in rank 1's backward" in message
    kind, message = rank0["first"]["error"]
    assert kind == "RankFailedError", message
    assert "rank 1 failed" in message and "boom in rank 1's backward" in message and "call 1 of step" in message
    assert rank0["first"]["seconds"] < LIMIT


def test_a_capture_error_caught_on_one_rank_ends_every_rank(tmp_path):
    rank0, rank1 = _records(tmp_path, "capture_failure_caught")
    kind, message = rank1["first"]["error"]
    assert kind == "CaptureError", message
    kind, message = rank0["first"]["error"]
    assert kind == "RankMismatchError", message
    assert "Rank 1 could not build its graph" in message and "CaptureError" in message
    assert "numpy" not in message.lower()
    assert rank0["first"]["seconds"] < LIMIT
    # rank 1 went on and called again; rank 0 had stopped: rank 1 raises within the timeout, naming rank 0
    kind, message = rank1["again"]["error"]
    assert kind in ("RankFailedError", "CaptureError"), message
    assert rank1["again"]["seconds"] < LIMIT


def test_an_extra_call_on_one_rank_raises_instead_of_waiting(tmp_path):
    rank0, _ = _records(tmp_path, "extra_call")
    kind, message = rank0["first"]["error"]
    assert kind == "RankFailedError", message
    assert "call 2 of step" in message and "rank 1: call 1 of step" in message
    assert TIMEOUT - 1 < rank0["first"]["seconds"] < LIMIT


@pytest.mark.parametrize("world", [2])
def test_ranks_start_from_rank0_weights_at_every_stage(tmp_path, world):
    # nothing fails here: the session's shared ranks (no spawn of its own)
    for rank, distances in enumerate(_records(tmp_path, "different_initial_weights", world, fresh=False)):
        for stage, distance in distances.items():
            assert distance < 1e-6, f"rank {rank}, stage {stage}: {distance}"
