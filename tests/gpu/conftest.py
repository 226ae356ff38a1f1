"""The GPU checks (``tests/gpu``): shared set-up.

``tests/`` (``dist_harness``) and this directory (``gpu_cases``, the ranks' side) are made importable, and each
transport's rank group is started once per session and runs every check (``results``): starting CUDA ranks costs
seconds each, and the checks are small.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (HERE, os.path.dirname(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

DEADLINE = 480  # seconds for one transport's rank group (every check); a minute or two on an idle GPU host
REHEARSAL_DEADLINE = 3600  # the CPU rehearsal (ZGRAPH_GPU_TESTS_ON_CPU=1) on a small shared machine


@pytest.fixture(scope="session")
def results(tmp_path_factory):
    """``results(transport)``: ``{check: result}`` from rank 0 of that transport's rank group (run once)."""
    import gpu_cases
    import torch
    from dist_harness import run_ranks

    cache: dict[str, dict | BaseException] = {}

    def get(name: str) -> dict:
        if name not in cache:
            transport = gpu_cases.transports()[name]
            path = tmp_path_factory.mktemp(name) / "results.pt"
            try:
                run_ranks(
                    transport.world,
                    "gpu_cases.run",
                    str(path),
                    list(gpu_cases.CHECKS),
                    timeout=DEADLINE if gpu_cases.device_type() == "cuda" else REHEARSAL_DEADLINE,
                    init_group=transport.init_group,
                )
                cache[name] = torch.load(path, weights_only=False)
            except Exception as error:  # once per session: the next test of this transport fails at once
                cache[name] = error
        found = cache[name]
        if isinstance(found, BaseException):
            raise RuntimeError(f"the {name} rank group failed: {found}") from found
        return found

    return get
