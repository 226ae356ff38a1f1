"""Pipeline parallelism's process groups with ``P x SP x D`` ranks: ``D`` pipelines of ``P`` stage places, each
place a sequence group of ``SP`` consecutive ranks (``Config.sequence_parallel``; 1 without it).

Of a step's ranks ``R`` (its group's global ranks, in order), rank ``R[(d*P + p)*SP + s]`` is at place ``p`` of
pipeline ``d`` and holds slice ``s`` of every sequence (``zgraph.pipeline_batch``: rows ``d`` of ``D``, then the
sequence cut as ``zgraph.shard_sequence`` cuts it). Point-to-point sends go along a *chain*: the ``P`` ranks of one
pipeline with the same slice ``s`` (``R[(d*P + q)*SP + s]`` for each place ``q``), so each rank's activations reach
the rank of the same slice in the next stage; the sequence group's all-to-alls run inside each stage's graphs. The
ranks at the same place of every chain (``D x SP`` of them) run the same stages and form that place's data-parallel
group, over which their stages' gradients are reduced once per step. With ``SP = 1`` a chain is a pipeline of ``P``
consecutive ranks; with ``SP = D = 1`` it is the step's group.

ZeRO (stages 1 to 3) shards state within each place's data-parallel group: ``zero_within_stages`` makes that group
the step group's shard axis, so the sharding plan (``zgraph.runtime.sharded_state``) cuts a stage's optimizer
state (stage 2: its gradients, 3: its parameters) over the ``D`` ranks running it. With one pipeline there is
nothing to shard over (``plan_stage``: the state is laid out as at stage 0). Hybrid sharding
(``Config.shard_group_size=N``) cuts the data-parallel group as ``zgraph.runtime.hybrid`` cuts a step's group:
shard groups of ``N`` consecutive members of ``data_ranks``, replicated across them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from zgraph.runtime.hybrid import hybrid_group
from zgraph.runtime.process_group import ProcessGroupInfo, new_timed_group


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's chain (``group``, its global ``ranks`` in stage order) and data-parallel group (``data``, its
    global ``data_ranks``; None with one chain); ``index``: this rank's place in ``data_ranks``."""

    group: dist.ProcessGroup | None
    ranks: list[int]
    data: dist.ProcessGroup | None = None
    data_ranks: tuple[int, ...] = ()
    index: int = 0


_GROUPS: dict[tuple[str, int, float], PipelineGroups] = {}


def pipeline_groups(
    group: ProcessGroupInfo, pipeline_parallel: int, timeout: float, sequence: int | None = None
) -> PipelineGroups:
    """This rank's groups (made once per step group, ``P``, ``SP`` (``sequence``) and timeout; each rank makes its
    own two, chain first: ``use_local_synchronization``, only their members meet)."""
    if not group.distributed:
        return PipelineGroups(None, [0])
    ranks = list(group.ranks or range(group.world_size))
    p, sp = pipeline_parallel, sequence or 1
    if len(ranks) == p:
        return PipelineGroups(dist.distributed_c10d._resolve_process_group(group.group_name), ranks)
    key = (group.group_name, p, sp, float(timeout))
    found = _GROUPS.get(key)
    if found is None or found.group not in dist.distributed_c10d._world.pg_names:  # not made, or destroyed since
        chain, data = layout(ranks, group.rank, p, sp)
        _GROUPS[key] = PipelineGroups(
            new_timed_group(chain, group.backend, timeout, local=True),
            chain,
            new_timed_group(list(data), group.backend, timeout, local=True),
            data,
            data.index(ranks[group.rank]),
        )
    return _GROUPS[key]


def layout(ranks: list[int], rank: int, pipeline_parallel: int, sequence: int) -> tuple[list[int], tuple[int, ...]]:
    """The chain (global ranks, in stage order) and data-parallel group of the rank at ``rank`` in ``ranks``
    (the module's docstring gives the rule)."""
    p, sp = pipeline_parallel, sequence
    pipeline, place, s = rank // (p * sp), rank // sp % p, rank % sp
    chain = [ranks[(pipeline * p + q) * sp + s] for q in range(p)]
    data = tuple(r for i, r in enumerate(ranks) if i // sp % p == place)
    return chain, data


def place_of(rank: int, pipeline_parallel: int, sequence: int | None) -> int:
    """The stage place (0 to ``P - 1``) of the rank at ``rank`` in its step group."""
    return rank // (sequence or 1) % pipeline_parallel


def zero_within_stages(
    group: ProcessGroupInfo,
    pipeline_parallel: int | None,
    stage: int,
    timeout: float,
    sequence: int | None = None,
    shard_group_size: int | None = None,
) -> ProcessGroupInfo:
    """``group`` with this rank's data-parallel group as ``data`` and its shard axis (hybrid sharding: the shard
    and replicate groups ``hybrid_group`` makes within it), where ZeRO shards state within each stage's
    data-parallel group (``pipeline_parallel`` set, stage >= 1, several pipelines); else ``group``. Collective as
    ``pipeline_groups`` (which makes the groups, once) and ``hybrid_group``."""
    if pipeline_parallel is None or plan_stage(group, pipeline_parallel, stage) == 0:
        return group
    groups = pipeline_groups(group, pipeline_parallel, timeout, sequence)
    assert groups.data is not None
    data = ProcessGroupInfo(
        groups.index, len(groups.data_ranks), groups.data.group_name, group.backend, ranks=groups.data_ranks
    )
    data = hybrid_group(data, shard_group_size=shard_group_size, secondary_group_size=None, timeout=timeout)
    return dataclasses.replace(group, shard=data.shard_axis, replicate=data.replicate, data=data)


def plan_stage(group: ProcessGroupInfo, pipeline_parallel: int | None, stage: int) -> int:
    """The ZeRO stage a step's state is laid out for: ``stage``, but 0 for a pipelined step on one pipeline (its
    stages' data-parallel groups have one rank each: nothing to shard over)."""
    if pipeline_parallel is not None and (not group.distributed or group.world_size == pipeline_parallel):
        return 0
    return stage
