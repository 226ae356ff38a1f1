"""Spawned-rank bodies of test_faults.py (and benchmarks/faults.py): faults in what came after the first fault
matrix (``failure_cases``) — split mode and the NVMe offload tier. A rank dies (SIGKILL) or fails mid-way; every
rank that lives must end with zgraph's named error within ``Config.collective_timeout``, and what was saved (a
checkpoint, the tier's current copies) must stay whole. Each rank saves what it raised, how long that took, and
what the test checks afterwards; a rank that outlives a dead one leaves at once (``end_finished_rank``: the
harness's closing barrier would wait for the dead rank)."""

from __future__ import annotations

import copy
import errno
import hashlib
import os
import signal
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from failure_cases import TIMEOUT, _attempt, _start_together
from offload_cases import batches, make, make_step, stage3, with_offload
from torch import nn

import zgraph
from zgraph.runtime import offload_nvme
from zgraph.runtime.process_group import end_finished_rank


def _save(out: str, rank: int, record: dict) -> None:
    torch.save(record, f"{out}.{rank}")


def _leave_together(rank: int, world: int) -> None:
    """Rank 0 leaves only once every rank has saved its record: it hosts the store (under torchrun the agent
    does), and its exit would cut a rank still reading an exchange with a connection reset instead of the
    error under test. Only for cases where every rank lives."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"left/{rank}", b"1")
    if rank == 0:
        store.wait([f"left/{r}" for r in range(world)], timedelta(seconds=TIMEOUT * 4))
    end_finished_rank()


def _die() -> None:
    """This rank ends as a crashed or killed process does: no exception, no exit handler, no failure record."""
    os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------------------------------ split mode
def _encoder() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _split_step():
    @zgraph.distribute(stage=3, backend="eager", param_persistence_threshold=0, collective_timeout=TIMEOUT)
    def encode(model, x):
        return model(x)

    return encode


def _rows(rank: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))


def split_rank_dies(rank: int, world: int, out: str) -> None:
    """Rank 1 dies between a split step's forward and its backward; rank 0 backpropagates, then calls again."""
    model, encode = _encoder(), _split_step()
    _start_together()
    encode(model, _rows(rank)).backward(torch.ones(4, 3))
    output = encode(model, _rows(rank))
    if rank == 1:
        _die()
    record = {"backward": _attempt(output.backward, torch.ones(4, 3))}
    record["again"] = _attempt(encode, model, _rows(rank))
    _save(out, rank, record)
    end_finished_rank()


def split_outputs_dropped(rank: int, world: int, out: str) -> None:
    """Every rank drops a split step's outputs (no backward): nothing accumulates and the next call runs. Then
    rank 1 drops them again and calls the step once more while rank 0 backpropagates its outputs."""
    model, encode = _encoder(), _split_step()
    _start_together()
    encode(model, _rows(rank)).backward(torch.ones(4, 3))
    model.zero_grad(set_to_none=True)
    encode(model, _rows(rank))  # dropped on every rank
    record = {"dropped": {"grads": [p.grad for p in model.parameters()]}}
    record["next"] = _attempt(lambda: encode(model, _rows(rank)).backward(torch.ones(4, 3)))
    record["next"]["grads"] = [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]
    output = encode(model, _rows(rank))
    if rank == 1:
        del output
        record["mismatch"] = _attempt(encode, model, _rows(rank))
    else:
        record["mismatch"] = _attempt(output.backward, torch.ones(4, 3))
    _save(out, rank, record)
    _leave_together(rank, world)


# ---------------------------------------------------------------------------------------- the store's host
def store_host_dies(rank: int, world: int, out: str) -> None:
    """Rank 0, whose process serves the default group's store, dies after a step (as the agent of a torchrun
    node with ``GROUP_RANK`` 0 does when that machine dies); rank 1 steps on twice."""
    model = _encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    @zgraph.distribute(stage=3, backend="eager", param_persistence_threshold=0, collective_timeout=TIMEOUT)
    def step(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    _start_together()
    step(model, opt, _rows(rank))
    dist.barrier()  # both ranks are done with the first step
    if rank == 0:
        _die()
    record = {"step": _attempt(step, model, opt, _rows(rank)), "again": _attempt(step, model, opt, _rows(rank))}
    _save(out, rank, record)
    end_finished_rank()


# ----------------------------------------------------------------------------------------------- NVMe tier
def current_copies(step: object) -> dict[str, str]:
    """The tier's current copy of every offloaded state of ``step``'s last call: path to sha256."""
    store = step._dispatch.last.offload
    paths = [state.block[state.current] for state in store.states.values()]
    return {path: sha256(path) for path in paths}


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def offload_run(rank: int, world: int, directory: str) -> tuple:
    """Two steps of stage 3 with parameters and optimizer states on the NVMe tier, then a checkpoint; returns
    the model, optimizer, step, the remaining batches and the record so far (the saved state, rank 0)."""
    model, opt = make()
    tier = os.path.join(directory, "tier")
    os.makedirs(tier, exist_ok=True)
    step = make_step(with_offload(stage3(collective_timeout=TIMEOUT), tier, True))
    data = batches(rank, world)
    if world > 1:
        _start_together()
    for x, y in data[:2]:
        step(model, opt, x, y)
    zgraph.save(os.path.join(directory, "ckpt"), model, opt)
    # collective: every rank; what the checkpoint must load as (copied: like state_dict(), it may alias the state)
    saved = copy.deepcopy(zgraph.full_state_dict(model, opt))
    record = {"saved": saved if rank == 0 else None, "copies": current_copies(step)}
    return model, opt, step, data[2:], record


def _torn_write(path: str, value: torch.Tensor, nbytes: int, during_graph: bool = False) -> None:
    """A write-back that dies half-way: half of the new value reaches the next copy, then the process dies."""
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, offload_nvme._bytes_of(value)[: nbytes // 2], 0)
    os.close(fd)
    _die()


def offload_rank_dies(rank: int, world: int, out: str, directory: str) -> None:
    """Rank 1 dies half-way through an offload write-back (the tier's next copy torn); rank 0 goes on. Before
    the fault each rank records its tier's current copies (the files are left behind by the killed rank)."""
    model, opt, step, data, record = offload_run(rank, world, directory)
    _save(out, rank, record)
    if rank == 1:
        offload_nvme.write_file = _torn_write
    record["step"] = _attempt(step, model, opt, *data[0])  # rank 0 may finish it: no collective after the kill
    record["again"] = _attempt(step, model, opt, *data[1])
    record["copies_after"] = current_copies(step)
    _save(out, rank, record)
    end_finished_rank()


def offload_disk_full(rank: int, world: int, out: str, directory: str) -> None:
    """Rank 1's disk fills up while the step writes back (``pwrite`` fails with ENOSPC on the I/O thread)."""
    model, opt, step, data, record = offload_run(rank, world, directory)
    if rank == 1:
        offload_nvme.os = NoSpace()
    record["step"] = _attempt(step, model, opt, *data[0])
    record["again"] = _attempt(step, model, opt, *data[1])
    offload_nvme.os = os
    record["copies_after"] = current_copies(step)
    _save(out, rank, record)
    end_finished_rank()


class NoSpace:
    """``os`` as ``offload_nvme`` sees it when the disk fills up mid-step: every ``pwrite`` of the I/O thread (a
    write-back while the graph runs) fails with ENOSPC. The tier's files are reserved when first made, so only a
    filesystem that allocates on write (copy-on-write, thin-provisioned, with quotas) gets here."""

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    @staticmethod
    def pwrite(fd: int, data: object, offset: int) -> int:
        if threading.current_thread().name.startswith("zgraph-offload"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.pwrite(fd, data, offset)
