"""One rank's part of a pipeline-parallel step: its actions (``zgraph.runtime.pipeline_schedule``) run in order.

Each stage the rank holds is a ``StageRun``: its five graphs, compiled (``Part``: forward, backward, input_grad,
weight_grad, update; see ``zgraph.passes.stage_graphs`` for what each reads and returns). A forward's activations go
to the next stage, a backward's input gradients to the previous one: kept in the rank when that stage is its own,
else sent (``isend``: the rank goes on computing while it travels; every send is waited for at the end of the step;
one that has completed is let go after each action, its buffer held until then) and received (``irecv`` of a buffer
shaped as the graph's input). Receives are posted as early as the schedule allows, as torch.distributed.pipelining's
schedules post theirs: before a compute action runs, the receives of the next compute action are posted too, so
their data travels while this one computes; a receive is waited for only by the action that reads it. Each message
is tagged with its stage, micro-batch and position, so sends and receives between two ranks pair up whatever order
the ranks' schedules run them in.

Gradient contributions are summed per gradient marker over the micro-batches, in place into the rank's own buffer
(the first contribution where its graph made it afresh, else the second's sum); the update runs once, after the last
action, on their sum divided by ``divisor(counts)`` (``zgraph.compile.pipeline_call``: what the seeds' shares of
the batch leave, or, without shares, the micro-batch count for a mean over samples, 1 for a sum, the whole batch's
counted tokens for a token mean, each micro-batch's count being a result of the stage that makes the loss). With
``D`` pipelines the sums are all-reduced over each
stage's data-parallel group first (one flat bucket per stage); or, where the update graphs reduce them themselves
(``update_reduces``: ZeRO stage >= 1, ``zgraph.passes.stage_grads``), each rank's sums are divided by
``divisor(counts) / D`` and the update averages them over the ``D`` pipelines. What a graph reads of the step's
state and arguments comes from ``feed(spec, micro_batch)`` (micro_batch None for the update). At ZeRO stage 3 a
stage's parameters are gathered whole once per step, right before its first action (``StageRun.gather``), and
kept across the micro-batches until the updates, which read and write the shards. A value across stages (a global
gradient norm, an overflow check: ``zgraph.passes.stage_totals``) is combined before the updates: each stage's
``totals`` part makes its partial, the rank's are combined and all-reduced over the pipeline (every rank, every
total, in one order), and each update reads the total.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from zgraph.graph import GraphInput, GraphOutput
from zgraph.runtime.pipeline_schedule import COMPUTE, Action, Kind, Schedule

Feed = Callable[[GraphInput, int | None], Tensor]
PART_OF = {Kind.F: "forward", Kind.B: "backward", Kind.I: "input_grad", Kind.W: "weight_grad"}
"""The stage graph each compute action runs."""
Divisor = Callable[[dict[int, Tensor]], Tensor | float]
Shape = Callable[[Sequence], tuple[int, ...]]
_TAG_SPAN = 1 << 12  # tensors one boundary may carry: a message's tag numbers its position below this
CONSUMED: dict[str, frozenset[str]] = {
    "forward": frozenset({"activation"}),
    "backward": frozenset({"saved", "activation_grad"}),
    "weight_grad": frozenset({"saved", "activation_grad", "partial"}),
}
"""The inputs of a stage graph the runner holds nowhere else once it runs it (by graph, then input kind): an eager
graph lets each go after its last use (``input_grad``'s stay: its ``weight_grad`` reads them)."""


@dataclass
class Part:
    """One compiled stage graph: ``run(inputs) -> outputs`` (on the eager backend, that of a graph ``CONSUMED``
    names empties the list ``inputs`` as it reads them: each input goes after its last use), what each input and
    output is, the inputs' example values (shapes and dtypes of what is received), the outputs that are their own
    input updated in place, the time it took to compile, and the backend that compiled it."""

    run: Callable[[Sequence[Tensor]], Sequence]
    inputs: list[GraphInput]
    outputs: list[GraphOutput]
    examples: list[Tensor]
    updated_inputs: frozenset[int] = frozenset()
    compile_seconds: float = 0.0
    backend: str = "eager"

    def received(self, kind: str) -> list[Tensor]:
        """The example values of the inputs of ``kind``, by index."""
        pairs = sorted((s.index, e) for s, e in zip(self.inputs, self.examples) if s.kind == kind)
        return [e for _, e in pairs]


@dataclass
class StageRun:
    """A stage this rank runs: its compiled graphs."""

    stage: int
    forward: Part
    backward: Part
    input_grad: Part
    weight_grad: Part
    update: Part
    gather: Part | None = None  # ZeRO stage 3: the stage's parameter shards all-gathered (``stage_gather``)
    totals: Part | None = None  # what the stage's partials of values across stages need, run before ``update``
    summing: dict[str, Part] = field(default_factory=dict)
    """Eager backend: the twins of the graphs returning gradient contributions that add them into their sums
    instead, by graph name (``zgraph.runtime.sum_in_graph``): run once every sum they add into exists."""


@dataclass
class Results:
    """What a step's actions left on this rank: ``user[(stage, index)]``, each micro-batch's value of the step's
    result ``index`` (made by ``stage``); ``updates[stage]``, the update's inputs and outputs (``StageRun.update``
    says what each is); ``counts[mb]``, a token mean's count of each micro-batch (where this rank's stage makes it);
    ``divisor``, what the gradients summed over micro-batches were divided by."""

    user: dict[tuple[int, int], dict[int, Tensor]] = field(default_factory=dict)
    updates: dict[int, tuple[list[Tensor], list]] = field(default_factory=dict)
    counts: dict[int, Tensor] = field(default_factory=dict)
    divisor: Tensor | float = 1.0


@dataclass
class Peers:
    """The pipeline's process group (its chain, ``zgraph.runtime.pipeline_groups``) and each of its ranks' global
    rank; with several chains, the group of the ranks running the same stages in each (``data``, their global
    ``data_ranks``), their count (``pipelines``: with sequence parallelism, pipelines x ``sequence`` slices) and the
    dtype gradients are reduced over it in (``Config.reduce_dtype``; None: their own); ``first``: the first chain's
    global ranks (those that write each stage's state to a checkpoint)."""

    group: dist.ProcessGroup | None
    ranks: list[int]
    data: dist.ProcessGroup | None = None
    pipelines: int = 1
    data_ranks: tuple[int, ...] = ()
    reduce_dtype: torch.dtype | None = None
    first: list[int] = field(default_factory=list)
    sequence: int = 1


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """What one rank of a pipeline runs each step (``zgraph.compile.pipeline_call`` makes it from the compiled
    variant)."""

    schedule: Schedule
    """Every rank's actions."""
    rank: int
    """This rank's place in its pipeline (``schedule.actions[rank]``)."""
    stages: dict[int, StageRun]
    """The stages this rank runs, compiled."""
    peers: Peers
    """The pipeline's process groups."""
    update_reduces: bool = False
    """The update graphs reduce the gradient sums over the pipelines themselves (ZeRO stage >= 1)."""
    totals: tuple[tuple[GraphInput, Tensor], ...] = ()
    """The values across stages (``zgraph.passes.stage_totals``), in the order every rank combines them, with an
    example of each."""
    regather: bool = False
    """ZeRO 3: gather a stage's parameters for each of its actions (``Config.pipeline_regather``)."""


class RankRunner:
    """Runs one rank's actions of one step (a new runner per step): ``plan``'s, reading the state and the
    micro-batches through ``feed``; the gradient sums divided by ``divisor(counts)``; what it receives shaped as
    ``shape`` makes the graphs' example shapes at the call's sizes."""

    def __init__(self, plan: RankPlan, feed: Feed, divisor: Divisor, shape: Shape = tuple):
        self.schedule, self.rank, self.stages, self.peers = plan.schedule, plan.rank, plan.stages, plan.peers
        self.feed, self.divisor, self.update_reduces = feed, divisor, plan.update_reduces
        self.shape = shape  # an example's shape at this call's sizes (captured with symbolic sizes)
        self.totals, self.regather = plan.totals, plan.regather
        self.grad_means: dict[tuple[int, str], Tensor] = {}
        self.handed: dict[int, list[Tensor]] = {}
        self.scale: Tensor | float = 1.0  # what the summed gradients the update reads are divided by
        self.inbox: dict[tuple[str, int, int], list[Tensor]] = {}  # from this rank's own stages
        self.posted: dict[tuple[str, int, int], tuple[list[Tensor], list[dist.Work]]] = {}  # receives in flight
        self.outbox: dict[tuple[str, int, int], list[Tensor]] = {}
        self.saved: dict[tuple[int, int], list[Tensor]] = {}
        self.kept: dict[tuple[int, int], list[Tensor]] = {}  # a split backward's gradients, until its W
        self.partial: dict[tuple[int, int], list[Tensor]] = {}
        self.sums: dict[tuple[int, str], Tensor] = {}  # by stage and gradient marker
        self.owned: set[tuple[int, str]] = set()  # the sums in the rank's own buffers (added into in place)
        self.fresh: set[int] = set()  # the last graph call's outputs sharing memory with nothing else (by id)
        self.sends: list[tuple[dist.Work, Tensor]] = []
        self.wholes: dict[int, Tensor] = {}  # ZeRO stage 3: gathered parameters, by index, until the updates
        self.gathered: set[int] = set()
        self.results = Results()

    def run(self) -> Results:
        """Every action of this rank, then the sends waited for and each stage's update."""
        handlers = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.I: self._input_grad,
            Kind.W: self._weight_grad,
            Kind.SEND_F: self._send,
            Kind.SEND_B: self._send,
            Kind.RECV_F: self._receive,
            Kind.RECV_B: self._receive,
        }
        actions = self.schedule.actions[self.rank]
        for i, action in enumerate(actions):
            if action.kind in COMPUTE:
                self._gather(action.stage)
                self._post_next_receives(actions[i + 1 :])
                self._arrived(action)
            handlers[action.kind](action)
            if self.regather and action.kind in COMPUTE:
                self._let_go(action.stage)
            self._drop_delivered()
        for work, _ in self.sends:
            work.wait()
        self.wholes.clear()  # the updates read and write the shards
        self.results.divisor = self.scale = self.divisor(self.results.counts)
        if self.peers.data is not None and self.update_reduces:
            self.scale = self.scale / self.peers.pipelines  # the update averages each gradient over the pipelines
        elif self.peers.data is not None:
            self._reduce_over_pipelines()
        totals = self._stage_totals()
        for s, stage in sorted(self.stages.items()):
            self.results.updates[s] = self._update(s, stage.update, totals)
        return self.results

    def _gather(self, s: int) -> None:
        """Before stage ``s``'s first action of the step, its gather (ZeRO stage 3): the whole parameters, kept
        for every micro-batch's graphs until the updates; with ``regather``, before each of its actions."""
        part = self.stages[s].gather
        if s in self.gathered or part is None:
            return
        self.gathered.add(s)
        outputs = part.run([self.feed(spec, None) for spec in part.inputs])
        self.wholes.update((role.index, value) for role, value in zip(part.outputs, outputs))

    def _let_go(self, s: int) -> None:
        """After an action of stage ``s`` (``regather``): its whole parameters go, gathered again for its next."""
        part = self.stages[s].gather
        if part is not None:
            self.gathered.discard(s)
            for role in part.outputs:
                self.wholes.pop(role.index, None)

    def _call(self, part: Part, a: Action, given: dict[str, list[Tensor]]) -> list[tuple[GraphOutput, Tensor]]:
        """Run ``part`` for ``a`` on what it is ``given`` (by input kind) and reads of the state; its summing twin
        instead where the stage has one and every sum it adds into exists. The lists of the kinds ``CONSUMED``
        names are the rank's only hold on them: emptied, so that each tensor goes once the graph has read it for
        the last time (an eager graph empties its input list as it reads it)."""
        twin = self.stages[a.stage].summing.get(PART_OF[a.kind])
        if twin is not None and all((a.stage, s.name) in self.sums for s in twin.inputs if s.kind == "grad_sum"):
            part, given = twin, {**given, "grad_sum": self._owned_sums(a.stage, twin)}
        inputs = [given[s.kind][s.index] if s.kind in given else self._read(s, a.mb) for s in part.inputs]
        first = any(r.kind == "grad_contribution" and (a.stage, r.name) not in self.sums for r in part.outputs)
        roots = _roots(inputs) if first else None  # a first contribution's sum may be the contribution itself
        for kind in CONSUMED.get(PART_OF[a.kind], ()):
            given.get(kind, []).clear()
        outputs = part.run(inputs)
        self.fresh = set() if roots is None else _fresh(roots, outputs)
        return list(zip(part.outputs, outputs))

    def _owned_sums(self, stage: int, twin: Part) -> list[Tensor]:
        """The sums ``twin`` adds into, by its ``grad_sum`` inputs' order, each made the rank's own buffer first
        (a copy of a first contribution that shares memory with something else)."""
        keys = [
            (stage, s.name) for s in sorted((s for s in twin.inputs if s.kind == "grad_sum"), key=lambda s: s.index)
        ]
        for key in keys:
            if key not in self.owned:
                self.sums[key] = self.sums[key].clone()
                self.owned.add(key)
        return [self.sums[key] for key in keys]

    def _read(self, spec: GraphInput, mb: int) -> Tensor:
        whole = spec.kind == "param" and spec.layout == "full"
        return self.wholes[spec.index] if whole and spec.index in self.wholes else self.feed(spec, mb)

    def _forward(self, a: Action) -> None:
        part = self.stages[a.stage].forward
        received = self.inbox.pop(("F", a.stage, a.mb), [])
        outs = self._call(part, a, {"activation": received})
        self._hand_on("F", a, [v for role, v in outs if role.kind == "activation"])
        self.saved[a.stage, a.mb] = [v for role, v in outs if role.kind == "saved"]
        self._collect(a, outs)

    def _backward(self, a: Action) -> None:
        given = {"saved": self.saved.pop((a.stage, a.mb)), "activation_grad": self.inbox.pop(("B", a.stage, a.mb), [])}
        outs = self._call(self.stages[a.stage].backward, a, given)
        self._hand_on("B", a, [v for role, v in outs if role.kind == "activation_grad"])
        self._collect(a, outs)

    def _input_grad(self, a: Action) -> None:
        grads = self.inbox.pop(("B", a.stage, a.mb), [])
        self.kept[a.stage, a.mb] = grads
        given = {"saved": self.saved[a.stage, a.mb], "activation_grad": grads}
        outs = self._call(self.stages[a.stage].input_grad, a, given)
        self._hand_on("B", a, [v for role, v in outs if role.kind == "activation_grad"])
        self.partial[a.stage, a.mb] = [v for role, v in outs if role.kind == "partial"]
        self._collect(a, outs)

    def _weight_grad(self, a: Action) -> None:
        key = (a.stage, a.mb)
        given = {"saved": self.saved.pop(key), "activation_grad": self.kept.pop(key), "partial": self.partial.pop(key)}
        self._collect(a, self._call(self.stages[a.stage].weight_grad, a, given))

    def _collect(self, a: Action, outs: list[tuple[GraphOutput, Tensor]]) -> None:
        """Sum gradient contributions; keep each micro-batch's results."""
        for role, value in outs:
            if role.kind == "grad_contribution":
                self._accumulate((a.stage, role.name), value)
            elif role.kind == "loss_count":
                self.results.counts[a.mb] = value
            elif role.kind == "user":
                self.results.user.setdefault((a.stage, role.index), {})[a.mb] = value

    def _accumulate(self, key: tuple[int, str], value: Tensor) -> None:
        """Add a micro-batch's contribution to ``key``'s sum, into the rank's own buffer: the first contribution
        itself where the graph made it afresh (``self.fresh``), else (it may be what the graph read or sent on:
        never written) the second's sum, made out of place; the rest are added into it in place."""
        if key not in self.sums:
            self.sums[key] = value
            if id(value) in self.fresh:
                self.owned.add(key)
        elif key in self.owned:
            self.sums[key].add_(value)
        else:
            self.sums[key] = self.sums[key] + value
            self.owned.add(key)

    def _hand_on(self, direction: str, a: Action, values: list[Tensor]) -> None:
        """A forward's activations to the next stage, a backward's gradients to the previous one."""
        to = a.stage + 1 if direction == "F" else a.stage - 1
        if not 0 <= to < self.schedule.stages:
            return
        if self.schedule.rank_of(to) == self.rank:
            self.inbox[direction, to, a.mb] = values
        else:
            self.outbox[direction, a.stage, a.mb] = values

    def _drop_delivered(self) -> None:
        """Let go of the sends that have completed (their errors raised), so a rank holds only what its peers have
        not received yet rather than every micro-batch's until the step ends."""
        pending = []
        for work, value in self.sends:
            if work.is_completed():
                work.wait()
            else:
                pending.append((work, value))
        self.sends = pending

    def _send(self, a: Action) -> None:
        direction = "F" if a.kind is Kind.SEND_F else "B"
        to = a.stage + 1 if direction == "F" else a.stage - 1
        values = self.outbox.pop((direction, a.stage, a.mb))
        assert len(values) < _TAG_SPAN, f"{len(values)} tensors cross stage {a.stage}'s boundary"
        for i, value in enumerate(values):
            value = value.contiguous()
            dst = self.peers.ranks[self.schedule.rank_of(to)]
            self.sends.append((dist.isend(value, dst, self.peers.group, self._tag(direction, a.stage, a.mb, i)), value))

    def _post_next_receives(self, rest: Sequence[Action]) -> None:
        """Before a compute action: the receives of the next one (those up to it in ``rest``) posted now."""
        for a in rest:
            if a.kind in COMPUTE:
                return
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                self._receive(a)

    def _receive(self, a: Action) -> None:
        """Post the receive of ``a`` (once: it may have been posted ahead); waited for by ``_arrived``."""
        direction = "F" if a.kind is Kind.RECV_F else "B"
        if (direction, a.stage, a.mb) in self.posted:
            return
        source = a.stage - 1 if direction == "F" else a.stage + 1
        stage = self.stages[a.stage]
        examples = (
            stage.forward.received("activation") if direction == "F" else stage.backward.received("activation_grad")
        )
        buffers = [torch.empty(self.shape(e.shape), dtype=e.dtype, device=e.device) for e in examples]
        src = self.peers.ranks[self.schedule.rank_of(source)]
        works = [
            dist.irecv(b, src, self.peers.group, self._tag(direction, source, a.mb, i)) for i, b in enumerate(buffers)
        ]
        self.posted[direction, a.stage, a.mb] = (buffers, works)

    def _arrived(self, a: Action) -> None:
        """Compute action ``a``'s receive, if it has one, waited for now that ``a`` reads it (into the inbox)."""
        key = ("F" if a.kind is Kind.F else "B", a.stage, a.mb)
        if key in self.posted:
            buffers, works = self.posted.pop(key)
            for work in works:
                work.wait()
            self.inbox[key] = buffers

    def _tag(self, direction: str, stage: int, mb: int, index: int) -> int:
        """A message's tag: unique per direction, sending stage, micro-batch and position in the boundary."""
        key = (stage * self.schedule.microbatches + mb) * 2 + (direction == "B")
        return key * _TAG_SPAN + index

    def _reduce_over_pipelines(self) -> None:
        """Each stage's gradient sums over the micro-batches summed over the pipelines: one all-reduce per stage
        (a flat bucket per dtype, sent in the reduce dtype where one is set), whatever the micro-batch count."""
        for s in sorted(self.stages):
            keys = sorted(k for k in self.sums if k[0] == s)
            for dtype in sorted({self.sums[k].dtype for k in keys}, key=str):
                bucket = [k for k in keys if self.sums[k].dtype == dtype]
                flat = torch.cat([self.sums[k].reshape(-1) for k in bucket])
                wire = flat if self.peers.reduce_dtype in (None, dtype) else flat.to(self.peers.reduce_dtype)
                dist.all_reduce(wire, group=self.peers.data)
                flat = wire.to(dtype)
                for k, value in zip(bucket, flat.split([self.sums[k].numel() for k in bucket])):
                    self.sums[k] = value.view_as(self.sums[k])
                    self.owned.add(k)  # a view of the rank's own flat bucket

    def _update(self, s: int, part: Part, totals: dict[str, Tensor]) -> tuple[list[Tensor], list]:
        """The stage's update on the mean over micro-batches of each parameter's gradient contributions."""
        inputs = []
        for spec in part.inputs:
            if spec.kind == "grad_mean":
                key = (s, spec.name)
                if key not in self.grad_means:
                    total = self.sums.pop(key)
                    self.grad_means[key] = self._divided(key, total)
                inputs.append(self.grad_means[key])
            elif spec.kind == "stage_total":
                inputs.append(totals[spec.name])
            elif spec.kind == "handed":
                inputs.append(self.handed[s][spec.index])
            else:
                inputs.append(self.feed(spec, None))
        return inputs, list(part.run(inputs))

    def _divided(self, key: tuple[int, str], total: Tensor) -> Tensor:
        """A gradient's sum over the micro-batches divided by ``self.scale``: in place in the rank's own buffer,
        not at all by 1."""
        if isinstance(self.scale, float) and self.scale == 1.0:
            return total
        return total.div_(self.scale) if key in self.owned else total / self.scale

    def _stage_totals(self) -> dict[str, Tensor]:
        """Each value across stages (``zgraph.passes.stage_totals``: a global gradient norm's sum of powers, an
        overflow flag): the partials of this rank's stages combined, then over the pipeline (one all-reduce each,
        on every rank, in the order of ``self.totals``). What a stage's first part hands its update is kept."""
        partials: dict[str, list[Tensor]] = {}
        for s, stage in sorted(self.stages.items()):
            if stage.totals is None:
                continue
            _, outputs = self._update(s, stage.totals, {})
            for role, value in zip(stage.totals.outputs, outputs):
                if role.kind == "stage_partial":
                    partials.setdefault(role.name, []).append(value)
            handed = sorted((r.index, v) for r, v in zip(stage.totals.outputs, outputs) if r.kind == "handed")
            self.handed[s] = [v for _, v in handed]
        totals = {}
        for spec, example in self.totals:
            zero = torch.zeros(self.shape(example.shape), dtype=example.dtype, device=example.device)
            values = partials.get(spec.name) or [zero]
            total = torch.stack(values).amax(0) if spec.field == "max" else torch.stack(values).sum(0)
            if len(self.peers.ranks) > 1:
                op = dist.ReduceOp.MAX if spec.field == "max" else dist.ReduceOp.SUM
                dist.all_reduce(total, op=op, group=self.peers.group)
            totals[spec.name] = total
        return totals


def _roots(inputs: Sequence[object]) -> dict[int, weakref.ref]:
    """The tensors ``inputs`` are, or are views of: weak references by id (an input a consuming graph lets go during
    the call then no longer counts, though a tensor it makes may take its id)."""
    return {id(b): weakref.ref(b) for b in map(_base, inputs) if isinstance(b, Tensor)}


def _fresh(inputs: dict[int, weakref.ref], outputs: Sequence[object]) -> set[int]:
    """The ids of the tensors of ``outputs`` whose memory no input still alive (``inputs``: ``_roots`` of the
    graph's inputs, taken before the call) and no other output shares (by the tensor a view is of): a graph made
    them afresh, so they may be written."""
    bases = Counter(id(_base(v)) for v in outputs if isinstance(v, Tensor))
    fresh = set()
    for v in outputs:
        base = _base(v)
        held = inputs.get(id(base))
        if isinstance(v, Tensor) and bases[id(base)] == 1 and (held is None or held() is not base):
            fresh.add(id(v))
    return fresh


def _base(value: object) -> object:
    return value._base if isinstance(value, Tensor) and value._base is not None else value
