"""A program using zgraph ends cleanly when it simply ends: no ``destroy_process_group``, no ``os._exit``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_program.py")


@pytest.mark.stress
def test_twenty_two_rank_runs_that_end_without_destroying_the_group_all_exit_zero():
    # zgraph starts the group from torchrun's variables; at exit it destroys its own groups and that group
    # (gloo torn down during interpreter finalization aborted 3 runs in 40 before)
    # a session of its own: at the deadline the program and the ranks it forked are ended together
    program = subprocess.Popen(
        [sys.executable, PROGRAM, "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = program.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        os.killpg(program.pid, signal.SIGKILL)
        out, err = program.communicate()
    lines = out.splitlines()
    failed = [line for line in lines if line.startswith("run ") and line.split(": ")[1] != "0 0"]
    assert program.returncode == 0 and not failed, f"{failed}\n{out[-2000:]}\n{err[-4000:]}"
    assert lines[-1] == "clean 20/20", out
