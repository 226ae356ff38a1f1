"""pytest hooks for the suite: one thread per process, as on every spawned rank, so that an eager reference
computed in the pytest process rounds as the ranks do (``OMP_NUM_THREADS=1`` by default, for the subprocesses too);
the rank groups ``dist_harness.run_ranks`` shares end with the session; the longest files run first."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after the thread count it reads)
from dist_harness import close_groups  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_sessionfinish(session, exitstatus):
    close_groups()


# The files that take longest (seconds of a worker, measured), first: with `-n 2` each worker takes the next file
# when it finishes one (pyproject: `--dist loadfile --no-loadscope-reorder`), so long files started last would
# leave one worker running alone at the end. The other files follow in their usual order.
LONGEST_FIRST = (
    "test_zero_parity.py",
    "test_sequence_parallel.py",
    "test_estimate.py",
    "test_split.py",
    "test_hybrid.py",
    "test_multinode.py",
    "test_held_between_steps.py",
    "test_offload.py",
    "test_demo.py",
    "test_remat.py",
    "test_torch_optimizers.py",
    "test_memory_budget.py",
    "test_meta_init.py",
    "test_memory_compose.py",
    "test_failures.py",
    "test_dynamic_shapes.py",
    "test_zero_checks.py",
    "test_checkpoint_integrity.py",
)


def pytest_collection_modifyitems(session, config, items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))
