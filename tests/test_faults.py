"""The fault matrix of what came after ``test_failures``: split mode and the NVMe offload tier (the ranks run
``fault_cases``). A rank killed or failing ends every other rank with zgraph's named error within
``Config.collective_timeout``, and nothing saved is lost: a checkpoint saved before the fault loads as the state
it saved, and the tier's current copies are the last committed step's. The slower cases (a full disk on one of
two ranks, the store's rank killed, a Ray actor of ``zgraph demo --multimodal`` killed) are in
``benchmarks/faults.py``."""

from __future__ import annotations

import os
import time

import pytest
import torch
from dist_harness import _entry, free_port, rank_context
from failure_cases import TIMEOUT

import zgraph

LIMIT = TIMEOUT + 6  # the timeout, the grace for a failure record, and the work of the call itself
KILLED = -9


def run_with_casualties(world: int, target: str, *args: object, timeout: float = 180) -> list[int]:
    """Run ``fault_cases.<target>(rank, world, *args)`` on ``world`` ranks started as ``run_ranks`` starts them,
    some of which are meant to die (``dist_harness.run_ranks`` ends every rank when one does); returns each rank's
    exit code, after killing every rank still running at ``timeout`` seconds (a hang) and failing."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    context, environ = rank_context(), dict(os.environ)
    port, fn = free_port(), f"fault_cases.{target}"
    ranks = [context.Process(target=_entry, args=(r, world, port, fn, args, True, environ)) for r in range(world)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, process in enumerate(ranks) if process.is_alive()]
    for r in hung:
        ranks[r].kill()
        ranks[r].join()
    assert not hung, f"{target}: rank(s) {hung} still running after {timeout:.0f} s (killed)"
    return [process.exitcode for process in ranks]


def _records(tmp_path, target: str, *args: object, world: int = 2) -> tuple[list[int], list[dict | None]]:
    out = tmp_path / "record"
    codes = run_with_casualties(world, target, str(out), *args)
    paths = [f"{out}.{rank}" for rank in range(world)]
    return codes, [torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths]


def _named(attempt: dict, kind: str, *parts: str) -> str:
    """The message of ``attempt``'s error, after checking it is ``kind``, names every part and came in time."""
    assert attempt["error"] is not None, "no error raised"
    raised, message = attempt["error"]
    assert raised == kind, (raised, message)
    assert all(part in message for part in parts), message
    assert attempt["seconds"] < LIMIT, attempt["seconds"]
    return message


# ------------------------------------------------------------------------------------------------ split mode
def test_a_rank_dying_between_forward_and_backward_ends_the_backward(tmp_path):
    codes, (rank0, _) = _records(tmp_path, "split_rank_dies")
    assert codes == [0, KILLED]
    _named(rank0["backward"], "RankFailedError", "backward of call 1 of step", "encode")
    # the group is broken: the next call refuses at once instead of pairing collectives with a dead rank
    _named(rank0["again"], "RankFailedError", "out of step")
    assert rank0["again"]["seconds"] < 1


def test_dropped_outputs_then_one_rank_out_of_step(tmp_path):
    codes, records = _records(tmp_path, "split_outputs_dropped")
    assert codes == [0, 0]
    for record in records:  # outputs dropped on every rank: no gradient, and the next call runs
        assert record["dropped"]["grads"] == [None] * 4
        assert record["next"]["error"] is None
        assert all(g is not None and g.isfinite().all() for g in record["next"]["grads"])
    # rank 1 dropped its outputs and called again, rank 0 backpropagated: both named, neither paired
    # mismatched collectives (gloo aborted the process on them)
    for record in records:
        _named(record["mismatch"], "RankMismatchError", "backward of call 3 of step", "call 4 of step")


# ---------------------------------------------------------------------------------------- the store's host
def test_the_rank_serving_the_store_dying_ends_the_others_with_zgraphs_error(tmp_path):
    # the failure records cannot be read from a store that is gone: the error says so instead of the store's
    # own DistNetworkError escaping from zgraph's failure handling
    codes, (_, rank1) = _records(tmp_path, "store_host_dies")
    assert codes == [KILLED, 0]
    _named(rank1["step"], "RankFailedError", "call 1 of step", "store cannot be reached")
    _named(rank1["again"], "RankFailedError", "call 2 of step")
    assert rank1["again"]["seconds"] < 1


# ----------------------------------------------------------------------------------------------- NVMe tier
def _checkpoint_loads_as_saved(directory, saved: dict) -> None:
    """The checkpoint the ranks saved before the fault loads, in one process, as the state they saved."""
    from offload_cases import make, same

    model, opt = make(seed=5)
    zgraph.load(directory / "ckpt", model, opt)
    assert same(zgraph.full_state_dict(model, opt), saved)


def test_a_rank_killed_during_an_offload_write_back(tmp_path):
    codes, (rank0, rank1) = _records(tmp_path, "offload_rank_dies", str(tmp_path))
    assert codes == [0, KILLED]
    # rank 0 finishes the step if its collectives were done before the kill; it fails at the latest on the next
    attempts = [a for a in (rank0["step"], rank0["again"]) if a["error"] is not None]
    _named(attempts[0], "RankFailedError", "rank 0")
    # the killed rank's tier: the torn write went to the next copies, the current ones are the last step's
    assert _unchanged(rank1["copies"]), "a current copy of the killed rank changed"
    _checkpoint_loads_as_saved(tmp_path, rank0["saved"])


def _unchanged(copies: dict[str, str]) -> bool:
    from fault_cases import sha256

    return all(os.path.exists(path) and sha256(path) == digest for path, digest in copies.items())


def test_a_full_disk_mid_step_in_one_process(tmp_path, monkeypatch):
    """The write-backs of a step fail with ENOSPC: an ``OffloadError`` naming the file and the cause; the tier's
    current copies and the checkpoint saved before are the last committed step's state."""
    from fault_cases import NoSpace, current_copies, offload_run
    from offload_cases import same

    from zgraph.runtime import offload_nvme
    from zgraph.runtime.offload import OffloadError

    model, opt, step, data, record = offload_run(0, 1, str(tmp_path))
    monkeypatch.setattr(offload_nvme, "os", NoSpace())
    with pytest.raises(OffloadError, match=f"{tmp_path / 'tier'}.*No space left on device.*last checkpoint"):
        step(model, opt, *data[0])
    monkeypatch.undo()
    assert current_copies(step) == record["copies"]
    saved = record["saved"]
    _checkpoint_loads_as_saved(tmp_path, saved)
    assert not same(zgraph.full_state_dict(model, opt), saved)  # the error's advice: parameters partly updated
