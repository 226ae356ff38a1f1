"""The ``zgraph`` command for tests: as a process (``command``), or by its entry point in the test's process
(``here``: no interpreter start and ``import torch``, the same exit status, standard output and standard error)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zgraph.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def command(*argv: str) -> subprocess.CompletedProcess:
    """``python -m zgraph.cli *argv`` in its own process (one thread), from the repository root."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "zgraph.cli", *argv], capture_output=True, text=True, cwd=ROOT, env=env
    )


def here(capsys: pytest.CaptureFixture, *argv: str) -> subprocess.CompletedProcess:
    """``zgraph *argv`` by ``zgraph.cli.main.main`` in this process, what it printed read from ``capsys``."""
    capsys.readouterr()
    status = main(list(argv))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["zgraph", *argv], status, out.out, out.err)
