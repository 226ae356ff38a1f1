"""``benchmarks.pipeline``'s arithmetic and arguments, without running a system (well under a second): the bubble read
from ranks' timelines equals zgraph's simulated bubble on the simulation's own spans, and ``(P - 1) / (M + P - 1)``
for 1F1B; an action inside another counts once; ``--quick`` and the system names parse. No timing is checked."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import pipeline  # noqa: E402
from benchmarks.pipeline_systems import Spec, parse  # noqa: E402
from benchmarks.pipeline_timeline import Span, bubble, busy_seconds, ideal_bubble  # noqa: E402
from zgraph.runtime.pipeline_schedule import build_schedule  # noqa: E402
from zgraph.runtime.pipeline_simulate import simulate  # noqa: E402


@pytest.mark.parametrize("name, ranks, microbatches", [("1f1b", 4, 8), ("gpipe", 2, 4), ("zb_h1", 4, 4)])
def test_bubble_from_a_timeline_is_the_simulated_bubble(name, ranks, microbatches):
    sim = simulate(build_schedule(name, ranks, microbatches))
    timelines = [
        [Span(a.kind.name, start + 100.0, end + 100.0, end - start) for start, end, a in row] for row in sim.spans
    ]
    measured, idle = bubble(timelines)
    assert measured == pytest.approx(sim.bubble)
    assert len(idle) == ranks and min(idle) >= 0
    if name != "zb_h1":
        assert measured == pytest.approx(ideal_bubble(ranks, microbatches))
    else:
        assert measured < ideal_bubble(ranks, microbatches)


def test_nested_and_overlapping_spans_count_once():
    spans = [Span("B", 0.0, 4.0, 4.0), Span("W", 1.0, 2.0, 1.0), Span("F", 3.0, 5.0, 2.0), Span("F", 7.0, 8.0, 1.0)]
    assert busy_seconds(spans) == pytest.approx(6.0)
    mean, idle = bubble([spans, [Span("F", 0.0, 8.0, 8.0)]])
    assert idle == pytest.approx([0.25, 0.0]) and mean == pytest.approx(0.125)
    with pytest.raises(ValueError, match="no compute spans"):
        bubble([[], []])


def test_arguments_and_system_names():
    args = pipeline.parse_args(["--quick", "--systems", "zgraph-p4-1f1b,eager-1proc"])
    assert args.systems == ["eager-1proc", "zgraph-p4-1f1b"] and args.steps == 2 and args.batch % 8 == 0
    assert parse("zgraph-p2-interleaved", 8) == Spec("zgraph", 2, "interleaved_1f1b", 2, 8)
    assert parse("torch-p4-zb_h1-m4", 8) == Spec("torch", 4, "zb_h1", 1, 4)
    assert parse("torch-p2-zb_h1-m4-w2", 8) == Spec("torch", 2, "zb_h1", 1, 4, world=2)
    assert parse("zgraph-z3", 8) is None
    assert set(pipeline.SYSTEMS) >= {"deepspeed-p4-1f1b", "zgraph-z3", "torch-p2-gpipe"}
    with pytest.raises(argparse.ArgumentTypeError, match="unknown systems"):
        pipeline.parse_systems("zgraph-p3-1f1b")


def test_measured_action_times_per_stage_place():
    """Each place's median span per kind over its ranks (rank r at place r % P) and steps, for ``simulate``."""
    from zgraph.runtime.pipeline_schedule import Kind

    ranks = [
        {"rank": r, "spans": [[["F", 0.0, 1.0 + r % 2, 0.0], ["B", 2.0, 4.0 + r, 0.0]]]} for r in range(4)
    ]  # fmt: skip
    costs = pipeline.measured_costs(ranks, 2)
    assert costs == [{Kind.F: 1.0, Kind.B: 3.0}, {Kind.F: 2.0, Kind.B: 4.0}]
    assert pipeline.predicted_bubble("1f1b", 2, 4, 1, costs) > pipeline.predicted_bubble("1f1b", 2, 4, 1)
    # torch's zero bubble times its input-gradient half as its backward ("B"), then "W"
    split = [{"rank": 0, "spans": [[["F", 0.0, 1.0, 0.0], ["B", 1.0, 2.0, 0.0], ["W", 2.0, 3.0, 0.0]]]}]
    assert pipeline.measured_costs(split, 1) == [{Kind.F: 1.0, Kind.I: 1.0, Kind.W: 1.0, Kind.B: 1.0}]
    assert pipeline.predicted_bubble("zb_h1", 1, 2, 1, pipeline.measured_costs(split, 1)) == 0.0


def test_keep_host_memory_is_said_and_written_apart(tmp_path):
    """``--keep-host-memory``: the report names the allocator setting every system ran with, and the results go to
    ``pipeline_kept.*`` beside (not over) the run with glibc's defaults."""
    machine = {"cpu_count": 2, "cpu": "test", "torch": "x", "zgraph": "y", "date": "z"}
    for flag, stem in (([], "pipeline_quick"), (["--keep-host-memory"], "pipeline_quick_kept")):
        args = pipeline.parse_args(["--quick", "--out-dir", str(tmp_path), *flag])
        report = pipeline.write_results(args, machine, [], {})
        assert (tmp_path / f"{stem}.md").read_text() in report and (tmp_path / f"{stem}.json").exists()
        assert ("GLIBC_TUNABLES=" in report) == bool(flag)
