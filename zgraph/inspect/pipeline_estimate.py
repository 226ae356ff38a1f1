"""``step.estimate`` of a pipelined step (``Config.pipeline_parallel``): each stage's memory, each rank's peak
under the schedule, the bytes sent between stages and reduced over pipelines, and the predicted bubble.

Everything is read from the pipeline's own cut (``zgraph.compile.pipeline.cut_stages``: the graphs each stage's
actions run, lowered as the eager backend runs them) and its schedule's action lists:

- model state: the pieces of state (``zgraph.inspect.model_state``) of the parameters a stage owns (with their
  ``.grad`` and optimizer state) and of the buffers it updates. A rank holds its stages' and every buffer whole
  (``zgraph.runtime.stage_state``); at ZeRO stage 1 or 2 with ``D = world / P`` pipelines, its dim-0 shard (padded,
  ``zgraph.graph.ShardSpec``) of its stages' optimizer state of their parameters' shapes (the 0-d ones whole), and
  their parameters in the padded storage the update all-gathers them into, as the ranks hold them; at stage 3 also
  the parameters as their padded shards (but those ``Config.param_persistence_threshold`` keeps whole);
- memory held under the schedule: each stage graph measured, and each rank's actions walked in order as
  ``zgraph.runtime.pipeline_run`` runs them (``zgraph.inspect.stage_parts``): a rank's peak is its model state, the
  whole batch (every rank is called with it) and the most, over its actions and updates, of what is held then
  (other micro-batches' saved values, gradient sums, what it sent; at ZeRO stage 3 its stages' parameters gathered
  whole, from each stage's gather before its first action until the updates) plus the action's working memory.
  Adding the two as if their peaks met; within 3 % of the measured peak on one process (tests);
- communication per rank and step: ``send``, the point-to-point sends to neighbouring stages' ranks (each
  micro-batch's activations and their gradients), priced as an all-gather of the same bytes per message (the cost
  model measures no point-to-point); with ``world / P`` pipelines, at ZeRO stage 0 ``all_reduce``, one per stage and
  dtype of its gradient sums over the pipelines; at stage >= 1 the collectives of each stage's update graph as its
  data-parallel group runs it (a reduce-scatter of the gradient sums per bucket; at stages 1 and 2 the new
  parameters all-gathered) and at stage 3 of its gather graph (its parameters all-gathered once per step, per
  bucket; with ``Config.pipeline_regather`` before each of the stage's actions), both made by the step's own
  passes (``zgraph.inspect.stage_zero``); with ``P > 1``, one ``all_reduce`` over the pipeline per value combined
  across stages (a global gradient norm's partial sums, an fp16 overflow flag: ``zgraph.passes.stage_totals``), on
  every rank. Not counted: the step's scalars (the returned loss broadcast along the pipeline and all-reduced over
  the pipelines, a token mean's count all-reduced over them by the ranks of the stage that makes it), a few bytes
  each;
- the bubble: ``zgraph.runtime.pipeline_simulate`` with unit costs (as ``explain()``); the step's seconds: the same
  schedule simulated with each kind's cost from the cost model's timeline of the costliest stage's graph, plus the
  updates, the gathers and the all-reduces.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from zgraph.config import Config
from zgraph.graph import INPUT, VAL, CostModel, placeholders, shard_rows
from zgraph.inspect.liveness import cuda_block_bytes
from zgraph.inspect.model_state import StatePiece, state_totals
from zgraph.inspect.stage_parts import PART_OF, PARTS, RESIDENT, StagePart, measure, storage_of, value_bytes, walk
from zgraph.inspect.stage_zero import ZERO_GROUP, gathers_per_step, zero_context, zero_gather, zero_update
from zgraph.passes import PassContext
from zgraph.passes.stage_cut import STAGE_PLAN, StagePlan
from zgraph.passes.stage_graphs import StageGraphs
from zgraph.passes.stage_totals import total_inputs
from zgraph.runtime.cost_model import link_seconds
from zgraph.runtime.hybrid import check_pipeline_groups, crosses_nodes
from zgraph.runtime.pipeline_schedule import Action, Schedule
from zgraph.runtime.pipeline_simulate import simulate
from zgraph.runtime.timeline import CollectiveTotals


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    """One pipeline stage of an ``Estimate`` (``Estimate.stages``).

    Attributes:
        stage: the stage, ``0 .. P * v - 1``.
        rank: the place in the pipeline of the rank that runs it (``stage % P``; global ranks
            ``rank + k * P`` with ``world / P`` pipelines).
        blocks: the repeated blocks cut into it.
        model_state_bytes: the stage's own state by kind (``Estimate.model_state_bytes``' kinds): its parameters,
            their ``.grad`` after the step and optimizer state, the buffers it updates.
        saved_bytes: what its forward saves for its backward, per micro-batch.
        in_flight: the most micro-batches whose saved values it holds at once under the schedule (1F1B: at most
            ``P - rank``; GPipe: every micro-batch).
        activation_bytes: ``saved_bytes * in_flight``.
        send_bytes: what it sends to the ranks of its neighbouring stages per step (every micro-batch's activations
            forward and their gradients back; none to a stage on its own rank).
        peak_bytes: its rank's peak (``Estimate.peak_bytes`` of that rank).
        bubble: the share of the step its rank computes nothing (unit costs, ``zgraph.runtime.pipeline_simulate``).
        forward_flops: its forward's cost per micro-batch, as the cut balanced it (``StagePlan.flops``).
    """

    stage: int
    rank: int
    blocks: tuple[str, ...]
    model_state_bytes: Mapping[str, int]
    saved_bytes: int
    in_flight: int
    activation_bytes: int
    send_bytes: int
    peak_bytes: int
    bubble: float
    forward_flops: float


@dataclass(frozen=True)
class RankFigures:
    """One rank of the pipeline (its place ``rank``): the ``Estimate``'s per-rank fields for it."""

    rank: int
    model_state_bytes: dict[str, int]
    peak_bytes: int
    peak_node: str
    alive_at_peak: tuple[tuple[str, int], ...]
    activation_bytes: int
    comm_bytes: dict[str, int]
    comm_count: dict[str, int]
    comm_seconds: dict[str, float]
    link_bytes: dict[str, int]
    comm_ops: dict[str, int]


@dataclass(frozen=True)
class PipelineFigures:
    """What ``pipeline_figures`` found: every stage, every rank, the bubble and the step's predicted seconds."""

    stages: tuple[StageEstimate, ...]
    ranks: tuple[RankFigures, ...]
    bubble: float
    step_seconds: float
    nodes: int


@dataclass(frozen=True)
class Planned:
    """Where the pipeline is planned: the device type, the cost model, the world, consecutive ranks per node, and
    the backend serving the device."""

    device: str
    cost_model: CostModel
    world: int
    ranks_per_node: int | None
    backend: str | None = None


def pipeline_figures(
    cut: fx.GraphModule,
    every: Sequence[StageGraphs],
    schedule: Schedule,
    pieces: Sequence[StatePiece],
    config: Config,
    ctx: PassContext,
    planned: Planned,
) -> PipelineFigures:
    """The figures of a pipeline: ``cut``, the graph ``stage_cut`` stamped; ``every``, its stage graphs;
    ``pieces``, the step's model state (module docstring)."""
    check_pipeline_groups(config.shard_group_size, schedule.ranks, planned.world)
    plan: StagePlan = cut.meta[STAGE_PLAN]
    pipelines = planned.world // schedule.ranks
    sharded = {p.index for p in ctx.params if not p.persistent} if config.stage >= 3 else set()
    pieces = _sharded_within_stages(pieces, config, config.shard_group_size or pipelines, planned.device, sharded)
    held = {storage_of(n.meta[VAL]) for n in placeholders(cut) if n.meta[INPUT].kind in RESIDENT}
    zero = None
    if config.stage >= 1 and pipelines > 1:
        zero = zero_context(
            ctx, pipelines, planned.backend, planned.device, planned.cost_model, config.shard_group_size
        )
    parts = [_measured(g, schedule, ctx, zero, config, planned, held) for g in every]
    batch = schedule.microbatches * sum(
        value_bytes(n.meta[VAL], planned.device) for n in placeholders(cut) if n.meta[INPUT].kind == "input"
    )
    units = simulate(schedule)
    idle = [_idle(row, units.step_time) for row in units.spans]
    totals = [value_bytes(n.meta[VAL], planned.device) for n in total_inputs(cut)]
    ranked = [
        _rank(place, schedule, parts, pieces, plan, config, planned, batch, totals) for place in range(schedule.ranks)
    ]
    ranks = [figures for figures, _ in ranked]
    stages = []
    for g in every:
        place = schedule.rank_of(g.stage)
        saved = parts[g.stage]["forward"].outputs.get("saved", 0)
        in_flight = ranked[place][1].get(g.stage, 0)
        stages.append(
            StageEstimate(
                stage=g.stage,
                rank=place,
                blocks=tuple(name for name, s in plan.blocks.items() if s == g.stage),
                model_state_bytes=state_totals(_owned(pieces, plan, g.stage), config),
                saved_bytes=saved,
                in_flight=in_flight,
                activation_bytes=saved * in_flight,
                send_bytes=_sends(g.stage, schedule, parts)[0],
                peak_bytes=ranks[place].peak_bytes,
                bubble=idle[place],
                forward_flops=plan.flops[g.stage],
            )
        )
    seconds = _step_seconds(schedule, parts, ranks, config)
    nodes = sum(p.nodes for stage in parts for p in stage.values())
    return PipelineFigures(tuple(stages), tuple(ranks), units.bubble, seconds, nodes)


def _measured(
    g: StageGraphs,
    schedule: Schedule,
    ctx: PassContext,
    zero: PassContext | None,
    config: Config,
    planned: Planned,
    held: set[StorageWeakRef],
) -> dict[str, StagePart]:
    """Stage ``g``'s graphs measured (``stage_parts.measure``; on the eager backend with the summing twins of
    those returning gradient contributions); with ZeRO within stages (``zero``: the context of
    its data-parallel group, ``zgraph.inspect.stage_zero``), its update as that group runs it and at stage 3 its
    gather (``"gather"``)."""
    graphs = {p: getattr(g, p) for p in PARTS}
    if zero is not None:
        graphs["update"] = zero_update(g, zero, config)
        gather = zero_gather(g, zero, config)
        graphs.update({} if gather is None else {"gather": gather})
    place, pipelines = schedule.rank_of(g.stage), planned.world // schedule.ranks
    group = [place + k * schedule.ranks for k in range(pipelines)]
    crossing = {ZERO_GROUP: crosses_nodes(group, planned.ranks_per_node)}
    contexts = {} if zero is None else {"update": zero, "gather": zero}
    device, cost_model = planned.device, planned.cost_model
    summing = ("backward", "input_grad", "weight_grad") if config.backend == "eager" else ()  # their twins
    return {
        p: measure(gm, f"stage{g.stage}.{p}", contexts.get(p, ctx), device, cost_model, held, crossing, p in summing)
        for p, gm in graphs.items()
    }


def _sharded_within_stages(
    pieces: Sequence[StatePiece], config: Config, shards: int, device: str, sharded: set[int]
) -> list[StatePiece]:
    """``pieces`` as a rank holds them: at ZeRO stage >= 1 in ``shards`` (the stage's data-parallel ranks, or with
    hybrid sharding its shard group's), the optimizer state of a parameter's shape as its padded dim-0 shard, the
    parameter in its padded whole (``zgraph.runtime.pipeline_groups``), or at stage 3 where it is ``sharded`` (not
    persistent), its padded shard."""
    if config.stage < 1 or shards < 2:
        return list(pieces)
    shapes = {p.spec.index: tuple(p.value.shape) for p in pieces if p.spec.kind == "param"}
    out = []
    for piece in pieces:
        shape, kind = tuple(piece.value.shape), piece.spec.kind
        if kind in ("param", "opt_state") and shape and shape == shapes.get(piece.spec.index):
            whole = kind == "param" and piece.spec.index not in sharded
            rows = shard_rows(shape[0], shards) * (shards if whole else 1)
            nbytes = math.prod((rows, *shape[1:])) * piece.value.element_size()
            piece = piece._replace(nbytes=cuda_block_bytes(nbytes) if device == "cuda" else nbytes)
        out.append(piece)
    return out


def _owner(piece: StatePiece, plan: StagePlan, *, buffers_everywhere: bool) -> int | None:
    """The stage holding a piece of state; None for a buffer every rank holds (``buffers_everywhere``: all of
    them, as ranks hold them; else those no stage updates)."""
    spec = piece.spec
    if spec.kind == "buffer":
        return None if buffers_everywhere else plan.owners.get(("buffer", spec.index))
    return plan.owners.get(("param", spec.index), 0)


def _owned(pieces: Sequence[StatePiece], plan: StagePlan, stage: int) -> list[StatePiece]:
    return [p for p in pieces if _owner(p, plan, buffers_everywhere=False) == stage]


def _idle(row: Sequence[tuple[float, float, Action]], step_time: float) -> float:
    return 1.0 - sum(end - start for start, end, _ in row) / step_time if step_time else 0.0


def _sends(stage: int, schedule: Schedule, parts: list[dict[str, StagePart]]) -> tuple[int, int]:
    """Bytes and tensors ``stage`` sends to other ranks per step: each micro-batch's activations forward (to the
    next stage) and their gradients back (to the previous one)."""
    nbytes = count = 0
    rank = schedule.rank_of(stage)
    if stage + 1 < schedule.stages and schedule.rank_of(stage + 1) != rank:
        nbytes += parts[stage]["forward"].sent.get("activation", 0)
        count += parts[stage]["forward"].counts.get("activation", 0)
    if stage > 0 and schedule.rank_of(stage - 1) != rank:
        nbytes += parts[stage]["backward"].sent.get("activation_grad", 0)
        count += parts[stage]["backward"].counts.get("activation_grad", 0)
    return nbytes * schedule.microbatches, count * schedule.microbatches


def _rank(
    place: int,
    schedule: Schedule,
    parts: list[dict[str, StagePart]],
    pieces: Sequence[StatePiece],
    plan: StagePlan,
    config: Config,
    planned: Planned,
    batch: int,
    totals: Sequence[int],
) -> tuple[RankFigures, Counter]:
    """A rank's figures, and the most micro-batches in flight per stage it runs (``stage_parts.walk``); ``totals``:
    the bytes of each value combined across stages (``stage_totals``), all-reduced over the rank's chain."""
    mine = [s for s in range(schedule.stages) if schedule.rank_of(s) == place]
    held = [p for p in pieces if _owner(p, plan, buffers_everywhere=True) in (None, *mine)]
    pipelines = planned.world // schedule.ranks
    comm = _Comm(planned)
    for s in mine:
        nbytes, count = _sends(s, schedule, parts)
        if count:
            neighbours = [r for r in (s - 1, s + 1) if 0 <= r < schedule.stages]
            comm.add("send", nbytes, count, [place, *(schedule.rank_of(r) for r in neighbours)], "isend")
        if pipelines > 1 and config.stage == 0:
            for nbytes in parts[s]["backward"].by_dtype.values():
                comm.add("all_reduce", nbytes, 1, [place + k * schedule.ranks for k in range(pipelines)])
        for name in ("update", "gather"):  # ZeRO within stages: their collectives over the data-parallel group
            if name in parts[s]:
                times = gathers_per_step(schedule, s, config.pipeline_regather) if name == "gather" else 1
                comm.add_totals(parts[s][name].collectives, times)
    if schedule.ranks > 1:  # every rank, whether its stages have a partial or not (``RankRunner._stage_totals``)
        for nbytes in totals:
            comm.add("all_reduce", nbytes, 1, [k * (config.sequence_parallel or 1) for k in range(schedule.ranks)])
    state = state_totals(held, config)
    walked = walk(place, schedule, parts, state["total"] + batch, config.pipeline_regather)
    figures = RankFigures(
        place,
        state,
        walked.peak,
        walked.where,
        walked.alive,
        walked.activations,
        comm.bytes,
        comm.count,
        comm.seconds,
        comm.links,
        comm.ops,
    )
    return figures, walked.in_flight


@dataclass
class _Comm:
    """A rank's communication per step, added up: bytes, messages, seconds and ops by kind, bytes by link."""

    planned: Planned
    bytes: dict[str, int] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)
    links: dict[str, int] = field(default_factory=lambda: {"intra_node": 0, "inter_node": 0})

    def add(self, kind: str, nbytes: int, count: int, ranks: list[int], op: str | None = None) -> None:
        """``count`` messages of ``nbytes`` in all, of ``kind``, among ``ranks`` (whether they cross nodes), counted
        and priced (a send as an all-gather), as ``count`` ops ``op`` (default: ``kind``)."""
        crossing = crosses_nodes(ranks, self.planned.ranks_per_node)
        priced = "all_gather_into_tensor" if kind == "send" else kind
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.count[kind] = self.count.get(kind, 0) + count
        seconds = count * link_seconds(self.planned.cost_model, priced, nbytes // count, crossing)
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.links["inter_node" if crossing else "intra_node"] += nbytes
        self.ops[op or kind] = self.ops.get(op or kind, 0) + count

    def add_totals(self, totals: CollectiveTotals, times: int = 1) -> None:
        """A stage graph's collectives (``totals``), run ``times`` per step."""
        for kind, count in totals.counts.items():
            self.count[kind] = self.count.get(kind, 0) + count * times
            self.bytes[kind] = self.bytes.get(kind, 0) + totals.sent[kind] * times
            self.seconds[kind] = self.seconds.get(kind, 0.0) + totals.seconds[kind] * times
        for op, count in totals.ops.items():
            self.ops[op] = self.ops.get(op, 0) + count * times
        for link, nbytes in totals.link_bytes.items():
            self.links[link] += nbytes * times


def _step_seconds(
    schedule: Schedule, parts: list[dict[str, StagePart]], ranks: Sequence[RankFigures], config: Config
) -> float:
    """The schedule simulated with each compute kind's cost the costliest stage's (cost model timelines), plus the
    slowest rank's updates, gathers (ZeRO stage 3) and all-reduces (ZeRO stage 0)."""
    costs = {kind: max(stage[name].seconds for stage in parts) for kind, name in PART_OF.items()}
    pipelined = simulate(schedule, costs).step_time
    after = 0.0
    for r in ranks:
        mine = [s for s in range(schedule.stages) if schedule.rank_of(s) == r.rank]
        gathers = sum(
            parts[s]["gather"].seconds * gathers_per_step(schedule, s, config.pipeline_regather)
            for s in mine
            if "gather" in parts[s]
        )
        own = gathers + sum(parts[s]["update"].seconds for s in mine)
        after = max(after, own + r.comm_seconds.get("all_reduce", 0.0))
    return pipelined + after
