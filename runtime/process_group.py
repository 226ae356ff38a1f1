"""Process groups: from torchrun's environment, an existing default group, or none (one process).

``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (torchrun's variables) start the default group with
the backend that serves the model's device (``zgraph.runtime.devices.default_backend``: gloo for a CPU model even
where CUDA exists, NCCL for a CUDA model, whose device becomes the rank's current CUDA device). A group the user
initialised first is used as it is. Without either, the step runs on one process and sharding is the identity.

At interpreter exit (``atexit``: before finalization, while gloo's threads can still be joined) zgraph destroys
its own groups and then the default group if zgraph started it; a default group the user started is theirs to
destroy (``destroy_own_groups``).
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing.util
import os
import socket
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zgraph.errors import ZGraphError
from zgraph.graph import Axis
from zgraph.runtime.devices import default_backend, served_backend


@dataclass(frozen=True)
class ProcessGroupInfo:
    """The group a step's collectives run on (``group_name`` None: no group, one process).

    ``shard`` / ``replicate``: hybrid sharding's groups within it (``zgraph.runtime.hybrid``), ``secondary``:
    hpZ's, ``sequence``: sequence parallelism's; None without them. ``data``: a pipelined step's at ZeRO >= 1, this
    rank's stage data-parallel group (with its own ``shard`` / ``replicate``, which this group's are), within which
    state is sharded (``zgraph.runtime.pipeline_groups.zero_within_stages``)."""

    rank: int
    world_size: int
    group_name: str | None
    backend: str | None
    ranks: tuple[int, ...] | None = None  # global ranks of a group smaller than the world; None: the whole world
    shard: Axis | None = None
    replicate: Axis | None = None
    secondary: Axis | None = None
    sequence: Axis | None = None
    data: ProcessGroupInfo | None = None

    @property
    def distributed(self) -> bool:
        return self.group_name is not None

    @property
    def shard_axis(self) -> Axis:
        """The ranks state is sharded across: hybrid sharding's shard group, else the whole group."""
        return self.shard or Axis(size=self.world_size, rank=self.rank, name=self.group_name or "")


SINGLE_PROCESS = ProcessGroupInfo(rank=0, world_size=1, group_name=None, backend=None)


def ensure_process_group(
    process_group: dist.ProcessGroup | None = None, device_of: Callable[[], torch.device] | None = None
) -> ProcessGroupInfo:
    """The group a step runs on: ``process_group`` when given (this rank must belong to it), else the default
    group, started from torchrun's environment if it is set and no group exists yet, with the backend for the
    device ``device_of()`` names (the model's; asked only when a group is started; default CPU)."""
    if process_group is not None:
        return _given_group(process_group)
    if not dist.is_available():
        return SINGLE_PROCESS
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return SINGLE_PROCESS
        device = device_of() if device_of is not None else torch.device("cpu")
        backend = default_backend(device)
        if backend == "nccl":
            torch.cuda.set_device(device)  # NCCL's communicators use the current device: the model's
        dist.init_process_group(backend=backend)
        _destroy_at_exit(dist.group.WORLD)
    group = dist.group.WORLD
    return ProcessGroupInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        group_name=group.group_name,
        backend=dist.get_backend(group),
    )


def _given_group(group: dist.ProcessGroup) -> ProcessGroupInfo:
    """``group`` as a ``ProcessGroupInfo``; a clear error when this process cannot run a step on it."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("zgraph: process_group= was given but torch.distributed is not initialised")
    if group in (dist.GroupMember.NON_GROUP_MEMBER, None) or dist.get_rank(group) < 0:
        raise RuntimeError(
            f"zgraph: rank {dist.get_rank()} is not a member of the step's process_group; call the step only on "
            "the ranks of its group (each group of ranks gets its own step)"
        )
    ranks = tuple(dist.get_process_group_ranks(group))
    return ProcessGroupInfo(
        rank=dist.get_rank(group),
        world_size=group.size(),
        group_name=group.group_name,
        backend=dist.get_backend(group),
        ranks=None if ranks == tuple(range(dist.get_world_size())) else ranks,
    )


_TIMED_GROUPS: dict[tuple[str, float], ProcessGroupInfo] = {}


def timed_group(
    parent: ProcessGroupInfo, timeout: float, before_creating: Callable[[], object] | None = None
) -> ProcessGroupInfo:
    """zgraph's own group over ``parent``'s ranks, whose collectives raise after ``timeout`` seconds instead of
    waiting for a rank that failed or stopped calling (the default group's timeout is the user's, often 30
    minutes). One per timeout; every rank must ask for it at the same point (``new_group`` is collective):
    ``before_creating`` (a bounded agreement between the ranks) runs first, so a rank that never arrives makes
    the others raise instead of waiting in ``new_group``."""
    if not parent.distributed:
        return parent
    key = (parent.group_name, float(timeout))
    found = _TIMED_GROUPS.get(key)
    if found is None:
        if before_creating is not None:
            before_creating()
        ranks = list(parent.ranks) if parent.ranks is not None else None
        group = new_timed_group(ranks, parent.backend, timeout, local=parent.ranks is not None)
        found = ProcessGroupInfo(parent.rank, parent.world_size, group.group_name, parent.backend, parent.ranks)
        _TIMED_GROUPS[key] = found
    return found


def new_timed_group(ranks: list[int] | None, backend: str | None, timeout: float, local: bool) -> dist.ProcessGroup:
    """A new group of zgraph's over ``ranks`` (global ranks; None: all) whose collectives raise after ``timeout``
    seconds, destroyed at exit; on gloo with one worker thread (``one_worker_gloo``). ``local``: only the ranks
    in it call (``use_local_synchronization``); else every rank of the world does."""
    group = dist.new_group(
        ranks=ranks,
        backend=one_worker_gloo() if backend == "gloo" else backend,
        timeout=timedelta(seconds=timeout),
        use_local_synchronization=local,
    )
    _destroy_at_exit(group)
    return group


_OWN_GROUPS: list[weakref.ref] = []  # the groups zgraph started (its timed groups, a default group), oldest first


def _destroy_at_exit(group: dist.ProcessGroup) -> None:
    """Destroy ``group`` (one zgraph started) at interpreter exit, if it still exists then."""
    _register_exit_hook()
    _OWN_GROUPS.append(weakref.ref(group))


@functools.cache
def _register_exit_hook() -> None:
    atexit.register(destroy_own_groups)


def destroy_own_groups() -> None:
    """Destroy the process groups zgraph started that still exist, newest first: its own groups, then the
    default group if zgraph started it (destroying a default group destroys every group, the user's too).

    Registered with ``atexit`` when zgraph starts its first group. A gloo group still alive when the
    interpreter finalizes (DTensor's caches keep zgraph's device meshes, and with them the groups) is torn down
    after Python's threads are gone and occasionally aborts the process ("terminate called without an active
    exception") after all the work succeeded; destroyed here, its worker threads are joined first."""
    while _OWN_GROUPS:
        group = _OWN_GROUPS.pop()()
        if group is not None and dist.is_initialized() and group in dist.distributed_c10d._world.pg_names:
            dist.destroy_process_group(group)
    _TIMED_GROUPS.clear()


ONE_WORKER_GLOO = "zgraph_gloo"


@functools.cache
def one_worker_gloo() -> str:
    """The name of a gloo backend with one worker thread (registered once), for zgraph's own groups on gloo.

    A gloo process group runs its collectives on two worker threads by default, so two collectives issued before
    either is waited for — as the ``schedule`` pass issues them: a prefetched gather beside a reduce-scatter, the
    forward gather and the backward re-gather of one shard — run at once. Under load that corrupted the heap
    (``malloc(): unaligned tcache chunk detected``, ``munmap_chunk(): invalid pointer``, SIGSEGV in malloc),
    always on a gloo worker in the middle of a collective (core dumps: ``allgather_coalesced`` flattening its
    inputs, ``alltoall``, the worker loop freeing a finished work); with one worker it never did. One worker
    still runs the collectives in the background, in the order they were issued, while the step computes."""
    gloo = dist.ProcessGroupGloo

    def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
        options = gloo._Options()
        options._timeout = timeout
        options._threads = 1
        options._devices = [gloo.create_default_device()]
        return gloo(store, rank, size, options)

    dist.Backend.register_backend(ONE_WORKER_GLOO, create, devices=["cpu"])
    return ONE_WORKER_GLOO


_MESHES: weakref.WeakValueDictionary[tuple, object] = weakref.WeakValueDictionary()


def device_mesh(device_type: str, world_size: int, subgroup: str | None = None) -> object:
    """The 1-D ``DeviceMesh`` over the default group (or over the group named ``subgroup``, for a step on some
    of the ranks), shared by every sharded tensor while any of them lives.

    Held weakly: once no sharded tensor uses it, the mesh (and its reference to the process group) goes, so a
    destroyed group's threads are joined while the interpreter is alive rather than during its shutdown,
    where a gloo group kept alive only by a cache aborts the process. Keyed by the default group's name too, so
    a group made after ``destroy_process_group`` gets a new mesh.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    key = (device_type, world_size, subgroup or dist.group.WORLD.group_name)
    mesh = _MESHES.get(key)
    if mesh is None:
        if subgroup is None:
            mesh = init_device_mesh(device_type, (world_size,))
        else:
            mesh = DeviceMesh.from_group(dist.distributed_c10d._resolve_process_group(subgroup), device_type)
        _MESHES[key] = mesh
    return mesh


def hybrid_mesh(device_type: str, group: ProcessGroupInfo) -> object:
    """The 2-D ``DeviceMesh`` (``"replicate"``, ``"shard"``) of hybrid sharding over ``group`` (a pipelined step's:
    over its stage's data-parallel group, ``group.data``): its rows are the shard groups. Its tensors are
    ``(Replicate(), Shard(0))`` DTensors, as FSDP2's HSDP makes them. Held weakly, as ``device_mesh``'s."""
    from torch.distributed.device_mesh import DeviceMesh

    group = group.data or group
    assert group.shard is not None and group.replicate is not None
    key = (device_type, group.world_size, group.shard.name, group.replicate.name)
    mesh = _MESHES.get(key)
    if mesh is None:
        ranks = list(group.ranks) if group.ranks is not None else list(range(group.world_size))
        layout = torch.tensor(ranks, dtype=torch.int).view(group.replicate.size, group.shard.size)
        resolve = dist.distributed_c10d._resolve_process_group
        mesh = DeviceMesh.from_group(
            [resolve(group.replicate.name), resolve(group.shard.name)],
            device_type,
            layout,
            mesh_dim_names=("replicate", "shard"),
        )
        _MESHES[key] = mesh
    return mesh


def is_zgraph_mesh(mesh: object) -> bool:
    """Whether ``mesh`` is a device mesh ``device_mesh`` made (the mesh of zgraph's sharded tensors)."""
    return any(mesh is ours for ours in _MESHES.values())


def end_finished_rank() -> None:
    """Exit a spawned rank that finished its work (group destroyed, results written) without interpreter teardown.

    DTensor's sharding-propagation cache keeps the device mesh, and through it the gloo group and its threads,
    alive until the interpreter shuts down; tearing gloo down that late occasionally aborts the process
    ("terminate called without an active exception") after all the work succeeded.

    What ``multiprocessing`` releases at a normal exit is released first, by its own exit handler: the named
    semaphores a rank made (tqdm's lock, a queue's) would otherwise stay registered with the parent's resource
    tracker, which reports them as leaked when the parent ends.
    """
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_one_device_per_rank(channel: Any, backend: str | None, device: torch.device) -> None:
    """On NCCL, every rank must hold its state on a GPU of its own (NCCL refuses two ranks on one device, and
    does so deep inside its first collective): the ranks exchange which GPU of which host they use and raise,
    before anything changes, naming the ranks that share one. A collective on every rank of ``channel``'s group
    (through its store, no NCCL collective)."""
    if served_backend(backend, device.type) != "nccl":
        return
    properties = torch.cuda.get_device_properties(device)
    mine = f"{socket.gethostname()} {getattr(properties, 'uuid', device.index)}"
    found = [raw.decode() for raw in channel.exchange("which GPU each rank uses", mine.encode())]
    shared = duplicate_devices(found)
    if shared:
        ranks = " and ".join(str(r) for r in shared[0])
        raise ZGraphError(
            f"zgraph: ranks {ranks} hold their models on the same GPU ({device} here) of one host; NCCL needs one "
            "GPU per rank. Start at most as many ranks per host as it has GPUs (torchrun --nproc-per-node), and "
            "build each rank's model on its own GPU: torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) "
            "before model.cuda() / model.to('cuda')."
        )


def duplicate_devices(devices: list[str]) -> list[tuple[int, ...]]:
    """Groups of ranks (two or more) whose entries in ``devices`` (one per rank) are equal."""
    by_device: dict[str, list[int]] = {}
    for rank, device in enumerate(devices):
        by_device.setdefault(device, []).append(rank)
    return [tuple(ranks) for ranks in by_device.values() if len(ranks) > 1]
