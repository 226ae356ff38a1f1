"""One rank of a two-node job, for ``tests/test_multinode.py``: run by two torchrun agents on one machine, each
``--nnodes 2 --nproc-per-node 2`` with a c10d rendezvous, as two machines would run it.

usage: torchrun ... tests/multinode_program.py parity|train OUT_DIR

Every rank first writes ``OUT_DIR/env.<RANK>.json``: torchrun's variables as it saw them, its pid and its
agent's (the test kills a node's workers by these pids: torchrun starts each worker in a session of its own, so
killing an agent's process group leaves its workers running).

``parity``: ``zero_cases``' AdamW case at stage 3 (every parameter sharded), each global rank taking its slice of
the global batch; rank 0 writes the averaged losses and ``zgraph.full_state_dict`` to ``OUT_DIR/result.pt``.

``train``: the same model steps on until ``TRAIN_SECONDS`` pass or a step raises, with
``Config.collective_timeout=COLLECTIVE_TIMEOUT``; each rank writes ``OUT_DIR/progress.<RANK>`` (steps done)
after every step and, when a step raises, ``OUT_DIR/outcome.<RANK>.json`` (the error's class and message, and
when it was raised, ``time.time()``), then exits 1.

A rank still running ``WATCHDOG_SECONDS`` after it started prints every thread's stack and exits: a rank the
test failed to end cannot outlive it for long.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback

import torch
from zero_cases import CASES, run_case, slice_batch

import zgraph

COLLECTIVE_TIMEOUT = 20.0
TRAIN_SECONDS = 90.0
WATCHDOG_SECONDS = 150.0
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR")


def _write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole (a reader never sees half of it)."""
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


def parity(rank: int, world: int, out: str) -> None:
    result = run_case(CASES["adamw"], 3, rank, world)
    if rank == 0:
        torch.save({"losses": result["losses"], "model": result["models"][0]}, os.path.join(out, "result.pt"))


def train(rank: int, world: int, out: str) -> None:
    case = CASES["adamw"]
    model, opt = case.make(world)
    config = zgraph.Config(
        stage=3, backend="eager", param_persistence_threshold=0, collective_timeout=COLLECTIVE_TIMEOUT
    )
    step = zgraph.distribute(config)(case.step)
    batches = case.batches()
    start = time.monotonic()
    done = 0
    while time.monotonic() - start < TRAIN_SECONDS:
        try:
            step(model, opt, *slice_batch(batches[done % len(batches)], rank, world))
        except Exception as error:
            traceback.print_exc()
            outcome = {"error": type(error).__name__, "message": str(error), "at": time.time()}
            _write(os.path.join(out, f"outcome.{rank}.json"), json.dumps(outcome))
            sys.stdout.flush()
            os._exit(1)
        done += 1
        _write(os.path.join(out, f"progress.{rank}"), str(done))


def main(mode: str, out: str) -> None:
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS, exit=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    seen = {key: os.environ.get(key) for key in ENV_KEYS}
    _write(os.path.join(out, f"env.{rank}.json"), json.dumps({**seen, "pid": os.getpid(), "agent": os.getppid()}))
    {"parity": parity, "train": train}[mode](rank, world, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
