"""Local ranks for the demos: start ``nproc`` processes with torchrun's environment, wait, collect a summary; and
the device each rank trains on (``rank_device``)."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing as mp

from zgraph.runtime.process_group import end_finished_rank

ADAMW_STATES = 2  # exp_avg and exp_avg_sq, each of the parameter's shape
ADAMW_STEP_BYTES = 4  # the float32 ``step`` tensor AdamW keeps per parameter


class DemoRankError(RuntimeError):
    """A rank ``zgraph demo`` started itself (a local process that exited non-zero or raised, or a Ray actor)
    failed; the message carries its traceback or Ray's report. Not ``zgraph.RankFailedError``, which a zgraph
    step raises on the ranks of a process group when another rank failed."""


def spawn_ranks(args: argparse.Namespace, nproc: int, target: Callable[[argparse.Namespace], Any]) -> dict[str, Any]:
    """Start ``nproc`` local ranks running ``target(args)`` (a module-level function), wait for them, and return
    the summary of the rank whose ``target`` returned one.

    If a rank fails the others are stopped and ``DemoRankError`` carries the failing rank's traceback.
    """
    port = free_port()
    method = _start_method(target)
    with tempfile.TemporaryDirectory(prefix="zgraph_demo_") as scratch:
        summary_path = os.path.join(scratch, "summary.json")
        ranks = mp.start_processes(
            _rank_main, args=(target, args, nproc, port, summary_path), nprocs=nproc, join=False, start_method=method
        )
        try:
            with _exit_on_sigterm():
                while not ranks.join():  # on a rank's failure, join stops the others and raises
                    pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            raise DemoRankError(f"rank {error.error_index} of {nproc} failed: {error}") from None
        finally:  # also on Ctrl-C or SIGTERM to this process: no rank outlives the demo
            for process in ranks.processes:
                if process.is_alive():
                    process.terminate()
                    process.join()
        with open(summary_path) as f:
            return json.load(f)


def _start_method(target: Callable[[argparse.Namespace], Any]) -> str:
    """``forkserver`` where the platform has it: one fresh process imports torch and ``target``'s module (the
    seconds a rank's start-up costs) and each rank is forked from it, single-threaded and before any process group
    or device exists; else ``spawn`` (each rank imports everything itself)."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload([target.__module__])
    return "forkserver"


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit`` while the ranks run, so the cleanup that stops them runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def free_port() -> int:
    """A TCP port free on this machine now (rank 0's store binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    local_rank: int,
    target: Callable[[argparse.Namespace], Any],
    args: argparse.Namespace,
    world_size: int,
    port: int,
    summary_path: str,
) -> None:
    """Body of a spawned rank: torchrun's environment, one thread, ``target``; the rank with a summary writes it.
    A fatal signal in the rank (native code) prints every thread's Python stack before the rank dies."""
    faulthandler.enable(all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    summary = target(args)
    if summary is not None:
        with open(summary_path, "w") as f:
            json.dump(summary, f)
    end_finished_rank()


def local_rank_and_size(rank: int, world_size: int) -> tuple[int, int]:
    """This process's rank on its host and the number of ranks there: torchrun's ``LOCAL_RANK`` /
    ``LOCAL_WORLD_SIZE`` (set for the ranks the demos start too), else the global ones (one host)."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return local_rank, local_size


def rank_device(local_rank: int, local_size: int) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available with a GPU for each of the host's ``local_size`` ranks (NCCL
    needs one GPU per rank), else the CPU (gloo)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_size:
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def device_note(local_size: int, fitting: str | None = None) -> str | None:
    """What to say about the device choice for ``local_size`` ranks on this host: None without CUDA (the CPU
    path, said nothing about), else where the ranks train and why; ``fitting``: the option that would fit the
    GPUs, named when there are too few."""
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if count >= local_size:
        return "device: cuda:0" if local_size == 1 else f"device: cuda:0-{local_size - 1}, one GPU per rank (NCCL)"
    hint = f" ({fitting} runs on the GPUs)" if fitting else ""
    return f"device: CPU (gloo): {local_size} local ranks but {count} GPU(s), and NCCL needs one GPU per rank{hint}"


def unsharded_state_bytes(model: torch.nn.Module) -> int:
    """Bytes the same model and AdamW hold on one process after a step (gradients zeroed to None).

    Per unique parameter: the parameter, and for a trainable one AdamW's two moments of its shape and a
    4-byte ``step``.
    """
    total = 0
    for p in {id(p): p for p in model.parameters()}.values():
        size = p.numel() * p.element_size()
        total += size + (ADAMW_STATES * size + ADAMW_STEP_BYTES if p.requires_grad else 0)
    return total
