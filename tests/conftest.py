"""pytest hooks for the suite: one thread per process, as on every spawned rank, so that an eager reference
computed in the pytest process rounds as the ranks do (``OMP_NUM_THREADS=1`` by default, for the subprocesses too);
the rank groups ``dist_harness.run_ranks`` shares end with the session."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after the thread count it reads)
from dist_harness import close_groups  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_sessionfinish(session, exitstatus):
    close_groups()
