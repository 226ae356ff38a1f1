"""Pipeline parallelism's process groups with ``P x D`` ranks: ``D`` pipelines of ``P`` consecutive ranks each.

Of a step's ranks ``R`` (its group's global ranks, in order), pipeline ``d`` is ``R[d*P : (d+1)*P]`` and runs the
whole model, stage by stage, on its own share of the batch (``zgraph.pipeline_batch``: rows ``d`` of ``D``); the
ranks at the same place ``p`` of every pipeline run the same stages and form that place's data-parallel group,
over which their stages' gradients are reduced once per step. With ``D = 1`` the pipeline is the step's group.

ZeRO (stage 1 or 2) shards state within each place's data-parallel group: ``zero_within_stages`` makes that group
the step group's shard axis, so the sharding plan (``zgraph.runtime.sharded_state``) cuts a stage's optimizer
state (stage 2: its gradients) over the ``D`` ranks running it. With one pipeline there is nothing to shard over
(``plan_stage``: the state is laid out as at stage 0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from zgraph.graph import Axis
from zgraph.runtime.process_group import ProcessGroupInfo, new_timed_group


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's pipeline (``group``, its global ``ranks`` in stage order) and data-parallel group (``data``, its
    global ``data_ranks``; None with one pipeline); ``index``: which pipeline this rank is in."""

    group: dist.ProcessGroup | None
    ranks: list[int]
    data: dist.ProcessGroup | None = None
    data_ranks: tuple[int, ...] = ()
    index: int = 0


_GROUPS: dict[tuple[str, int, float], PipelineGroups] = {}


def pipeline_groups(group: ProcessGroupInfo, pipeline_parallel: int, timeout: float) -> PipelineGroups:
    """This rank's groups (made once per step group, ``P`` and timeout; each rank makes its own two, pipeline
    first: ``use_local_synchronization``, only their members meet)."""
    if not group.distributed:
        return PipelineGroups(None, [0])
    ranks = list(group.ranks or range(group.world_size))
    p, me = pipeline_parallel, group.rank
    index, place = divmod(me, p)
    if len(ranks) == p:
        return PipelineGroups(dist.distributed_c10d._resolve_process_group(group.group_name), ranks)
    key = (group.group_name, p, float(timeout))
    found = _GROUPS.get(key)
    if found is None or found.group not in dist.distributed_c10d._world.pg_names:  # not made, or destroyed since
        mine = ranks[index * p : (index + 1) * p]
        data = tuple(ranks[place::p])
        _GROUPS[key] = PipelineGroups(
            new_timed_group(mine, group.backend, timeout, local=True),
            mine,
            new_timed_group(list(data), group.backend, timeout, local=True),
            data,
            index,
        )
    return _GROUPS[key]


def zero_within_stages(
    group: ProcessGroupInfo, pipeline_parallel: int | None, stage: int, timeout: float
) -> ProcessGroupInfo:
    """``group`` with this rank's data-parallel group as its shard axis, where ZeRO shards state within each
    stage's data-parallel group (``pipeline_parallel`` set, stage >= 1, several pipelines); else ``group``.
    Collective as ``pipeline_groups`` (which makes the groups, once)."""
    if pipeline_parallel is None or plan_stage(group, pipeline_parallel, stage) == 0:
        return group
    groups = pipeline_groups(group, pipeline_parallel, timeout)
    assert groups.data is not None
    axis = Axis(size=len(groups.data_ranks), rank=groups.index, name=groups.data.group_name)
    return dataclasses.replace(group, shard=axis)


def plan_stage(group: ProcessGroupInfo, pipeline_parallel: int | None, stage: int) -> int:
    """The ZeRO stage a step's state is laid out for: ``stage``, but 0 for a pipelined step on one pipeline (its
    stages' data-parallel groups have one rank each: nothing to shard over)."""
    if pipeline_parallel is not None and (not group.distributed or group.world_size == pipeline_parallel):
        return 0
    return stage
