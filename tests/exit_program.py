"""A user's program that ends by falling off its end: torchrun's variables set, zgraph starts the process group,
no ``destroy_process_group``, no ``os._exit``; run many times over by ``tests/test_exit.py``.

usage: python tests/exit_program.py RUNS [WORLD] [--without-exit-hook]

Imports torch and zgraph once, then for each run forks WORLD ranks (default 2) of the program; each rank leaves
through the interpreter's own exit (``atexit``, finalization), as a script does. Prints one line per run, the
ranks' exit statuses (``0``, a code, or ``-SIGNAL``), then ``clean N/RUNS`` (exit status 1 unless every run was).
A rank not done in 120 s is killed.
``--without-exit-hook`` unregisters zgraph's ``atexit`` hook in the ranks: the behaviour before it, to compare.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: no thread pools in the process the ranks are forked from

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zgraph  # noqa: E402
from zgraph.runtime.process_group import destroy_own_groups  # noqa: E402

RUN_DEADLINE = 120.0  # seconds one run's ranks may take


def user_program() -> None:
    """The quickstart, tiny: stage 3 (every parameter sharded), two steps."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @zgraph.distribute(zgraph.Config(stage=3, backend="eager", param_persistence_threshold=0))
    def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), torch.zeros(x.shape[0], 4))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(2):
        train_step(model, opt, torch.ones(4, 8))
    if "--without-exit-hook" in sys.argv:
        atexit.unregister(destroy_own_groups)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(raw: int | None) -> str:
    """A rank's exit as text: its code, ``-SIGNAL`` when a signal ended it, ``timeout`` when it was killed."""
    if raw is None:
        return "timeout"
    return str(os.waitstatus_to_exitcode(raw))


def wait_all(pids: list[int]) -> list[int | None]:
    """The wait statuses of ``pids``; a process still running after ``RUN_DEADLINE`` is killed (None)."""
    found: dict[int, int | None] = {}
    deadline = time.monotonic() + RUN_DEADLINE
    while len(found) < len(pids):
        for pid in pids:
            if pid not in found:
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    found[pid] = raw
        if time.monotonic() > deadline:
            for pid in set(pids) - set(found):
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                found[pid] = None
        time.sleep(0.02)
    return [found[pid] for pid in pids]


def fork_ranks(world: int) -> list[int] | None:
    """Fork ``world`` ranks with torchrun's variables; in a rank, run the program and return None."""
    port = str(free_port())
    sys.stdout.flush()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
            os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            user_program()
            return None
        pids.append(pid)
    return pids


def main(runs: int, world: int) -> None:
    clean = 0
    for run in range(runs):
        pids = fork_ranks(world)
        if pids is None:
            return  # a rank: on to the interpreter's exit
        statuses = [status(raw) for raw in wait_all(pids)]
        clean += all(s == "0" for s in statuses)
        print(f"run {run}: {' '.join(statuses)}", flush=True)
    print(f"clean {clean}/{runs}", flush=True)
    if clean < runs:
        sys.exit(1)


if __name__ == "__main__":
    numbers = [int(a) for a in sys.argv[1:] if a.isdigit()]
    main(numbers[0], numbers[1] if len(numbers) > 1 else 2)
