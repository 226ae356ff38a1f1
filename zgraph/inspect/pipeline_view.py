"""``explain()`` of a pipelined step (``Config.pipeline_parallel``): which stage each block went to, on which rank,
the schedule's predicted timeline and bubble (``zgraph.runtime.pipeline_simulate``, unit costs), and at ZeRO >= 1
with several pipelines, what each stage shards over its data-parallel group."""

from __future__ import annotations

from zgraph.compile.variant import CompiledStep, PipelineCompiled
from zgraph.graph import INPUT, placeholders
from zgraph.passes.stage_cut import STAGE_PLAN
from zgraph.runtime.pipeline_simulate import UNIT_COSTS, simulate

_WIDEST_TIMELINE = 60  # time units a drawn timeline may span


def pipeline_lines(compiled: CompiledStep) -> list[str]:
    """The stages (blocks, rank, forward flops) and the schedule (bubble, timeline); none without a pipeline."""
    program = compiled.pipeline
    if program is None:
        return []
    schedule = program.schedule
    plan = compiled.transformed.meta[STAGE_PLAN]
    simulation = simulate(schedule)
    p, m = schedule.ranks, schedule.microbatches
    costs = ", ".join(f"{kind.value} {cost:g}" for kind, cost in UNIT_COSTS.items())
    peers, pipelines = program.peers, ""
    if peers is not None and peers.sequence > 1:
        count = f"{peers.pipelines // peers.sequence} pipelines x {peers.sequence} sequence slices"
        pipelines = f" of the chain of global ranks {peers.ranks}, one of {peers.pipelines} ({count})"
    elif peers is not None and peers.pipelines > 1:
        pipelines = f" of the pipeline of global ranks {peers.ranks}, one of {peers.pipelines} pipelines"
    lines = [
        f"pipeline: {schedule.name}, {p} ranks x {schedule.virtual} stages each, {m} micro-batches; this is rank "
        f"{program.rank}{pipelines}",
        f"  predicted bubble {simulation.bubble:.1%} (costs: {costs}; for GPipe and 1F1B, (P - 1) / (M + P - 1) = "
        f"{(p - 1) / (m + p - 1):.1%})",
    ]
    for stage in range(plan.stages):
        blocks = [name for name, s in plan.blocks.items() if s == stage]
        shown = f"{blocks[0]} .. {blocks[-1]}" if len(blocks) > 2 else ", ".join(blocks) or "no block"
        lines.append(
            f"  stage {stage} (rank {schedule.rank_of(stage)}): {len(blocks)} blocks ({shown}), "
            f"{plan.flops[stage]:.3g} forward flops per micro-batch"
        )
    lines += _sharding_lines(program) + _gather_lines(program)
    if simulation.step_time <= _WIDEST_TIMELINE:
        lines.append("  timeline (one column per forward's time; '.': idle):")
        lines += [f"    {line}" for line in simulation.timeline().splitlines()]
    return lines


_SHARDED = {"param": "parameters", "grad": "gradients", "opt_state": "optimizer state"}


def _the(n: int, noun: str) -> str:
    """``the 1 rank``, ``the 4 ranks``."""
    return f"the {n} {noun}" + ("" if n == 1 else "s")


def _sharding_lines(program: PipelineCompiled) -> list[str]:
    """Where the update graphs shard state within each stage's data-parallel group (ZeRO >= 1, several
    pipelines): what they read sharded, over which ranks."""
    peers = program.peers
    if not program.update_reduces or peers is None:
        return []
    kinds = {
        spec.kind
        for s in program.stages
        for spec in (n.meta[INPUT] for n in placeholders(program.graphs[f"stage{s}.update"]))
        if spec.layout == "shard"
    }
    what = " and ".join(_SHARDED[k] for k in _SHARDED if k in kinds) or "nothing"
    shard = program.shard_ranks
    held = f"a stage's {what} sharded" if kinds else "a stage's state whole, nothing sharded"
    if shard:
        groups = _the(peers.pipelines // len(shard), "shard group")
        return [
            f"  ZeRO within each stage, hybrid: {held} over {_the(len(shard), 'rank')} of its "
            f"shard group (here global ranks {list(shard)}) and replicated across {groups} "
            f"of its data-parallel group (global ranks {list(peers.data_ranks)}); its update graph "
            "reduce-scatters the gradient sums within the shard group and all-reduces the shards across the groups "
            "once per step (the lines `buckets of stageN.update`)"
        ]
    return [
        f"  ZeRO within each stage: {held} over {_the(peers.pipelines, 'rank')} of its data-parallel "
        f"group (here global ranks {list(peers.data_ranks)}); its update graph reduce-scatters the gradient sums "
        "over that group once per step (the lines `buckets of stageN.update`)"
    ]


def _gather_lines(program: PipelineCompiled) -> list[str]:
    """At ZeRO stage 3: when each stage all-gathers its parameters (the graphs ``stageN.gather``)."""
    if not any(stage.gather is not None for stage in program.stages.values()):
        return []
    if program.regather:
        return [
            "  ZeRO 3: each stage all-gathers its parameters before each of its actions and lets them go after it "
            "(Config.pipeline_regather; the graphs `stageN.gather`)"
        ]
    return [
        "  ZeRO 3: each stage all-gathers its parameters once per step, before its first action, and keeps them "
        "across the micro-batches until its update (the graphs `stageN.gather`)"
    ]
