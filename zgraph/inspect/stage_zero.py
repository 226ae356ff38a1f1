"""ZeRO within a pipeline's stages, for ``step.estimate`` (``zgraph.inspect.pipeline_estimate``): with ``D = world / P``
pipelines at ZeRO stage >= 1, a stage's update graph through the ZeRO passes over the stage's data-parallel group of
``D`` ranks (``stage_grads``, then the config's passes ``zgraph.compile.pipeline`` runs on it: a reduce-scatter of
the gradient sums, at stages 1 and 2 the new parameters all-gathered), and at stage 3 the graph gathering the stage's
parameter shards once per step (``stage_gather``, bucketed), as the pipelined step compiles them for its ranks.

The context is a stand-in for the data-parallel group (``ZERO_GROUP``: never created): every parameter of a
non-zero dimension is cut in ``D`` padded dim-0 shards (``zgraph.graph.ShardSpec``), stage 3 keeping whole those
the step's plan keeps whole (``Config.param_persistence_threshold``). With hybrid sharding
(``Config.shard_group_size=N``) in ``N`` shards over its shard groups, replicated across the ``D / N`` of them, as
``zgraph.runtime.pipeline_groups.zero_within_stages`` cuts the group (``zgraph.runtime.hybrid.planned_group``)."""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from zgraph.compile.pipeline import PASSES_ON_THE_GATHER, PASSES_ON_THE_UPDATE
from zgraph.config import Config
from zgraph.graph import CostModel, ShardSpec
from zgraph.passes import Pass, PassContext, run_passes
from zgraph.passes.stage_gather import stage_gather
from zgraph.passes.stage_grads import stage_grads
from zgraph.passes.stage_graphs import StageGraphs
from zgraph.runtime.hybrid import planned_group
from zgraph.runtime.pipeline_schedule import Schedule
from zgraph.runtime.process_group import ProcessGroupInfo

ZERO_GROUP = "zgraph-estimate-stage-data"  # the stand-in name of a stage's data-parallel group


def zero_context(
    ctx: PassContext,
    pipelines: int,
    backend: str | None,
    device: str,
    cost_model: CostModel,
    shard_group_size: int | None = None,
) -> PassContext:
    """``ctx`` (the pipeline's cut's: its parameters, which stage 3 keeps whole) over a stage's data-parallel group
    of ``pipelines`` ranks (hybrid sharding's shard groups of ``shard_group_size`` within it), served by
    ``backend``, on ``device``, priced by ``cost_model``."""
    data = ProcessGroupInfo(0, pipelines, ZERO_GROUP, backend)
    data = planned_group(data, shard_group_size=shard_group_size, secondary_group_size=None)
    shards = data.shard_axis.size
    params = tuple(dataclasses.replace(p, shard=ShardSpec(p.shape, shards) if p.shape else None) for p in ctx.params)
    group = {"world_size": pipelines, "rank": 0, "group_name": ZERO_GROUP, "backend": backend}
    axes = {"shard_group": data.shard, "replicate_group": data.replicate}
    return dataclasses.replace(ctx, **group, **axes, device_type=device, cost_model=cost_model, params=params)


def zero_update(g: StageGraphs, ctx: PassContext, config: Config) -> fx.GraphModule:
    """Stage ``g``'s update graph as a rank of its data-parallel group runs it (``ctx``: ``zero_context``)."""
    passes = [Pass("stage_grads", stage_grads, requires={"phases"})]
    passes += [p for p in config.passes() if p.name in PASSES_ON_THE_UPDATE]
    return run_passes(g.update, ctx, passes, keep=False)[-1].gm


def zero_gather(g: StageGraphs, ctx: PassContext, config: Config) -> fx.GraphModule | None:
    """At ZeRO stage 3, stage ``g``'s graph gathering its parameter shards, bucketed; else (or with none to
    gather) None."""
    gm = stage_gather([g.forward, g.backward, g.input_grad, g.weight_grad], ctx, stage=config.stage)
    if gm is None:
        return None
    passes = [p for p in config.passes() if p.name in PASSES_ON_THE_GATHER]
    return run_passes(gm, ctx, passes, check_input=False, keep=False)[-1].gm


def gathers_per_step(schedule: Schedule, stage: int, regather: bool) -> int:
    """How often a step runs ``stage``'s gather (ZeRO 3): once, or before each of its actions (``regather``:
    ``Config.pipeline_regather``)."""
    return sum(a.stage == stage for a in schedule.compute(schedule.rank_of(stage))) if regather else 1
