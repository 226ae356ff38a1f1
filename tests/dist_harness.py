"""Run a function on N local ranks (processes, gloo), as tests of multi-rank behaviour need.

The ranks are forked from a ``forkserver`` that imported this module (torch, zgraph) once per test process, not
spawned fresh interpreters that each import them (~3 CPU-s a rank); they get the test's environment with each job,
as a spawned rank got it at its start."""

from __future__ import annotations

import faulthandler
import gc
import importlib
import io
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zgraph.runtime.process_group import end_finished_rank

GROUP_TIMEOUT = 300  # seconds: the default group's collectives (the harness's barriers) never wait longer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world_size: int, port: int, init_group: bool | str) -> None:
    """A rank's torchrun environment, one thread, crash reports, and (``init_group``) the default group."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    # a crash in native code (SIGSEGV, or SIGABRT from glibc's heap checks) prints every thread's Python stack,
    # so a failure names where it happened
    faulthandler.enable(all_threads=True)
    if init_group:
        backend = init_group if isinstance(init_group, str) else "gloo"
        if backend == "standin":  # the stand-in accelerator (tests/standin.py)
            importlib.import_module("standin").install()
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=GROUP_TIMEOUT))


def _target(target: str) -> Any:
    module_name, fn_name = target.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), fn_name)


def _entry(
    rank: int, world_size: int, port: int, target: str, args: tuple, init_group: bool | str, environ: dict
) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the test's environment (the forkserver's is from when it started)
    _join(rank, world_size, port, init_group)
    try:
        _target(target)(rank, world_size, *args)
    except BaseException:
        # no barrier: the other ranks may be waiting elsewhere; exiting non-zero makes run_ranks end them all
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        _finish_together(rank, world_size)
        dist.destroy_process_group()
    end_finished_rank()


def _finish_together(rank: int, world_size: int) -> None:
    """Every rank is done before any leaves: a barrier; on the stand-in, whose collectives move nothing, through
    the store, which rank 0 serves (it must not exit while another rank still reads zgraph's last agreement)."""
    if dist.get_backend() != "standin":
        dist.barrier()
        return
    store = dist.distributed_c10d._get_default_store()
    if rank:
        store.set(f"harness/done/{rank}", b"1")
    else:
        store.wait([f"harness/done/{r}" for r in range(1, world_size)])


def _broken() -> bool:
    """Whether a zgraph call in this process marked a process group broken (its collectives out of step after a
    failure: zgraph refuses every later call on it, as a restarted job would not)."""
    agreement = sys.modules.get("zgraph.runtime.agreement")
    return bool(agreement and agreement._BROKEN)


_RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS")


def _serve(rank: int, world_size: int, port: int, init_group: bool | str, jobs: Any, results: Any) -> None:
    """Body of a pooled rank (``RankGroup``): join the group once, then run jobs ``(target, args, environ)`` until
    ``None``, each from a fresh process's generator state and environment; report ``(rank, traceback or None,
    broken)``."""
    _join(rank, world_size, port, init_group)
    own = {k: os.environ[k] for k in _RANK_VARIABLES}
    seed = torch.initial_seed()
    while (job := jobs.get()) is not None:
        target, args, environ = job
        os.environ.clear()
        os.environ.update({**environ, **own})  # the test's environment, this rank's variables
        torch.manual_seed(seed)
        try:
            _target(target)(rank, world_size, *args)
            error = None
        except BaseException:
            error = traceback.format_exc()
        gc.collect()  # what the job made is gone before the next one measures anything
        results.put((rank, error, _broken()))
    _finish_together(rank, world_size)
    dist.destroy_process_group()
    end_finished_rank()


class RankGroup:
    """``world_size`` ranks in one process group that run one test's target after another
    (``run_ranks``): the start, torch's and zgraph's import, their first-use warm-up and the group's set-up are paid
    once per session, not once per call. A rank that fails, dies or runs past the deadline ends the whole group
    (the next call starts another)."""

    def __init__(self, world_size: int, init_group: bool | str):
        self.world_size = world_size
        context = rank_context()
        self.jobs = [context.Queue() for _ in range(world_size)]
        self.results = context.Queue()
        port = free_port()
        self.processes = [
            context.Process(target=_serve, args=(r, world_size, port, init_group, self.jobs[r], self.results))
            for r in range(world_size)
        ]
        for process in self.processes:
            process.start()

    def run(self, target: str, args: tuple, timeout: float) -> None:
        """Run ``target(rank, world_size, *args)`` on every rank; raise (and end the group) if a rank fails."""
        for jobs in self.jobs:
            jobs.put((target, args, dict(os.environ)))
        deadline, broken = time.monotonic() + timeout, False
        for _ in range(self.world_size):
            rank, error, rank_broken = self._result(target, deadline, timeout)
            if error is not None:  # the other ranks may wait for this one forever
                self.kill()
                raise RuntimeError(f"{target} failed on rank {rank} of {self.world_size}:\n{error}")
            broken |= rank_broken
        if broken:  # the target left a group zgraph refuses to use: the next call gets new ranks
            self.close()

    def _result(self, target: str, deadline: float, timeout: float) -> tuple[int, str | None, bool]:
        """The next rank's ``(rank, traceback or None, broken)``; a rank that died or the deadline ends the group."""
        while True:
            try:
                return self.results.get(timeout=1)
            except queue_module.Empty:
                pass
            dead = {r: p.exitcode for r, p in enumerate(self.processes) if p.exitcode is not None}
            if not dead and time.monotonic() < deadline:
                continue
            self.kill()
            test = os.environ.get("PYTEST_CURRENT_TEST", "?")
            if dead:
                raise RuntimeError(f"{test}: {target} on {self.world_size} ranks: ranks died (exit codes {dead})")
            raise TimeoutError(f"{test}: {target} on {self.world_size} ranks did not finish in {timeout:.0f} s")

    def close(self) -> None:
        """End the ranks as a finished test does (a barrier, the group destroyed); kill any that hang."""
        for queue in self.jobs:
            queue.put(None)
        for process in self.processes:
            process.join(timeout=60)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
                process.join()
        for key in [k for k, g in _groups.items() if g is self]:
            del _groups[key]


_groups: dict[tuple[int, bool | str], RankGroup] = {}


def rank_context() -> Any:
    """The ranks' multiprocessing context: a forkserver that imported this module (spawn where there is none)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def close_groups() -> None:
    """End every shared rank group (pytest's session end calls it)."""
    for group in list(_groups.values()):
        group.close()


def run_ranks(
    world_size: int, target: str, *args: Any, timeout: float = 900, init_group: bool | str = True, fresh: bool = False
) -> None:
    """Run ``target(rank, world_size, *args)`` (``"module.function"``, importable from ``tests/``) on
    ``world_size`` ranks; raise if any fails (the others are ended at once) or the whole run exceeds ``timeout``
    seconds (a hang becomes a failure naming the test).

    The ranks are a ``RankGroup`` shared by every call of the session with the same world size and group (each
    call starts from a fresh process's generator state and the test's environment; what a call leaves in the
    processes is garbage-collected before the next). ``fresh=True`` (or
    ``ZGRAPH_TEST_FRESH_RANKS=1`` for all) spawns ranks of their own instead, for targets that end their group,
    break it on purpose, or measure a process. ``init_group=False`` leaves the process group to zgraph (it starts
    one from torchrun's variables; always fresh ranks); a string names the backend of the default group
    (``"standin"``: the stand-in accelerator of ``tests/standin.py``; default gloo).
    """
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    if fresh or not init_group or os.environ.get("ZGRAPH_TEST_FRESH_RANKS"):
        _run_fresh(world_size, target, args, timeout, init_group)
        return
    group = _groups.get((world_size, init_group))
    if group is None:
        group = _groups[(world_size, init_group)] = RankGroup(world_size, init_group)
    group.run(target, args, timeout)


def _run_fresh(world_size: int, target: str, args: tuple, timeout: float, init_group: bool | str) -> None:
    """``run_ranks`` on ranks started for this call alone."""
    context = mp.start_processes(
        _entry,
        args=(world_size, free_port(), target, args, init_group, dict(os.environ)),
        nprocs=world_size,
        join=False,
        start_method=rank_context().get_start_method(),
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            test = os.environ.get("PYTEST_CURRENT_TEST", "?")
            raise TimeoutError(f"{test}: {target} on {world_size} ranks did not finish in {timeout:.0f} s (killed)")


def selected(request: Any, param: str, default: list) -> list:
    """The values of parametrized argument ``param`` among the tests of ``request``'s module that this session
    runs (in ``default``'s order), so that a module's one rank group runs only the cases ``-k`` selected; every
    value of ``default`` where no selected test names one."""
    module = request.node.module if hasattr(request.node, "module") else None
    wanted = {
        item.callspec.params[param]
        for item in request.session.items
        if getattr(item, "module", None) is module and param in getattr(getattr(item, "callspec", None), "params", {})
    }
    return [value for value in default if value in wanted] or list(default)


def run_named(rank: int, world: int, out_path: str, names: list[str], namespace: dict) -> None:
    """Worker body: call ``namespace[name](rank, world)`` for each name; rank 0 saves ``{name: result}``, a
    failure recorded as ``{"error": traceback}`` (every rank reaches the same barriers)."""
    results = {}
    for name in names:
        try:
            results[name] = namespace[name](rank, world)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if rank == 0:
        torch.save(results, out_path)


def all_gather_values(value: Any) -> list[Any]:
    """Every rank's ``value`` (tensors, numbers, strings and containers of them), by rank. Serialised with
    ``torch.save`` and moved as uint8 tensors: torch's object collectives need numpy, which zgraph's test
    environment deliberately lacks."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    mine = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    world = dist.get_world_size()
    sizes = torch.empty(world, dtype=torch.int64)
    dist.all_gather_into_tensor(sizes, torch.tensor([mine.numel()], dtype=torch.int64))
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[: mine.numel()] = mine
    everyone = torch.empty(world * padded.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(everyone, padded)
    rows = everyone.view(world, -1)
    return [
        torch.load(io.BytesIO(bytes(rows[r, : int(sizes[r])].clone().untyped_storage())), weights_only=True)
        for r in range(world)
    ]
