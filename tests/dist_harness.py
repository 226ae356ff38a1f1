"""Run a function on N local ranks (spawned processes, gloo), as tests of multi-rank behaviour need."""

from __future__ import annotations

import importlib
import os
import socket
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zgraph.runtime.process_group import end_finished_rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, target: str, args: tuple, init_group: bool) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    if init_group:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    module_name, fn_name = target.rsplit(".", 1)
    fn = getattr(importlib.import_module(module_name), fn_name)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    end_finished_rank()


def run_ranks(world_size: int, target: str, *args: Any, timeout: float = 900, init_group: bool = True) -> None:
    """Run ``target(rank, world_size, *args)`` (``"module.function"``, importable from ``tests/``) on
    ``world_size`` spawned processes; raise if any fails or the whole run exceeds ``timeout`` seconds.

    ``init_group=False`` leaves the process group to zgraph (it starts one from torchrun's variables).
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
            raise TimeoutError(f"{target} on {world_size} ranks did not finish in {timeout:.0f} s")


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
