"""Pipeline parallelism's process groups with ``P x D`` ranks: ``D`` pipelines of ``P`` consecutive ranks each.

Of a step's ranks ``R`` (its group's global ranks, in order), pipeline ``d`` is ``R[d*P : (d+1)*P]`` and runs the
whole model, stage by stage, on its own share of the batch (``zgraph.pipeline_batch``: rows ``d`` of ``D``); the
ranks at the same place ``p`` of every pipeline run the same stages and form that place's data-parallel group,
over which their stages' gradients are reduced once per step. With ``D = 1`` the pipeline is the step's group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

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
