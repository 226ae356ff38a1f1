"""A pipeline's stage graphs measured, and a rank's actions walked in order (``zgraph.inspect.pipeline_estimate``).

``measure``: one stage graph lowered as the eager backend runs it, with its liveness (``zgraph.inspect.liveness``),
its working memory (the liveness peak less the model state and batch it reads, held anyway), the bytes of its outputs
by kind (storages counted once, none of the model state's or the batch's), and its seconds by the cost model's
timeline; with ``summing``, its twin that adds its gradient contributions into their sums
(``zgraph.runtime.sum_in_graph``: the eager backend runs it once the sums exist) measured too. ``walk``: a rank's
compute actions as ``zgraph.runtime.pipeline_run`` runs them, holding a micro-batch's saved values from its F to its
B (or W; from I to W also the split backward's partial values and received gradients), a stage's gradient sums from
its first backward to its update (the later backwards as their summing twins, where measured), at ZeRO stage 3 a
stage's parameters gathered whole from its gather (before its first action) until the updates
(``Config.pipeline_regather``: from a gather before each of its actions to the action's end), and everything the rank
sends until the step's end (an upper bound: the runtime lets a send go once its peer has received it); its peak is
the most, over the actions, gathers and updates, of what is held plus the action's working memory."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from zgraph.compile.lower import lower
from zgraph.graph import INPUT, OUTPUTS, STATE_KINDS, VAL, CostModel, output_node, placeholders, tensor_bytes
from zgraph.inspect.liveness import Liveness, cuda_block_bytes, liveness
from zgraph.passes import PassContext
from zgraph.runtime.pipeline_run import CONSUMED, PART_OF
from zgraph.runtime.pipeline_schedule import Action, Kind, Schedule
from zgraph.runtime.sum_in_graph import summing_variant
from zgraph.runtime.timeline import CollectiveTotals, collective_totals
from zgraph.runtime.timeline import estimate as timeline

PARTS = (*PART_OF.values(), "update")
RESIDENT = (*STATE_KINDS, "input", "grad_sum")  # graph inputs a rank holds anyway: state, batch, gradient sums
_SENT = "sent, held until the step's end"
_GATHERED = "whole parameters gathered for the rank's stages, held until the updates"
_REGATHERED = "whole parameters gathered for this action (Config.pipeline_regather)"


@dataclass(frozen=True)
class StagePart:
    """One stage graph, lowered: its liveness, working memory, output bytes by kind, and seconds."""

    name: str
    live: Liveness
    working: int
    outputs: Mapping[str, int]
    counts: Mapping[str, int]  # tensors per output kind
    sent: Mapping[str, int]  # bytes per output kind as sent: each tensor's own (``outputs``: memory)
    received: int  # its received gradients (kind ``activation_grad``): a split backward keeps them until W
    by_dtype: Mapping[torch.dtype, int]  # bytes of its gradient contributions by dtype (a flat bucket's each)
    sums: int  # memory of its gradient contributions (each tensor's; on CUDA its allocator block)
    seconds: float
    nodes: int
    collectives: CollectiveTotals  # the collectives it runs (ZeRO within stages: its update's, its gather's)
    summing: StagePart | None = None  # its twin adding its gradient contributions into their sums, where measured


def measure(
    gm: fx.GraphModule,
    name: str,
    ctx: PassContext,
    device: str,
    cost_model: CostModel,
    held: set[StorageWeakRef],
    crossing: Mapping[str, bool] | None = None,
    summing: bool = False,
) -> StagePart:
    """One stage graph lowered and measured; ``held``: the storages of the model state and the batch (a value
    living in one, a weight's transpose a forward saves, is no memory of its own); ``crossing``: whether each
    group its collectives run on, by name, crosses nodes; ``summing``: its summing twin measured too."""
    final = lower(gm, ctx, "eager", keep=False)[0][-1].gm
    part = _measured(final, name, device, cost_model, held, crossing)
    twin = summing_variant(final) if summing else None
    return (
        part
        if twin is None
        else dataclasses.replace(part, summing=_measured(twin, name, device, cost_model, held, crossing))
    )


def _measured(
    final: fx.GraphModule,
    name: str,
    device: str,
    cost_model: CostModel,
    held: set[StorageWeakRef],
    crossing: Mapping[str, bool] | None,
) -> StagePart:
    """``measure`` of a lowered graph."""
    kinds = CONSUMED.get(name.rsplit(".", 1)[-1], frozenset())  # the runner lets these go as the graph reads them
    consumed = [p for p in placeholders(final) if p.meta[INPUT].kind in kinds and storage_of(p.meta[VAL]) not in held]
    live = liveness(final, device, consumed=consumed)
    inputs = [(n.meta[INPUT].kind, n.meta[VAL]) for n in placeholders(final)]
    resident = sum(value_bytes(v, device) for kind, v in inputs if kind in RESIDENT or storage_of(v) in held)
    out = output_node(final)
    by_kind: dict[str, list] = defaultdict(list)
    for value, role in zip(out.args[0], out.meta[OUTPUTS]):
        by_kind[role.kind].append(value.meta.get(VAL) if isinstance(value, fx.Node) else value)
    by_dtype: dict[torch.dtype, int] = Counter()
    for value in by_kind.get("grad_contribution", []):
        by_dtype[value.dtype] += tensor_bytes(value)
    return StagePart(
        name=name,
        live=live,
        working=max(0, live.peak_bytes - resident),
        outputs={kind: _storage_bytes(values, device, held) for kind, values in by_kind.items()},
        counts={kind: len(values) for kind, values in by_kind.items()},
        sent={kind: tensor_bytes(values) for kind, values in by_kind.items()},
        received=_storage_bytes([v for kind, v in inputs if kind == "activation_grad"], device, held),
        by_dtype=dict(by_dtype),
        sums=sum(value_bytes(v, device) for v in by_kind.get("grad_contribution", [])),
        seconds=timeline(final, cost_model, crossing).total,
        nodes=len(final.graph.nodes),
        collectives=collective_totals(final, cost_model, crossing),
    )


def storage_of(value: object) -> StorageWeakRef | None:
    """The storage a tensor lives in (the same for its views), None for another value."""
    return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None


def value_bytes(value: object, device: str) -> int:
    """A tensor's bytes; on ``"cuda"``, its allocator block."""
    nbytes = tensor_bytes(value)
    return cuda_block_bytes(nbytes) if device == "cuda" else nbytes


def _storage_bytes(values: Sequence[object], device: str, held: set[StorageWeakRef]) -> int:
    """Bytes of the storages ``values`` live in, each once (a view saved beside its base counts once), but for
    those of ``held`` (model state and the batch: a forward may save its micro-batch, a view of the batch)."""
    seen = set(held)
    total = 0
    for value in values:
        if not isinstance(value, torch.Tensor):
            continue
        ref = StorageWeakRef(value.untyped_storage())
        if ref not in seen:
            seen.add(ref)
            nbytes = int(value.untyped_storage().nbytes())
            total += cuda_block_bytes(nbytes) if device == "cuda" else nbytes
    return total


@dataclass
class Walk:
    """A rank's peak from ``walk``: bytes, where, what is alive there; the most bytes it holds for backwards at
    once, and the most micro-batches in flight per stage."""

    peak: int = -1
    where: str = ""
    alive: tuple[tuple[str, int], ...] = ()
    activations: int = 0
    in_flight: Counter = field(default_factory=Counter)

    def at(self, nbytes: int, where: str, part: StagePart, held: Mapping[str, int]) -> None:
        if nbytes > self.peak:
            self.peak, self.where = nbytes, f"{where} ({part.name}, at node {part.live.peak_node})"
            alive = [*part.live.alive_at_peak, *((name, n) for name, n in held.items() if n)]
            self.alive = tuple(sorted(alive, key=lambda item: -item[1]))


def walk(
    place: int, schedule: Schedule, parts: list[dict[str, StagePart]], resident: int, regather: bool = False
) -> Walk:
    """Rank ``place``'s actions in order, then its updates (module docstring); ``resident``: its model state and
    the batch; ``regather``: a stage's parameters gathered before each of its actions and let go after it."""
    out = Walk()
    saved: dict[tuple[int, int], int] = {}  # by (stage, micro-batch): its saved values (and a split backward's)
    summed: set[int] = set()
    gathered: dict[int, int] = {}  # ZeRO stage 3: by stage, its whole parameters, from its gather to the updates
    label = _REGATHERED if regather else _GATHERED
    sent = 0
    for a in schedule.compute(place):
        part = parts[a.stage][PART_OF[a.kind]]
        part = part.summing if a.stage in summed and part.summing is not None else part
        others = sum(saved.values()) - saved.get((a.stage, a.mb), 0)
        sums = sum(stage_sums(parts[s]) for s in summed)
        held = {"saved values of other micro-batches": others, "gradient sums": sums, _SENT: sent}
        gather = parts[a.stage].get("gather")
        if gather is not None and a.stage not in gathered:
            held[label] = sum(gathered.values())
            out.at(resident + others + sums + sent + held[label] + gather.working, f"stage {a.stage}'s gather",
                   gather, held)  # fmt: skip
            gathered[a.stage] = gather.outputs.get("param", 0)
        held[label] = sum(gathered.values())
        where = f"{a}, its stages' parameters gathered whole" if held[label] else str(a)
        out.at(resident + others + sums + sent + held[label] + part.working, where, part, held)
        if regather:
            gathered.pop(a.stage, None)
        sent += _sent_by(a, schedule, parts)
        if a.kind is Kind.F:
            saved[a.stage, a.mb] = parts[a.stage]["forward"].outputs.get("saved", 0)
        elif a.kind is Kind.I:
            saved[a.stage, a.mb] += parts[a.stage]["input_grad"].outputs.get("partial", 0) + part.received
        else:
            saved.pop((a.stage, a.mb))
            summed.add(a.stage)
        out.activations = max(out.activations, sum(saved.values()))
        out.in_flight[a.stage] = max(out.in_flight[a.stage], sum(1 for s, _ in saved if s == a.stage))
    for s in range(place, schedule.stages, schedule.ranks):  # the updates, in stage order (``RankRunner.run``)
        summed.discard(s)
        part = parts[s]["update"]
        sums = sum(stage_sums(parts[x]) for x in summed)
        held = {"gradient sums of the rank's other stages": sums, _SENT: sent}
        out.at(resident + sums + sent + part.working, f"stage {s}'s update", part, held)
    return out


def stage_sums(stage: Mapping[str, StagePart]) -> int:
    """Bytes of a stage's gradient sums (its contributions summed over the micro-batches)."""
    return stage["backward"].sums


def _sent_by(a: Action, schedule: Schedule, parts: list[dict[str, StagePart]]) -> int:
    """Bytes action ``a`` hands to another rank: a forward's activations, a backward's (or I's) gradients."""
    if a.kind is Kind.F:
        to, kind = a.stage + 1, "activation"
    elif a.kind in (Kind.B, Kind.I):
        to, kind = a.stage - 1, "activation_grad"
    else:
        return 0
    if not 0 <= to < schedule.stages or schedule.rank_of(to) == schedule.rank_of(a.stage):
        return 0
    return parts[a.stage][PART_OF[a.kind]].outputs.get(kind, 0)
