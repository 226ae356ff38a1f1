"""The machine and processes around ``benchmarks.compare``: each rank's environment, the parallel-throughput
probe, other load on the CPUs (``ForeignLoad``, ``wait_for_idle``), and the facts a report states (CPU,
versions, revision)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
GRACE_S = 15.0  # how long the other ranks may live on after one rank failed (they may hang in a collective)
FOREIGN_LOAD_WARN = 0.05  # share of the machine's CPU time used by other processes that makes a run suspect
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_PROBE = """
import time, torch
torch.set_num_threads(1)
a = torch.randn(384, 384)
end, n = time.perf_counter() + {seconds}, 0
while time.perf_counter() < end:
    a @ a
    n += 1
print(n)
"""


def free_port() -> int:
    """A TCP port free on localhost now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    """The environment of every benchmark process: one thread, CPU DeepSpeed, no inherited rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TORCHINDUCTOR_COMPILE_THREADS="1",
        DS_ACCELERATOR="cpu",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    return env


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """torchrun-style variables for one rank."""
    env = base_env()
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return env


def deepspeed_status(timeout: float = 600.0) -> tuple[str | None, str | None]:
    """``(version, None)`` if ``import deepspeed`` works in a fresh process, else ``(None, why)``."""
    code = "import deepspeed; print(deepspeed.__version__)"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], env=base_env(), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, f"`import deepspeed` took more than {timeout:.0f} s"
    if proc.returncode != 0:
        return None, "`import deepspeed` failed: " + last_lines(proc.stderr, 1)
    return proc.stdout.strip().splitlines()[-1], None


def parallel_probe(seconds: float = 2.0) -> tuple[float, float | None]:
    """Throughput of two concurrent one-thread matmul processes over one alone (2.0: two independent cores),
    and the share of the CPUs other processes used meanwhile."""
    cmd = [sys.executable, "-c", _PROBE.format(seconds=seconds)]

    def rates(n: int) -> list[int]:
        procs = [subprocess.Popen(cmd, env=base_env(), stdout=subprocess.PIPE, text=True) for _ in range(n)]
        try:
            return [int(p.communicate(timeout=120)[0].strip() or 0) for p in procs]
        finally:
            terminate(procs)

    with ForeignLoad() as load:
        alone = rates(1)[0]
        together = sum(rates(2))
    return (together / alone if alone else float("nan")), load.share


def undisturbed_probe(args: argparse.Namespace) -> tuple[float, float | None]:
    """``parallel_probe`` after waiting for an idle machine; again (``args.retries`` times at most) while other
    processes disturbed it. The least disturbed result."""
    probes = []
    for _ in range(args.retries + 1):
        wait_for_idle(args.wait_idle)
        probes.append(parallel_probe())
        if (probes[-1][1] or 0.0) <= FOREIGN_LOAD_WARN:
            break
    return min(probes, key=lambda p: p[1] or 0.0)


def machine_facts(ds_version: str, probe: tuple[float, float | None]) -> dict[str, Any]:
    """What the numbers depend on."""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": ds_version,
        "zgraph": zgraph_revision(),
        "threads_per_rank": 1,
        "two_process_scaling": round(probe[0], 2),
        "two_process_scaling_other_load": None if probe[1] is None else round(probe[1], 3),
    }


def zgraph_revision() -> str:
    """The repository's commit, marked ``+dirty`` if the library's sources have uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "zgraph", "passes", "runtime")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (commit or "unknown") + ("+dirty" if dirty else "")


def revision_span(start: str, end: str) -> str:
    """One revision, or both when the library changed while the benchmark ran."""
    return start if start == end else f"{start} at start, {end} at end (the library changed during the run)"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or platform's guess)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has used since boot (all CPUs; /proc/stat, steal included)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user / nice
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this harness and of the processes it started and reaped."""
    return sum(
        u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def _counters() -> tuple[float, float, float]:
    return machine_busy_s(), own_cpu_s(), time.perf_counter()


class ForeignLoad:
    """Share of the machine's CPU time used by processes the harness did not start, over a ``with`` block
    (``share``, set on exit)."""

    share: float | None = None

    def __enter__(self) -> ForeignLoad:
        self._start = _counters()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, own, wall = (end - start for end, start in zip(_counters(), self._start))
        if wall > 0:
            self.share = max(0.0, busy - own) / (wall * (os.cpu_count() or 1))


def wait_for_idle(max_wait: float, sample: float = 1.0) -> float | None:
    """Wait (at most ``max_wait`` s) until other processes use under FOREIGN_LOAD_WARN of the CPUs over a
    ``sample``-second window; returns the last share measured (None if not waited)."""
    if max_wait <= 0:
        return None
    deadline = time.monotonic() + max_wait
    while True:
        with ForeignLoad() as load:
            time.sleep(sample)
        if load.share is None or load.share < FOREIGN_LOAD_WARN or time.monotonic() >= deadline:
            return load.share


# ------------------------------------------------------------------------------------------------ data


def systems_parser(systems: Sequence[str]) -> Callable[[str], list[str]]:
    """The ``--systems`` argument's type: ``all`` or a comma-separated subset of ``systems``, kept in their order;
    an unknown name is an ``argparse.ArgumentTypeError`` naming the choices."""

    def parse(text: str) -> list[str]:
        if text == "all":
            return list(systems)
        wanted = [name.strip() for name in text.split(",") if name.strip()]
        unknown = sorted(set(wanted) - set(systems))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown systems {unknown}; choose from {', '.join(systems)}")
        return [name for name in systems if name in wanted]

    return parse


def last_lines(text: str, n: int = 6) -> str:
    """The last ``n`` non-empty lines of ``text`` (a traceback's tail), joined by newlines."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def terminate(procs: list[subprocess.Popen]) -> None:
    """Stop every process this harness started, and their children (each rank leads its own session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs):
            break


def wait_ranks(procs: list[subprocess.Popen], timeout: float) -> str | None:
    """Wait for every rank; None if all exited 0, else why not (the caller stops any that are left)."""
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return None
        if any(c not in (None, 0) for c in codes) and failed_at is None:
            failed_at = time.monotonic()
        if all(c is not None for c in codes):
            return f"exit codes {codes}"
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            return f"exit codes {codes}; the other ranks were killed {GRACE_S:.0f} s after the first failure"
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f} s"
        time.sleep(0.1)
