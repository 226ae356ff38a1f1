"""Process groups: from torchrun's environment, an existing default group, or none (one process).

``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (torchrun's variables) start the default group with
NCCL when CUDA is available, else gloo. A group the user initialised first is used as it is. Without either,
the step runs on one process and sharding is the identity.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ProcessGroupInfo:
    """The group a step's collectives run on (``group_name`` None: no group, one process)."""

    rank: int
    world_size: int
    group_name: str | None
    backend: str | None

    @property
    def distributed(self) -> bool:
        return self.group_name is not None


SINGLE_PROCESS = ProcessGroupInfo(rank=0, world_size=1, group_name=None, backend=None)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def ensure_process_group() -> ProcessGroupInfo:
    """The default process group, started from torchrun's environment if it is set and no group exists yet."""
    if not dist.is_available():
        return SINGLE_PROCESS
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return SINGLE_PROCESS
        backend = default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    group = dist.group.WORLD
    return ProcessGroupInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        group_name=group.group_name,
        backend=dist.get_backend(group),
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
        group = dist.new_group(backend=parent.backend, timeout=timedelta(seconds=timeout))
        found = ProcessGroupInfo(parent.rank, parent.world_size, group.group_name, parent.backend)
        _TIMED_GROUPS[key] = found
    return found


_MESHES: weakref.WeakValueDictionary[tuple, object] = weakref.WeakValueDictionary()


def device_mesh(device_type: str, world_size: int) -> object:
    """The 1-D ``DeviceMesh`` over the default group, shared by every sharded tensor while any of them lives.

    Held weakly: once no sharded tensor uses it, the mesh (and its reference to the process group) goes, so a
    destroyed group's threads are joined while the interpreter is alive rather than during its shutdown,
    where a gloo group kept alive only by a cache aborts the process. Keyed by the default group's name too, so
    a group made after ``destroy_process_group`` gets a new mesh.
    """
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, world_size, dist.group.WORLD.group_name)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = init_device_mesh(device_type, (world_size,))
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
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
