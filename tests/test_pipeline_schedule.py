"""Pipeline schedules (issue 42, item 2): each rank's action list, the same compute order as torch's schedule of
that name, checked (no deadlock, sends match receives) and timed (the predicted bubble)."""

from __future__ import annotations

import dataclasses
import types

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from zgraph.runtime.pipeline_schedule import Action, Kind, build_schedule
from zgraph.runtime.pipeline_simulate import check_schedule, simulate

CASES = [
    ("gpipe", 2, 4, 1),
    ("gpipe", 4, 8, 1),
    ("1f1b", 2, 2, 1),
    ("1f1b", 2, 5, 1),
    ("1f1b", 4, 8, 1),
    ("1f1b", 4, 2, 1),
    ("interleaved_1f1b", 2, 4, 2),
    ("interleaved_1f1b", 4, 8, 2),
    ("interleaved_1f1b", 4, 4, 3),
    ("interleaved_1f1b", 2, 3, 2),
    ("zb_h1", 2, 4, 1),
    ("zb_h1", 4, 8, 1),
    ("zb_h1", 4, 3, 1),
]


def torch_order(name: str, ranks: int, microbatches: int, virtual: int) -> list[list[str]]:
    """Each rank's compute actions as torch.distributed.pipelining's schedule of that name orders them."""
    state = types.SimpleNamespace(
        _num_stages=ranks,
        _n_microbatches=microbatches,
        pp_group_size=ranks,
        n_local_stages=virtual,
        microbatches_per_round=microbatches // max(1, microbatches // ranks),
    )
    if name == "1f1b":
        return [one_f_one_b_as_torch_runs_it(ranks, microbatches, r) for r in range(ranks)]
    if name == "gpipe":
        order = torch_schedules.ScheduleGPipe._get_pipeline_order(state)
    else:
        cls = {"interleaved_1f1b": torch_schedules.ScheduleInterleaved1F1B}.get(
            name, torch_schedules.ScheduleInterleavedZeroBubble
        )
        order = {r: cls._calculate_single_rank_operations(state, r) for r in range(ranks)}
    compute = {"F", "B", "I", "W"}
    return [[str(a) for a in order[r] if a is not None and a.computation_type.value in compute] for r in range(ranks)]


def one_f_one_b_as_torch_runs_it(ranks: int, microbatches: int, rank: int) -> list[str]:
    """``Schedule1F1B._step_microbatches``'s order: ``min(M, P - rank)`` forwards, then a backward and a forward
    in turn. (``Schedule1F1B._get_pipeline_order``, used only to draw it, numbers some forwards wrong.)"""
    warmup = min(microbatches, ranks - rank)
    order = [f"{rank}F{mb}" for mb in range(warmup)]
    for mb in range(microbatches):
        order.append(f"{rank}B{mb}")
        if warmup + mb < microbatches:
            order.append(f"{rank}F{warmup + mb}")
    return order


@pytest.mark.parametrize("name,ranks,microbatches,virtual", CASES)
def test_the_compute_order_is_torchs(name, ranks, microbatches, virtual):
    schedule = build_schedule(name, ranks, microbatches, virtual)
    assert [[str(a) for a in schedule.compute(r)] for r in range(ranks)] == torch_order(
        name, ranks, microbatches, virtual
    )


@pytest.mark.parametrize("name,ranks,microbatches,virtual", CASES)
def test_schedules_check_and_torch_agrees(name, ranks, microbatches, virtual):
    schedule = build_schedule(name, ranks, microbatches, virtual)
    check_schedule(schedule)
    order = {r: [torch_schedules._Action.from_str(str(a)) for a in acts] for r, acts in enumerate(schedule.actions)}
    stages = schedule.stages
    torch_schedules._validate_schedule(order, ranks, stages, microbatches)
    torch_schedules._simulate_comms_compute(order, schedule.rank_of, stages)  # raises if it does not progress


def test_every_stage_output_is_sent_once_and_received_where_it_is_read():
    schedule = build_schedule("1f1b", 2, 3)
    assert str(schedule).splitlines() == [
        "1f1b: 2 ranks x 1 stages each, 3 micro-batches",
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2",
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2",
    ]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ranks,microbatches", [(2, 2), (2, 8), (4, 4), (4, 16)])
def test_gpipe_and_1f1b_bubble_is_the_closed_form(name, ranks, microbatches):
    bubble = simulate(build_schedule(name, ranks, microbatches)).bubble
    assert bubble == pytest.approx((ranks - 1) / (microbatches + ranks - 1))


def test_interleaving_and_zero_bubble_shrink_the_bubble():
    one_f_one_b = simulate(build_schedule("1f1b", 4, 8)).bubble
    # a virtual stage is half a rank's layers: half the time of 1F1B's stage
    half = {Kind.F: 0.5, Kind.B: 1.0}
    interleaved = simulate(build_schedule("interleaved_1f1b", 4, 8, 2), half)
    assert interleaved.bubble < one_f_one_b
    assert interleaved.step_time - 8 * 3 == pytest.approx(3 * 3 / 2), "bubble time (P - 1)(F + B) / v"
    zero_bubble = simulate(build_schedule("zb_h1", 4, 8))
    assert zero_bubble.step_time - 8 * 3 == pytest.approx(3 * 1), "ZB-H1's bubble time: (P - 1)(F + I - W)"
    assert zero_bubble.bubble < one_f_one_b


def test_the_timeline_draws_each_rank():
    lines = simulate(build_schedule("1f1b", 2, 2)).timeline().splitlines()
    assert lines == [
        "rank 0: 0F0 0F1 ... ... 0B0 0B0 ... 0B1 0B1",
        "rank 1: ... 1F0 1B0 1B0 1F1 1B1 1B1 ... ...",
    ]


def test_a_schedule_that_waits_in_a_circle_is_refused():
    good = build_schedule("1f1b", 2, 2)
    rank0 = list(good.actions[0])
    # rank 0 waits for micro-batch 0's gradient before it sends micro-batch 0's activation
    rank0[1], rank0[4] = rank0[4], rank0[1]
    with pytest.raises(ValueError, match=r"deadlocks: every rank waits \(rank 0: 0RECV_B0; rank 1: 1RECV_F0\)"):
        check_schedule(dataclasses.replace(good, actions=(tuple(rank0), good.actions[1])))


def test_broken_schedules_are_refused_naming_the_action():
    good = build_schedule("zb_h1", 2, 2)
    rank1 = list(good.actions[1])
    swapped = dataclasses.replace(good, actions=(good.actions[0], tuple(rank1[::-1])))
    with pytest.raises(ValueError, match="rank 1: 1W1 runs before 1I1"):
        check_schedule(swapped)
    dropped = dataclasses.replace(good, actions=(good.actions[0], tuple(a for a in rank1 if str(a) != "1SEND_B1")))
    with pytest.raises(ValueError, match="sends and receives do not match: 0RECV_B1"):
        check_schedule(dropped)
    extra = dataclasses.replace(good, actions=(good.actions[0] + (Action(0, Kind.F, 0),), good.actions[1]))
    with pytest.raises(ValueError, match="0F0 is computed twice"):
        check_schedule(extra)


@pytest.mark.parametrize(
    "args,message",
    [
        (("pipedream", 2, 4), "unknown pipeline schedule 'pipedream'; known: gpipe, 1f1b, interleaved_1f1b, zb_h1"),
        (("1f1b", 0, 4), "pipeline ranks must be a positive int; got 0"),
        (("1f1b", 2, 2.0), "pipeline microbatches must be a positive int; got 2.0"),
        (("1f1b", 2, 4, 2), "'1f1b' runs one stage per rank; 2 virtual stages need interleaved_1f1b"),
        (("interleaved_1f1b", 4, 9, 2), "rounds of 4 .4 ranks.: 9 micro-batches are not a multiple of 2 rounds"),
    ],
)
def test_bad_input_is_named(args, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)


def test_a_rank_lets_go_of_the_sends_its_peers_have_received():
    """After each action the runner drops the sends that completed (their errors raised), keeping only those still
    in flight: a rank holds what its peers have not received, not every micro-batch's until the step ends."""
    from zgraph.runtime.pipeline_run import RankRunner

    class Work:
        def __init__(self, done: bool, error: Exception | None = None):
            self.done, self.error, self.waited = done, error, False

        def is_completed(self) -> bool:
            return self.done

        def wait(self) -> None:
            self.waited = True
            if self.error is not None:
                raise self.error

    delivered, flying = Work(True), Work(False)
    runner = types.SimpleNamespace(sends=[(delivered, "a"), (flying, "b")])
    RankRunner._drop_delivered(runner)
    assert runner.sends == [(flying, "b")] and delivered.waited and not flying.waited
    runner.sends.append((Work(True, RuntimeError("peer 1 is gone")), "c"))
    with pytest.raises(RuntimeError, match="peer 1 is gone"):
        RankRunner._drop_delivered(runner)


def test_a_rank_posts_the_next_actions_receives_before_computing_and_waits_only_when_it_reads_them(monkeypatch):
    """``RankRunner`` (rank 1 of 1F1B, P=2, M=3; fake point-to-point calls, nothing sent): each compute action's
    receive is posted before the compute action before it runs, and waited for only after that one has run."""
    import torch

    from zgraph.graph import GraphInput, GraphOutput
    from zgraph.runtime import pipeline_run
    from zgraph.runtime.pipeline_run import Part, Peers, RankPlan, RankRunner, StageRun

    events: list[str] = []

    class Work:
        def __init__(self, name: str):
            self.name = name

        def wait(self) -> None:
            events.append(f"wait {self.name}")

        def is_completed(self) -> bool:
            return True

    def irecv(buffer, src, group, tag):
        events.append(f"post {tag}")
        return Work(str(tag))

    monkeypatch.setattr(pipeline_run.dist, "irecv", irecv)
    monkeypatch.setattr(pipeline_run.dist, "isend", lambda *args: Work("send"))
    one = torch.zeros(1)

    def part(name: str, reads: str, outputs: list[str]) -> Part:
        def run(inputs):
            events.append(name)
            return [one] * len(outputs)

        roles = [GraphOutput(kind, kind, 0) for kind in outputs]
        return Part(run, [GraphInput(reads, reads, 0)], roles, [one])

    stage = StageRun(
        1,
        part("F", "activation", ["saved"]),
        part("B", "saved", ["activation_grad"]),
        *(part(n, "saved", []) for n in ("I", "W", "update")),
    )
    schedule = build_schedule("1f1b", 2, 3)
    plan = RankPlan(schedule=schedule, rank=1, stages={1: stage}, peers=Peers(None, [0, 1]))
    runner = RankRunner(plan, lambda spec, mb: one, lambda counts: 1.0)
    runner.run()
    tags = [runner._tag("F", 0, mb, 0) for mb in range(3)]
    computes = [i for i, e in enumerate(events) if e in ("F", "B")]
    assert [events[i] for i in computes] == ["F", "B", "F", "B", "F", "B"]
    for mb in (1, 2):  # posted before the backward ahead of its forward, waited for after it
        forward = computes[2 * mb]
        posted, waited = events.index(f"post {tags[mb]}"), events.index(f"wait {tags[mb]}")
        assert posted < computes[2 * mb - 1] < waited < forward, events


def test_a_rank_sums_gradient_contributions_without_writing_what_a_graph_returned():
    """A micro-batch's gradient contribution may be what its graph read or sent on: the runner sums contributions
    into its own buffer (the second's sum, added into in place after that) and never writes the first one, unless
    the graph made it afresh (no input still alive or other output shares its memory), which it then sums into: an
    input a consuming graph let go during the call no longer counts, though what the graph made took its id."""
    import torch

    from zgraph.runtime.pipeline_run import RankRunner, _fresh, _roots

    received = torch.ones(3)
    made, view_of_made = torch.full((3,), 2.0), torch.zeros(3, 1)
    assert _fresh(_roots([received]), [received, made, view_of_made.view(3), view_of_made]) == {id(made)}
    consumed = [torch.zeros(3)]
    roots = _roots(consumed)
    consumed.clear()
    made_after = [torch.zeros(3) for _ in range(4)]  # CPython hands the let-go tensor's id to a new one
    assert _fresh(roots, made_after) == {id(t) for t in made_after}
    for first, owned in ((received, False), (made, True)):
        runner = types.SimpleNamespace(sums={}, owned=set(), fresh=_fresh(_roots([received]), [received, made]))
        before = first.clone()
        for value in (first, torch.full((3,), 3.0), torch.full((3,), 4.0)):
            RankRunner._accumulate(runner, (0, "g"), value)
        assert torch.equal(runner.sums[0, "g"], before + 7.0) and runner.owned == {(0, "g")}
        assert (runner.sums[0, "g"] is first) == owned and torch.equal(first, before + 7.0 if owned else before)


def test_unequal_stages_are_timed_at_each_ranks_costs():
    """``simulate(per_rank=...)``: a heavier last stage (the head and the loss) paces 1F1B: the step takes the
    first stage's first forward and last backward plus every micro-batch of the last stage."""
    light, heavy = {Kind.F: 1.0, Kind.B: 2.0}, {Kind.F: 1.5, Kind.B: 3.0}
    sim = simulate(build_schedule("1f1b", 2, 4), per_rank=[light, heavy])
    assert sim.step_time == pytest.approx(1.0 + 4 * 4.5 + 2.0)
    assert sim.bubble > simulate(build_schedule("1f1b", 2, 4)).bubble
    assert simulate(build_schedule("1f1b", 2, 4), per_rank=[light, light]).bubble == pytest.approx(1 / 5)
