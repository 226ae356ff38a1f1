"""Run a function on N local ranks (spawned processes, gloo), as tests of multi-rank behaviour need."""

from __future__ import annotations

import faulthandler
import importlib
import io
import os
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


def _entry(rank: int, world_size: int, port: int, target: str, args: tuple, init_group: bool | str) -> None:
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
    module_name, fn_name = target.rsplit(".", 1)
    fn = getattr(importlib.import_module(module_name), fn_name)
    try:
        fn(rank, world_size, *args)
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


def run_ranks(world_size: int, target: str, *args: Any, timeout: float = 900, init_group: bool | str = True) -> None:
    """Run ``target(rank, world_size, *args)`` (``"module.function"``, importable from ``tests/``) on
    ``world_size`` spawned processes; raise if any fails (the others are ended at once) or the whole run exceeds
    ``timeout`` seconds (a hang becomes a failure naming the test).

    ``init_group=False`` leaves the process group to zgraph (it starts one from torchrun's variables); a string
    names the backend of the default group (``"standin"``: the stand-in accelerator of ``tests/standin.py``;
    default gloo).
    """
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    context = mp.start_processes(
        _entry,
        args=(world_size, free_port(), target, args, init_group),
        nprocs=world_size,
        join=False,
        start_method="spawn",
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
