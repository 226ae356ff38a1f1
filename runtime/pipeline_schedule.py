"""Pipeline-parallel schedules: for each rank of a pipeline, the ordered list of actions it runs in one step.

A pipeline of ``P`` ranks runs ``S = P * v`` stages (``v`` virtual stages per rank; stage ``s`` is on rank
``s % P``, the looped placement of interleaved 1F1B) over ``M`` micro-batches. An action is one of:

- ``F`` (forward), ``B`` (whole backward), ``I`` (backward to the stage's inputs only), ``W`` (backward to its
  weights only: zero-bubble schedules run it later, where the rank would otherwise wait) of one stage on one
  micro-batch;
- ``SEND_F`` / ``RECV_F``: a stage's output activation to the next stage's rank / a stage's input from the previous
  one; ``SEND_B`` / ``RECV_B``: the gradient of a stage's input to the previous stage's rank / the gradient of a
  stage's output from the next one. A send does not wait for its receive (``isend``); a receive is posted by
  then at the latest (``zgraph.runtime.pipeline_run`` posts it one compute action earlier) and waited for by the
  compute that reads it.

Actions print as ``torch.distributed.pipelining`` writes them (``2F0``: stage 2's forward of micro-batch 0;
``1SEND_F3``), and each rank's compute order is the one torch's schedule of that name computes (tests compare them).

Schedules (``SCHEDULES``): ``"gpipe"`` (every forward, then every backward), ``"1f1b"`` (one forward, one backward
in the steady state: at most ``P - rank`` micro-batches in flight), ``"interleaved_1f1b"`` (1F1B over ``v`` stages
per rank; Narayanan et al. 2021), ``"zb_h1"`` (1F1B with the backward split into ``I`` and ``W``, rank ``r``
deferring its ``W`` by ``r`` micro-batches into the cool-down's bubble; Qi et al. 2023, ZB-H1).
``zgraph.runtime.pipeline_simulate`` checks a schedule (no deadlock) and predicts its bubble.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Kind(enum.Enum):
    """What an action does; the value is how it prints."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (torch's name for the input-gradient half of a backward)
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


@dataclass(frozen=True, order=True)
class Action:
    """One action of one rank: ``kind`` of stage ``stage`` on micro-batch ``mb``."""

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"


@dataclass(frozen=True)
class Schedule:
    """A pipeline step's actions: ``actions[rank]`` is what ``rank`` runs, in order, communication included.

    Attributes:
        name: one of ``SCHEDULES``.
        ranks: ranks in the pipeline (``P``).
        virtual: stages per rank (``v``); stage ``s`` runs on rank ``s % ranks``.
        microbatches: micro-batches per step (``M``).
        actions: per rank, its actions in order.
    """

    name: str
    ranks: int
    virtual: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        """Stages in the pipeline (``ranks * virtual``)."""
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        return stage % self.ranks

    def compute(self, rank: int) -> list[Action]:
        """``rank``'s compute actions (F, B, I, W) in order."""
        return [a for a in self.actions[rank] if a.kind in COMPUTE]

    def __str__(self) -> str:
        head = f"{self.name}: {self.ranks} ranks x {self.virtual} stages each, {self.microbatches} micro-batches"
        rows = [f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)]
        return "\n".join([head, *rows])


def build_schedule(name: str, ranks: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule ``name`` for ``ranks`` ranks, ``microbatches`` micro-batches and ``virtual`` stages per rank
    (more than one only for ``"interleaved_1f1b"``). Bad input is a ``ValueError`` naming it."""
    _check(name, ranks, microbatches, virtual)
    orders = [_compute_order(name, ranks, microbatches, virtual, r) for r in range(ranks)]
    return Schedule(name, ranks, virtual, microbatches, _with_communication(orders, ranks, ranks * virtual))


def _check(name: str, ranks: int, microbatches: int, virtual: int) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    for what, value in (("ranks", ranks), ("microbatches", microbatches), ("virtual stages", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"pipeline {what} must be a positive int; got {value!r}")
    if virtual > 1 and name != "interleaved_1f1b":
        raise ValueError(f"schedule {name!r} runs one stage per rank; {virtual} virtual stages need interleaved_1f1b")
    rounds = max(1, microbatches // ranks)
    if name == "interleaved_1f1b" and microbatches % rounds:
        raise ValueError(
            f"interleaved_1f1b runs micro-batches in rounds of {microbatches // rounds} ({ranks} ranks): "
            f"{microbatches} micro-batches are not a multiple of {rounds} rounds"
        )


def _compute_order(name: str, ranks: int, microbatches: int, virtual: int, rank: int) -> list[Action]:
    """``rank``'s compute actions, in the order torch's schedule of the same name runs them."""
    if name == "gpipe":
        return [Action(rank, k, mb) for k in (Kind.F, Kind.B) for mb in range(microbatches)]
    total = microbatches * virtual
    if name == "interleaved_1f1b":  # torch's _get_warmup_ops: (v - 1) rounds, then two per hop to the last rank
        per_round = microbatches // max(1, microbatches // ranks)
        warmup = min((virtual - 1) * per_round + 2 * (ranks - 1 - rank), total)
    else:
        per_round, warmup = microbatches, min(ranks - 1 - rank, total)
    return _one_f_one_b(
        forward_stage=lambda k: (k // per_round % virtual) * ranks + rank,
        backward_stage=lambda k: (virtual - 1 - k // per_round % virtual) * ranks + rank,
        total=total,
        warmup=warmup,
        weight_delay=rank if name == "zb_h1" else None,
    )


def _one_f_one_b(
    forward_stage: Callable[[int], int],
    backward_stage: Callable[[int], int],
    total: int,
    warmup: int,
    weight_delay: int | None,
) -> list[Action]:
    """``warmup`` forwards, then a forward (while any is left) and a backward each, ``total`` of each in all; the
    k-th forward runs ``forward_stage(k)``, the k-th backward ``backward_stage(k)``, micro-batches in order per
    stage. ``weight_delay``: backwards are split into I and W, the k-th W runs after the (k + delay)-th I."""
    next_mb: dict[tuple[Kind, int], int] = {}

    def act(kind: Kind, stage: int) -> Action:
        mb = next_mb.get((kind, stage), 0)
        next_mb[kind, stage] = mb + 1
        return Action(stage, kind, mb)

    out = [act(Kind.F, forward_stage(k)) for k in range(warmup)]
    for k in range(total):
        if warmup + k < total:
            out.append(act(Kind.F, forward_stage(warmup + k)))
        out.append(act(Kind.B if weight_delay is None else Kind.I, backward_stage(k)))
        if weight_delay is not None and k >= weight_delay:
            out.append(act(Kind.W, backward_stage(k - weight_delay)))
    if weight_delay is not None:
        out += [act(Kind.W, backward_stage(k)) for k in range(max(0, total - weight_delay), total)]
    return out


def _with_communication(orders: list[list[Action]], ranks: int, stages: int) -> tuple[tuple[Action, ...], ...]:
    """Each compute order with its receives right before the compute that reads them and its sends right after
    the compute that makes them (none between two stages on the same rank)."""
    out = []
    for rank, order in enumerate(orders):
        actions: list[Action] = []
        for a in order:
            recv = _neighbour(a, stages, forward=a.kind is Kind.F, sending=False)
            if recv is not None and recv % ranks != rank:
                actions.append(Action(a.stage, Kind.RECV_F if a.kind is Kind.F else Kind.RECV_B, a.mb))
            actions.append(a)
            send = _neighbour(a, stages, forward=a.kind is Kind.F, sending=True)
            if send is not None and send % ranks != rank:
                actions.append(Action(a.stage, Kind.SEND_F if a.kind is Kind.F else Kind.SEND_B, a.mb))
        out.append(tuple(actions))
    return tuple(out)


def _neighbour(a: Action, stages: int, *, forward: bool, sending: bool) -> int | None:
    """The stage ``a`` sends to (``sending``) or receives from, None if none (W moves nothing between stages)."""
    if a.kind is Kind.W:
        return None
    step = 1 if forward == sending else -1
    other = a.stage + step
    return other if 0 <= other < stages else None
