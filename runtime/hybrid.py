"""Hybrid sharding's groups (``Config.shard_group_size``) and hpZ's (``Config.secondary_shard_group_size``).

A step's ranks are cut into groups of ``N`` consecutive ranks — the ranks of one node, when ``N`` is the ranks
per node, since torchrun numbers a node's ranks consecutively. Hybrid sharding shards state within each such
*shard group* and replicates it across them: rank ``r`` is rank ``r % N`` of its shard group and rank ``r // N``
of its *replicate group* (the ranks ``r % N, r % N + N, ...``, which hold the same shards). hpZ keeps parameters
sharded over every rank and uses the group of ``N`` (its *secondary group*) for the backward's re-gathers.

Each group is zgraph's own (``new_timed_group``: its collectives raise after ``collective_timeout``); a rank
makes only the groups it belongs to, shard group first, so every rank of the step calls ``hybrid_group`` at the
same point and none waits on a group it is not in. Whether a group spans nodes is known from torchrun's
``LOCAL_WORLD_SIZE`` (ranks per node); it tells the cost model which links a collective uses.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch.distributed as dist

from zgraph.graph import Axis
from zgraph.runtime.process_group import ProcessGroupInfo, new_timed_group

_HYBRID: dict[tuple, ProcessGroupInfo] = {}


_DEEPSPEED_NAMES = {"secondary_shard_group_size": " (DeepSpeed's zero_hpz_partition_size)"}


def check_group_size(field: str, size: int | None, world_size: int) -> None:
    """Raise ``ValueError`` naming ``Config.<field>`` unless ``size`` (None: off) divides ``world_size``."""
    if size is not None and world_size % size:
        raise ValueError(
            f"Config.{field}={size}{_DEEPSPEED_NAMES.get(field, '')} does not divide the world size {world_size}: "
            f"every group must have {size} ranks (use a divisor of {world_size}, e.g. the ranks per node)"
        )


def check_pipeline_groups(shard_group_size: int | None, pipeline_parallel: int, world: int | None) -> None:
    """With pipelines, ``Config.shard_group_size`` (None: off) must divide the ``world / P`` ranks of each stage's
    data-parallel group, whose ranks it counts (``ValueError`` naming both; nothing to check with ``world`` None)."""
    data = world // pipeline_parallel if world is not None else 0
    if shard_group_size is not None and data % shard_group_size:
        raise ValueError(
            f"Config.shard_group_size={shard_group_size} must divide the {data} ranks of each stage's data-parallel "
            f"group (world size {world} / pipeline_parallel={pipeline_parallel}): with pipelines it counts ranks of "
            f"that group, as FSDP2's HSDP shard dimension over the data-parallel dimension (use a divisor of {data})"
        )


def hybrid_group(
    parent: ProcessGroupInfo,
    *,
    shard_group_size: int | None,
    secondary_group_size: int | None,
    timeout: float,
    sequence_parallel: int | None = None,
) -> ProcessGroupInfo:
    """``parent`` with hybrid sharding's shard and replicate groups, hpZ's secondary group and sequence
    parallelism's sequence group made, as the sizes ask (once per parent and sizes; collective over ``parent``'s
    ranks, each making its own groups, in that order). A size that asks for no group (None, or ``parent``'s world
    size for the first two, 1 for the last) leaves that axis None."""
    if not parent.distributed:
        return parent
    sizes = _sizes(parent, shard_group_size, secondary_group_size, sequence_parallel)
    if not any(sizes):
        return parent
    key = (parent.group_name, *sizes)
    found = _HYBRID.get(key)
    if found is None or not _alive(found):  # none yet, or its groups were destroyed (a name may come back)

        def make(kind: str, ranks: list[int], rank: int) -> Axis:
            if len(ranks) == parent.world_size:
                return Axis(size=len(ranks), rank=rank, name=parent.group_name or "", crosses_nodes=False)
            return _axis(parent, ranks, rank, timeout)

        found = _HYBRID[key] = dataclasses.replace(parent, **_axes(parent, sizes, make))
    return found


def _sizes(parent: ProcessGroupInfo, shard: int | None, secondary: int | None, sequence: int | None) -> tuple:
    """The group sizes that make groups (None where an axis needs none), each checked against the world size."""
    world = parent.world_size
    check_group_size("shard_group_size", shard, world)
    check_group_size("secondary_shard_group_size", secondary, world)
    check_group_size("sequence_parallel", sequence, world)
    return (
        shard if shard not in (None, world) else None,
        secondary if secondary not in (None, world) else None,
        sequence if sequence not in (None, 1) else None,
    )


def _axes(parent: ProcessGroupInfo, sizes: tuple, make: Callable[[str, list[int], int], Axis]) -> dict[str, Axis]:
    """The axes ``sizes`` (``_sizes``) ask for, each ``make(kind, global ranks, rank in it)``, in a fixed order."""
    shard, secondary, sequence = sizes
    axes = {}
    if shard is not None:
        axes["shard"] = make("shard", _block(parent, shard), parent.rank % shard)
        axes["replicate"] = make("replicate", _strided(parent, shard), parent.rank // shard)
    if secondary is not None:
        axes["secondary"] = make("secondary", _block(parent, secondary), parent.rank % secondary)
    if sequence is not None:
        axes["sequence"] = make("sequence", _block(parent, sequence), parent.rank % sequence)
    return axes


def planned_group(
    parent: ProcessGroupInfo,
    *,
    shard_group_size: int | None,
    secondary_group_size: int | None,
    ranks_per_node: int | None = None,
    sequence_parallel: int | None = None,
) -> ProcessGroupInfo:
    """``parent`` with the axes ``hybrid_group`` would give it, named after ``parent``'s group and never made (an
    estimate's: its graph names groups nothing runs); ``ranks_per_node`` tells which axes cross nodes."""
    name = parent.group_name or ""

    def make(kind: str, ranks: list[int], rank: int) -> Axis:
        crosses = crosses_nodes(ranks, ranks_per_node)
        return Axis(size=len(ranks), rank=rank, name=f"{name}/{kind}", crosses_nodes=crosses)

    sizes = _sizes(parent, shard_group_size, secondary_group_size, sequence_parallel)
    return dataclasses.replace(parent, **_axes(parent, sizes, make)) if any(sizes) else parent


def _alive(group: ProcessGroupInfo) -> bool:
    """Whether the groups of ``group``'s axes still exist."""
    names = set(dist.distributed_c10d._world.pg_names.values())
    axes = (group.shard, group.replicate, group.secondary, group.sequence)
    return all(axis.name in names for axis in axes if axis is not None)


def _members(parent: ProcessGroupInfo) -> list[int]:
    """The global ranks of ``parent``, by rank in it."""
    return list(parent.ranks) if parent.ranks is not None else list(range(parent.world_size))


def _block(parent: ProcessGroupInfo, size: int) -> list[int]:
    """The global ranks of this rank's group of ``size`` consecutive ranks."""
    start = parent.rank // size * size
    return _members(parent)[start : start + size]


def _strided(parent: ProcessGroupInfo, size: int) -> list[int]:
    """The global ranks at this rank's position in every group of ``size`` consecutive ranks."""
    return _members(parent)[parent.rank % size :: size]


def _axis(parent: ProcessGroupInfo, ranks: list[int], rank: int, timeout: float) -> Axis:
    group = new_timed_group(ranks, parent.backend, timeout, local=True)
    return Axis(size=len(ranks), rank=rank, name=group.group_name, crosses_nodes=crosses_nodes(ranks))


def crosses_nodes(ranks: list[int], ranks_per_node: int | None = None) -> bool:
    """Whether global ``ranks`` lie on more than one node, with ``ranks_per_node`` consecutive ranks per node
    (default: torchrun's ``LOCAL_WORLD_SIZE``; unknown: False, as if one node)."""
    if ranks_per_node is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        ranks_per_node = int(local) if local.isdigit() and int(local) > 0 else None
    if ranks_per_node is None:
        return False
    return len({r // ranks_per_node for r in ranks}) > 1
