"""Pipeline parallelism (``Config.pipeline_parallel``) for one call: the graph captured on one micro-batch
(``zgraph.binding.micro_batches``) cut into stages (``zgraph.passes.stage_cut``, ``stage_graphs``) and this rank's
stages compiled; a call runs by this rank's schedule (``zgraph.compile.pipeline_call``).

Once compiled, a rank holds only its stages' parameters, gradients and optimizer state
(``zgraph.runtime.stage_state``: the others' are released to meta). The step's results are made by one stage each,
per micro-batch; the rank that makes one broadcasts it to the pipeline, so every rank returns what eager returns on
the whole batch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor

from zgraph.capture.captured import CapturedGraph
from zgraph.compile.build import pass_context
from zgraph.compile.lower import lower
from zgraph.compile.variant import CompiledStep, PipelineCompiled
from zgraph.config import Config
from zgraph.config_checks import pipeline_world_error
from zgraph.errors import CaptureError
from zgraph.graph import INPUT, VAL, GraphOutput, input_specs, output_node, output_roles, placeholders
from zgraph.passes import Pass, PassContext, PassRecord, run_passes
from zgraph.passes.micro_batch_loss import LOSS_COMBINE, micro_batch_loss
from zgraph.passes.sizes_from_inputs import sizes_from_inputs
from zgraph.passes.stage_cut import STAGE_PLAN, StagePlan, stage_cut
from zgraph.passes.stage_gather import stage_gather
from zgraph.passes.stage_grads import stage_grads
from zgraph.passes.stage_graphs import StageGraphs, build_graph, stage_graphs
from zgraph.passes.stage_totals import split_update, total_inputs
from zgraph.runtime.consistency import describe_graph, digest
from zgraph.runtime.executor import Executable, compile_graph, run_consuming
from zgraph.runtime.pipeline_groups import layout, pipeline_groups, place_of
from zgraph.runtime.pipeline_run import CONSUMED, Part, Peers, StageRun
from zgraph.runtime.pipeline_schedule import Kind, Schedule, build_schedule
from zgraph.runtime.process_group import ProcessGroupInfo
from zgraph.runtime.stage_state import release_other_stages
from zgraph.runtime.state import Binding
from zgraph.runtime.sum_in_graph import summing_variant
from zgraph.sizes import input_sizes

_PASSES_BEFORE_THE_CUT = ("sequence_parallel", "cse", "remat")
_KINDS = {"forward": Kind.F, "backward": Kind.B, "input_grad": Kind.I, "weight_grad": Kind.W, "update": None}
# ZeRO >= 1; at stage 3 ``shard_params`` (the update reads and writes shards); ``cast``: reductions in
# ``Config.reduce_dtype``; ``clip_grad``, ``loss_scale``: norms and overflow checks of gradient shards
PASSES_ON_THE_UPDATE = ("shard_optimizer", "reduce_scatter_grads", "shard_params", "cast", "clip_grad", "loss_scale",
                         "bucket", "lower_collectives")  # fmt: skip
PASSES_ON_THE_GATHER = ("bucket", "lower_collectives")  # ZeRO 3: a stage's parameters gathered once per step


def compile_pipeline(
    captured: CapturedGraph, binding: Binding, config: Config, group: ProcessGroupInfo, capture_seconds: float
) -> CompiledStep:
    """Cut ``captured`` (traced on one micro-batch) into stages and compile this rank's."""
    assert captured.gm is not None and config.pipeline_parallel is not None
    if captured.split is not None:
        raise CaptureError(
            "zgraph: Config.pipeline_parallel runs the whole training step as one schedule of micro-batches, so the "
            "step must call loss.backward() (and the optimizer's step()) itself; this one returns a loss that "
            "requires grad for a backward outside it (split mode), which pipelines do not run. Move "
            "loss.backward() and opt.step() into the decorated function, or drop pipeline_parallel"
        )
    if group.world_size % (config.pipeline_parallel * (config.sequence_parallel or 1)):
        raise ValueError(pipeline_world_error(config.pipeline_parallel, group.world_size, config.sequence_parallel))
    place = place_of(group.rank, config.pipeline_parallel, config.sequence_parallel)  # this rank's stage place
    ctx = stage_context(binding)
    records, every, schedule = cut_stages(captured.gm, ctx, config)
    graphs: OrderedDict[str, fx.GraphModule] = OrderedDict()
    used = {a.kind for actions in schedule.actions for a in actions}
    backends = {name: config.backend if kind is None or kind in used else "eager" for name, kind in _KINDS.items()}
    zero = _zero_passes(config, binding)
    stage = binding.plan.stage
    mine = {
        g.stage: _compile_stage(g, ctx, graphs, backends, zero, stage)
        for g in every
        if schedule.rank_of(g.stage) == place
    }
    combine = records[0].gm.meta[LOSS_COMBINE]
    count_stage = next((g.stage for g in every if "loss_count" in {r.kind for r in output_roles(g.forward)}), -1)
    program = PipelineCompiled(schedule, place, mine, _results(every), graphs, combine, count_stage)
    program.counts = [(spec, _counting(gm)) for spec, gm in combine.counts]
    program.update_reduces = zero is not None
    program.regather = config.pipeline_regather
    program.shard_ranks = _shard_ranks(binding.plan.group)
    program.totals = [(p.meta[INPUT], p.meta[VAL]) for p in total_inputs(records[-1].gm)]
    program.state_elsewhere = _state_written(g for g in every if schedule.rank_of(g.stage) != place)
    program.peers = _peers(group, config)
    program.sizes = input_sizes(records[-1].gm)
    description = describe_graph(captured.gm) + [str(schedule)]
    seconds = sum(p.compile_seconds for s in mine.values() for p in _parts(s))
    executable = Executable(_runs_by_schedule, config.backend, seconds)
    compiled = CompiledStep(captured, records, executable, capture_seconds, description=description)
    compiled.digest, compiled.pipeline = digest(description), program
    if group.distributed:
        _release_other_stages(binding, records[-1].gm.meta[STAGE_PLAN], schedule, program.peers, place)
    return compiled


def stage_context(binding: Binding) -> PassContext:
    """The pass context of a pipeline's cut and stage graphs: no process group (the stages' own come later), but
    with sequence parallelism the step's group and its sequence group, for the ``sequence_parallel`` pass, which
    runs before the cut (each stage's forward and backward then hold their attention's all-to-alls)."""
    whole = pass_context(binding)
    if whole.sequence_group is None:
        return PassContext(params=whole.params)
    group = dict(world_size=whole.world_size, rank=whole.rank, group_name=whole.group_name)
    return PassContext(params=whole.params, sequence_group=whole.sequence_group, **group)


def cut_stages(
    gm: fx.GraphModule, ctx: PassContext, config: Config, keep: bool = True
) -> tuple[list[PassRecord], list[StageGraphs], Schedule]:
    """``gm`` (traced on one micro-batch) through the passes before the cut and ``stage_cut``: the records, every
    stage's graphs and the schedule (``step.estimate`` reads the same; ``keep``: as for ``run_passes``)."""
    assert config.pipeline_parallel is not None
    stages = config.pipeline_parallel * config.pipeline_virtual_stages
    cut = functools.partial(stage_cut, stages=stages, split=config.pipeline_split)
    passes = [p for p in config.passes() if p.name in _PASSES_BEFORE_THE_CUT]
    loss = Pass("micro_batch_loss", micro_batch_loss, requires={"phases"})
    sizes = Pass("sizes_from_inputs", sizes_from_inputs, requires={"phases"})
    records = run_passes(gm, ctx, [loss, *passes, sizes, Pass("stage_cut", cut, requires={"phases"})], keep=keep)
    count = config.microbatches or config.pipeline_parallel
    schedule = build_schedule(config.schedule, config.pipeline_parallel, count, config.pipeline_virtual_stages)
    return records, stage_graphs(records[-1].gm), schedule


def _counting(gm: fx.GraphModule) -> Part:
    """A whole batch's count's graph (``token_count``), compiled eager: a few ops on the labels."""
    executable = compile_graph(gm, "eager")
    assert executable is not None
    return Part(executable.run, input_specs(gm), output_roles(gm), [])


def _release_other_stages(binding: Binding, plan: StagePlan, schedule: Schedule, peers: Peers, place: int) -> None:
    """Each parameter's holder, the global rank running its stage in the first chain (``peers.first``); those of
    stages this rank does not run released here (last: the step is compiled, nothing refused it)."""
    stages = {index: stage for (kind, index), stage in plan.owners.items() if kind == "param"}
    holders = {index: peers.first[schedule.rank_of(stage)] for index, stage in stages.items()}
    release_other_stages(binding, holders, {i for i, stage in stages.items() if schedule.rank_of(stage) == place})


def _runs_by_schedule(inputs: object) -> object:
    raise AssertionError("a pipelined step runs by its schedule (zgraph.compile.pipeline.run_pipeline)")


def _parts(stage: StageRun) -> list[Part]:
    parts = [stage.forward, stage.backward, stage.input_grad, stage.weight_grad, stage.update]
    return parts + [p for p in (stage.gather, stage.totals) if p is not None]


def _zero_passes(config: Config, binding: Binding) -> tuple[PassContext, list[Pass]] | None:
    """At ZeRO stage >= 1 with several pipelines, what the update graphs run before lowering (``stage_grads``):
    the context of this rank's stage's data-parallel group (with hybrid sharding's shard and replicate groups
    within it) and the config's ZeRO passes (at stage 3 ``shard_params``: the update reads and writes the
    parameters' shards); else None."""
    plan = binding.plan
    data = plan.group.data
    if plan.stage == 0 or data is None:
        return None
    whole = pass_context(binding)
    group = dict(world_size=data.world_size, rank=data.rank, group_name=data.group_name)
    ctx = dataclasses.replace(whole, **group, shard_group=data.shard, replicate_group=data.replicate)
    passes = [p for p in config.passes() if p.name in PASSES_ON_THE_UPDATE]
    return ctx, [Pass("stage_grads", stage_grads, requires={"phases"}), *passes]


def _shard_ranks(group: ProcessGroupInfo) -> tuple[int, ...]:
    """With hybrid sharding within stages, the global ranks of this rank's shard group; else ()."""
    data = group.data
    if data is None or data.replicate is None or data.shard is None:
        return ()
    return tuple(dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(data.shard.name)))


def _compile_stage(
    g: StageGraphs,
    ctx: PassContext,
    graphs: OrderedDict[str, fx.GraphModule],
    backends: dict[str, str],
    zero: tuple[PassContext, list[Pass]] | None,
    stage: int,
) -> StageRun:
    """The stage's five graphs lowered, each for its backend in ``backends`` (``Config.backend`` for those the
    schedule runs, ``"eager"`` for the others: no compile for a graph that never runs); the update graph first
    through the ZeRO passes over the stage's data-parallel group (``zero``, ``_zero_passes``), its partials of
    values across stages first where it has some (``stage_totals``). At ZeRO stage 3, also the graph gathering the
    stage's parameter shards (``stage_gather``, bucketed: ``PASSES_ON_THE_GATHER``); on the eager backend, the
    summing twins of the graphs returning gradient contributions (``zgraph.runtime.sum_in_graph``)."""
    parts, totals = [], None
    for name, backend in backends.items():
        gm, part_ctx = getattr(g, name), ctx
        if name == "update" and zero is not None:
            part_ctx, passes = zero
            gm = run_passes(gm, part_ctx, passes)[-1].gm
        split = split_update(gm, build_graph) if name == "update" else None
        if split is not None:  # the partials of a global norm or overflow check first (``stage_totals``)
            totals = _lowered(split[0], part_ctx, backend, graphs, f"stage{g.stage}.totals")
            gm = split[1]
        parts.append(_lowered(gm, part_ctx, backend, graphs, f"stage{g.stage}.{name}"))
    gather = None if zero is None else _gather(g, zero, stage, backends["forward"], graphs)
    run = StageRun(g.stage, *parts, gather=gather, totals=totals)
    for name in ("backward", "input_grad", "weight_grad"):  # the eager ones: their summing twins
        twin = summing_variant(graphs[f"stage{g.stage}.{name}"]) if getattr(run, name).backend == "eager" else None
        if twin is not None:
            call = run_consuming(twin) if name in CONSUMED else compile_graph(twin, "eager").run
            examples = [p.meta[VAL] for p in placeholders(twin)]
            run.summing[name] = Part(call, input_specs(twin), output_roles(twin), examples)
    return run


def _gather(
    g: StageGraphs,
    zero: tuple[PassContext, list[Pass]],
    stage: int,
    backend: str,
    graphs: OrderedDict[str, fx.GraphModule],
) -> Part | None:
    """At ZeRO stage 3, the stage's graph gathering its parameter shards (``stage_gather``), bucketed; else None."""
    ctx, passes = zero
    gm = stage_gather([g.forward, g.backward, g.input_grad, g.weight_grad], ctx, stage=stage)
    if gm is None:
        return None
    gm = run_passes(gm, ctx, [p for p in passes if p.name in PASSES_ON_THE_GATHER], check_input=False)[-1].gm
    return _lowered(gm, ctx, backend, graphs, f"stage{g.stage}.gather")


def _lowered(
    gm: fx.GraphModule, ctx: PassContext, backend: str, graphs: OrderedDict[str, fx.GraphModule], name: str
) -> Part:
    """``gm`` lowered for ``backend`` as a ``Part``; the lowered graph kept in ``graphs`` as ``name``."""
    records, executable = lower(gm, ctx, backend)
    final = records[-1].gm
    graphs[name] = final
    examples = [p.meta[VAL] for p in placeholders(final)]
    run, seconds, updated = executable.run, executable.compile_seconds, executable.updated_inputs
    if executable.backend == "eager" and name.rsplit(".", 1)[-1] in CONSUMED:
        run = run_consuming(final)  # a stage's saved activations go as its backward reads them
    return Part(run, input_specs(final), output_roles(final), examples, updated, seconds, executable.backend)


def _state_written(others: Iterable[StageGraphs]) -> tuple[tuple[GraphOutput, torch.Size, torch.dtype], ...]:
    """The ``.grad`` and optimizer state the update graphs of ``others`` (stages this rank does not run) write, with
    their whole shapes and dtypes."""
    written = []
    for g in others:
        outputs = output_node(g.update).args[0]
        for role, node in zip(output_roles(g.update), outputs):
            if role.kind in ("grad", "opt_state"):
                written.append((role, node.meta[VAL].shape, node.meta[VAL].dtype))
    return tuple(written)


def _results(every: list[StageGraphs]) -> dict[int, tuple[int, Tensor]]:
    """Where each of the step's results is made, with one micro-batch's value of it (a fake tensor)."""
    out = {}
    for g in every:
        for gm in (g.forward, g.backward, g.update):
            node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
            for value, role in zip(node.args[0], output_roles(gm)):
                if role.kind == "user":
                    out[role.index] = (g.stage, value.meta[VAL] if isinstance(value, fx.Node) else value)
    return out


def _peers(group: ProcessGroupInfo, config: Config) -> Peers:
    assert config.pipeline_parallel is not None
    p, sp = config.pipeline_parallel, config.sequence_parallel
    groups = pipeline_groups(group, p, config.collective_timeout, sp)
    ranks = list(group.ranks or range(group.world_size))
    first = layout(ranks, 0, p, sp or 1)[0] if group.distributed else groups.ranks
    return Peers(
        groups.group,
        groups.ranks,
        groups.data,
        pipelines=max(1, len(groups.data_ranks)),
        data_ranks=groups.data_ranks,
        reduce_dtype=config.pass_options()["reduce_dtype"],
        first=first,
        sequence=sp or 1,
    )
