"""A pipeline schedule checked and timed: every rank's actions run in order on a model of the ranks.

``check_schedule`` raises ``ValueError`` naming the first thing wrong: a stage's micro-batch computed twice or
never, a backward before its forward (or a W before its I), a send with no matching receive, or a deadlock (the
ranks run their lists with sends that do not wait and receives that wait for their send, and get stuck).

``simulate`` times the schedule with a cost per compute kind (communication free, as a lower bound): each action
starts when its rank is free and its inputs are there. Its ``bubble`` is the share of rank-time spent waiting:
``(P - 1) / (M + P - 1)`` for GPipe and 1F1B with equal stages; ``timeline()`` draws it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from zgraph.runtime.pipeline_schedule import COMPUTE, Action, Kind, Schedule

UNIT_COSTS = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.0, Kind.W: 1.0}
"""A backward costs two forwards, split evenly between its input and weight gradients."""

_MATCH = {Kind.SEND_F: (Kind.RECV_F, 1), Kind.SEND_B: (Kind.RECV_B, -1)}


@dataclass(frozen=True)
class Simulation:
    """A schedule's predicted run: per rank, each compute action's ``(start, end, action)``; ``step_time`` the
    last end; ``bubble`` the share of ``ranks * step_time`` no rank computes in."""

    spans: tuple[tuple[tuple[float, float, Action], ...], ...]
    step_time: float
    bubble: float

    def timeline(self, unit: float = 1.0) -> str:
        """One row per rank, one column per ``unit`` of time: the action computing then, ``.`` idle."""
        columns = round(self.step_time / unit)
        width = max((len(str(a)) for row in self.spans for *_, a in row), default=1)
        lines = []
        for rank, row in enumerate(self.spans):
            cells = ["." * width] * columns
            for start, end, a in row:
                for c in range(round(start / unit), round(end / unit)):
                    cells[c] = str(a).ljust(width)
            lines.append(f"rank {rank}: " + " ".join(cells))
        return "\n".join(lines)


def check_schedule(schedule: Schedule) -> None:
    """Raise ``ValueError`` if ``schedule`` computes something twice or never, out of order, sends what nobody
    receives, or deadlocks."""
    for rank in range(schedule.ranks):
        _check_rank(schedule, rank)
    sends = Counter(_matching_recv(a, schedule) for acts in schedule.actions for a in acts if a.kind in _MATCH)
    recvs = Counter(
        (schedule.rank_of(a.stage), a)
        for acts in schedule.actions
        for a in acts
        if a.kind in (Kind.RECV_F, Kind.RECV_B)
    )
    if sends != recvs:
        unmatched = sorted(str(a) for _, a in (sends - recvs) + (recvs - sends))
        raise ValueError(f"{schedule.name}: sends and receives do not match: {', '.join(unmatched)}")
    simulate(schedule)


def _check_rank(schedule: Schedule, rank: int) -> None:
    done: set[Action] = set()
    for a in schedule.compute(rank):
        where = f"{schedule.name}, rank {rank}: {a}"
        if schedule.rank_of(a.stage) != rank:
            raise ValueError(f"{where} is stage {a.stage}, which runs on rank {schedule.rank_of(a.stage)}")
        if a in done:
            raise ValueError(f"{where} is computed twice")
        before = {Kind.B: Kind.F, Kind.I: Kind.F, Kind.W: Kind.I}.get(a.kind)
        if before is not None and Action(a.stage, before, a.mb) not in done:
            raise ValueError(f"{where} runs before {Action(a.stage, before, a.mb)}")
        done.add(a)
    for stage in range(rank, schedule.stages, schedule.ranks):
        for mb in range(schedule.microbatches):
            backward = {Action(stage, k, mb) for k in (Kind.B, Kind.I, Kind.W)} & done
            if Action(stage, Kind.F, mb) not in done or {a.kind for a in backward} not in ({Kind.B}, {Kind.I, Kind.W}):
                raise ValueError(f"{schedule.name}, rank {rank}: stage {stage}, micro-batch {mb} is not run once")


def _matching_recv(send: Action, schedule: Schedule) -> tuple[int, Action]:
    kind, step = _MATCH[send.kind]
    return schedule.rank_of(send.stage + step), Action(send.stage + step, kind, send.mb)


def simulate(
    schedule: Schedule, costs: dict[Kind, float] | None = None, per_rank: Sequence[dict[Kind, float]] | None = None
) -> Simulation:
    """Run ``schedule`` on the model above with ``costs`` per compute kind (``UNIT_COSTS``), or each rank's own
    (``per_rank``: unequal stages, e.g. the times a run measured); a ``ValueError`` naming each rank's stuck
    action if it deadlocks."""
    every = [UNIT_COSTS if costs is None else costs] * schedule.ranks if per_rank is None else list(per_rank)
    position = [0] * schedule.ranks
    free = [0.0] * schedule.ranks
    finished: dict[Action, float] = {}  # compute actions and sends, by when their data is there
    spans: list[list[tuple[float, float, Action]]] = [[] for _ in range(schedule.ranks)]
    while True:
        moved = False
        for rank, acts in enumerate(schedule.actions):
            while position[rank] < len(acts):
                a = acts[position[rank]]
                ready = _ready_at(a, schedule, finished)
                if ready is None:
                    break
                start = max(free[rank], ready)
                end = start + every[rank][a.kind] if a.kind in COMPUTE else start
                if a.kind in COMPUTE:
                    spans[rank].append((start, end, a))
                finished[a] = free[rank] = end
                position[rank] += 1
                moved = True
        if not moved:
            break
    stuck = [f"rank {r}: {acts[position[r]]}" for r, acts in enumerate(schedule.actions) if position[r] < len(acts)]
    if stuck:
        raise ValueError(f"{schedule.name} deadlocks: every rank waits ({'; '.join(stuck)})")
    step_time = max(free, default=0.0)
    busy = sum(end - start for row in spans for start, end, _ in row)
    bubble = 1.0 - busy / (schedule.ranks * step_time) if step_time else 0.0
    return Simulation(tuple(tuple(row) for row in spans), step_time, bubble)


def _ready_at(a: Action, schedule: Schedule, finished: dict[Action, float]) -> float | None:
    """When ``a``'s inputs are there, None if not yet: a receive waits for its send; a compute for the compute
    on its own rank it reads (a stage's own forward, the neighbouring stage on the same rank)."""
    needs = _inputs(a, schedule)
    if any(n not in finished for n in needs):
        return None
    return max((finished[n] for n in needs), default=0.0)


def _inputs(a: Action, schedule: Schedule) -> list[Action]:
    if a.kind is Kind.RECV_F:
        return [Action(a.stage - 1, Kind.SEND_F, a.mb)]
    if a.kind is Kind.RECV_B:
        return [Action(a.stage + 1, Kind.SEND_B, a.mb)]
    if a.kind is Kind.SEND_F:
        return [Action(a.stage, Kind.F, a.mb)]
    if a.kind is Kind.SEND_B:
        return [_backward_done(a.stage, a.mb, schedule)]
    if a.kind is Kind.W:
        return [Action(a.stage, Kind.I, a.mb)]
    if a.kind is Kind.F:
        return [] if a.stage == 0 else [_forward_input(a, schedule)]
    own = Action(a.stage, Kind.F, a.mb)
    if a.stage == schedule.stages - 1:
        return [own]
    if schedule.rank_of(a.stage + 1) == schedule.rank_of(a.stage):
        return [own, _backward_done(a.stage + 1, a.mb, schedule)]
    return [own, Action(a.stage, Kind.RECV_B, a.mb)]


def _forward_input(a: Action, schedule: Schedule) -> Action:
    if schedule.rank_of(a.stage - 1) == schedule.rank_of(a.stage):
        return Action(a.stage - 1, Kind.F, a.mb)
    return Action(a.stage, Kind.RECV_F, a.mb)


def _backward_done(stage: int, mb: int, schedule: Schedule) -> Action:
    """The action after which ``stage``'s input gradient for ``mb`` exists: its B, or its I."""
    kinds = {a.kind for a in schedule.compute(schedule.rank_of(stage)) if a.stage == stage and a.mb == mb}
    return Action(stage, Kind.I if Kind.I in kinds else Kind.B, mb)
