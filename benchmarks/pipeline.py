"""Pipelines side by side (issue 42, item 5): step time, bubble, peak memory, bytes, loss, on 4 gloo ranks.

Every system trains the same GPT (8 blocks by default, same seed) on the same global batches with AdamW, each run in
a fresh group of 4 one-thread processes (``benchmarks.pipeline_worker``; the systems are in
``benchmarks.pipeline_systems``): zgraph with ``P = 2`` (x ``D = 2`` pipelines) and ``P = 4`` with each schedule
(GPipe, 1F1B, interleaved 1F1B with 2 stages per rank, ZB-H1), ``torch.distributed.pipelining`` with the same split
and schedule, DeepSpeed's ``PipelineModule`` (its 1F1B), zgraph ZeRO-3 without pipelines, and eager PyTorch in one
process on the whole batch (the loss reference). The 1F1B and ZB-H1 rows are also run with 4 micro-batches.

    python -m benchmarks.pipeline [--quick] [--keep-host-memory] [--systems all|a,b,...] [--microbatches 8] [--steps 5]

Reported per system: seconds per step (min / median / max over the timed steps, the slowest rank's), the bubble
measured from the ranks' timelines (each compute action's span; a pipeline's window runs from its first action's
start to its last's end, the bubble is the mean over its ranks of the share of the window a rank does not compute:
``benchmarks.pipeline_timeline.bubble``; the median over steps) beside ``(P - 1) / (M + P - 1)`` and zgraph's
predicted bubble (``zgraph.runtime.pipeline_simulate`` with its unit costs, and with each stage place's action
times as measured: the bubble of unequal stages), each rank's idle share, peak RSS per
rank (VmHWM), the bytes all ranks send point to point and the collectives' payload in one step, and the final loss
against eager's. This 2-core machine runs 4 ranks: a rank waits for a CPU as well as for its neighbours, so the
measured bubble is what its timeline shows, not the schedule's alone. Writes ``benchmarks/results/pipeline.md`` and
``.json`` (``pipeline_quick.*`` with ``--quick``, ``pipeline_kept.*`` with ``--keep-host-memory``: every system's
processes run with glibc keeping freed memory, ``zgraph.runtime.host_memory``). See ``benchmarks/README.md``,
"Pipelines".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.compare import _cell, launch_and_wait, read_ranks
from benchmarks.compare_machine import FOREIGN_LOAD_WARN, ForeignLoad, last_lines, machine_facts, systems_parser
from benchmarks.pipeline_systems import SCHEDULES, parse
from benchmarks.pipeline_timeline import Span, bubble, ideal_bubble
from benchmarks.pipeline_worker import add_model_args
from benchmarks.varlen import cause
from zgraph.runtime.host_memory import GLIBC_TUNABLES

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 4
REFERENCE = "eager-1proc"
LOSS_RTOL = 1e-4
MODEL_KEYS = ("layers", "d_model", "heads", "seq", "vocab", "batch", "microbatches", "warmup", "steps", "lr", "seed")
PIPELINED = [f"{impl}-p{p}-{s}" for p in (2, 4) for s in SCHEDULES for impl in ("zgraph", "torch")]
SYSTEMS = (
    REFERENCE, *PIPELINED, "deepspeed-p2-1f1b", "deepspeed-p4-1f1b", "zgraph-z3",
    "zgraph-p4-1f1b-m4", "torch-p4-1f1b-m4", "zgraph-p4-zb_h1-m4", "torch-p4-zb_h1-m4",
    *(f"{impl}-p2-{s}{m}-w2" for m in ("", "-m4") for s in ("1f1b", "zb_h1") for impl in ("zgraph", "torch")),
    *(f"{impl}-{p}-compiled" for p in ("p4-1f1b", "p2-1f1b-w2") for impl in ("zgraph", "torch")),
)  # fmt: skip


@dataclass
class Row:
    """One system's line of the table."""

    system: str
    world: int
    steps: tuple[float, float, float] | None = None  # min, median, max seconds per step
    bubble: float | None = None  # measured, median over the timed steps
    ideal: float | None = None  # (P - 1) / (M + P - 1), GPipe and 1F1B
    predicted: float | None = None  # zgraph's simulate with unit costs
    at_measured: float | None = None  # zgraph's simulate with each place's measured action times
    idle: list[float] = field(default_factory=list)  # per rank, median over the steps
    peak_mib: list[float] = field(default_factory=list)
    p2p_mib: float | None = None
    collective_mib: float | None = None
    final_loss: float | None = None
    loss_rel: float | None = None
    other_load: float | None = None
    wall_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None


# ------------------------------------------------------------------------------------------------ running
def run_system(system: str, args: argparse.Namespace, tmp: Path) -> tuple[Row, list[dict[str, Any]]]:
    """One system in a fresh group of processes: its row (not yet compared to eager's) and raw rank results."""
    spec = parse(system, args.microbatches)
    world = 1 if system == REFERENCE else spec.world if spec else WORLD
    run_dir = tmp / system
    run_dir.mkdir()
    model = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in MODEL_KEYS]
    commands = [
        [sys.executable, "-m", "benchmarks.pipeline_worker", f"--system={system}", f"--out={run_dir}/rank{r}.json",
         *model] for r in range(world)
    ]  # fmt: skip
    row, start = Row(system, world), time.perf_counter()
    with ForeignLoad() as load:
        why = launch_and_wait(commands, run_dir, args.timeout)
    row.wall_s, row.other_load = time.perf_counter() - start, load.share
    ranks, errors = read_ranks(run_dir, world)
    if why is not None or errors:
        row.error = "; ".join(e for e in (why, errors[0] if errors else None) if e)
    else:
        fill(row, ranks, args)
    return row, ranks


def fill(row: Row, ranks: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The row's numbers from its ranks' results."""
    times = [max(ts) for ts in zip(*(r["step_s"] for r in ranks))]
    row.steps = (min(times), statistics.median(times), max(times))
    row.losses = [statistics.fmean(v for v in vs if v is not None) for vs in zip(*(r["losses"] for r in ranks))]
    row.final_loss = row.losses[-1]
    row.peak_mib = [r["peak_mib"] for r in ranks]
    row.p2p_mib = sum(r["p2p_bytes"] for r in ranks) / 2**20
    row.collective_mib = sum(r["collective_bytes"] for r in ranks) / 2**20
    spec = parse(row.system, args.microbatches)
    if spec is None:
        return
    if spec.schedule in ("gpipe", "1f1b"):
        row.ideal = ideal_bubble(spec.ranks, spec.microbatches)
    row.predicted = predicted_bubble(spec.schedule, spec.ranks, spec.microbatches, spec.virtual)
    measured_bubble(row, ranks)
    if row.bubble is not None:
        costs = measured_costs(ranks, spec.ranks)
        row.at_measured = predicted_bubble(spec.schedule, spec.ranks, spec.microbatches, spec.virtual, costs)


def measured_bubble(row: Row, ranks: list[dict[str, Any]]) -> None:
    """Per timed step, each pipeline's bubble from its ranks' spans; the row's: the median over steps of their mean,
    and each rank's median idle share."""
    pipelines = sorted({r["pipeline"] for r in ranks})
    if not all(spans for r in ranks for spans in r["spans"]):
        row.notes.append("a rank recorded no compute action: no bubble")
        return
    steps, idle = [], {r["rank"]: [] for r in ranks}
    for step in range(len(ranks[0]["spans"])):
        values = []
        for p in pipelines:
            members = [r for r in ranks if r["pipeline"] == p]
            mean, shares = bubble([[Span(*s) for s in r["spans"][step]] for r in members])
            values.append(mean)
            for r, share in zip(members, shares):
                idle[r["rank"]].append(share)
        steps.append(statistics.fmean(values))
    row.bubble = statistics.median(steps)
    row.idle = [statistics.median(idle[r]) for r in sorted(idle)]


def predicted_bubble(
    schedule: str, ranks: int, microbatches: int, virtual: int, per_rank: list[dict] | None = None
) -> float:
    """zgraph's predicted bubble of the schedule (unit costs: a backward two forwards; or ``per_rank``, each stage
    place's own action times; communication free)."""
    from zgraph.runtime.pipeline_schedule import build_schedule
    from zgraph.runtime.pipeline_simulate import simulate

    return simulate(build_schedule(schedule, ranks, microbatches, virtual), per_rank=per_rank).bubble


def measured_costs(ranks: list[dict[str, Any]], places: int) -> list[dict]:
    """Each stage place's action times as the run measured them: per compute kind, the median span over the timed
    steps and over the place's ranks (one per pipeline); rank ``r`` is at place ``r % P``. The stages' costs are
    not equal (the first holds the embeddings, the last the head and the loss) and, on this machine, neither are
    the CPUs' shares: this is the bubble the schedule has with them, where ``(P - 1) / (M + P - 1)`` assumes equal
    stages."""
    from zgraph.runtime.pipeline_schedule import Kind

    costs = []
    for place in range(places):
        spans = [Span(*s) for r in ranks if r["rank"] % places == place for step in r["spans"] for s in step]
        kinds = {s.kind for s in spans}
        cost = {Kind[k]: statistics.median(s.end - s.start for s in spans if s.kind == k) for k in kinds}
        if Kind.W in cost and Kind.I not in cost and Kind.B in cost:  # torch's zero bubble: its B is the I half
            cost[Kind.I] = cost[Kind.B]
        if Kind.I in cost and Kind.W in cost:
            cost.setdefault(Kind.B, cost[Kind.I] + cost[Kind.W])
        costs.append(cost)
    return costs


def compare(rows: list[Row]) -> None:
    """Each row's losses against eager's, step by step; notes on failures and a disturbed machine."""
    eager = next((r for r in rows if r.system == REFERENCE and r.error is None), None)
    for row in rows:
        if row.error is not None:
            row.notes.insert(0, "FAILED: " + cause(row.error))
            continue
        if eager is not None and row is not eager:
            row.loss_rel = max(abs(a - b) / abs(b) for a, b in zip(row.losses, eager.losses))
            if row.loss_rel > LOSS_RTOL:
                row.notes.append(f"LOSS MISMATCH: {row.loss_rel:.1e} relative to eager")
        if row.other_load is not None and row.other_load > FOREIGN_LOAD_WARN:
            row.notes.append(f"other processes used {row.other_load:.0%} of the CPUs: timing disturbed")


# ------------------------------------------------------------------------------------------------ output
def markdown_table(rows: list[Row]) -> str:
    head = (
        "| system | ranks | s/step min / median / max | bubble measured | (P-1)/(M+P-1) | zgraph predicted "
        "| predicted at measured action times | idle share per rank | peak MiB per rank | p2p MiB/step "
        "| collective MiB/step | final loss | max loss rel. diff | notes |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        steps = "—" if r.steps is None else " / ".join(f"{t:.3f}" for t in r.steps)
        cells = [
            r.system, str(r.world), steps, _cell(r.bubble, ".3f"), _cell(r.ideal, ".3f"), _cell(r.predicted, ".3f"),
            _cell(r.at_measured, ".3f"),
            " ".join(f"{x:.2f}" for x in r.idle) or "—", " ".join(f"{x:.0f}" for x in r.peak_mib) or "—",
            _cell(r.p2p_mib, ".2f"), _cell(r.collective_mib, ".2f"), _cell(r.final_loss, ".5f"),
            _cell(r.loss_rel, ".1e"), "; ".join(r.notes).replace("|", "\\|"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_report(args: argparse.Namespace, machine: dict[str, Any], params: int | None, rows: list[Row]) -> str:
    size = f", {params / 1e6:.2f} M parameters" if params else ""
    errors = [f"`{r.system}`: {cause(r.error)}\n\n```\n{last_lines(r.error, 12)}\n```\n" for r in rows if r.error]
    return "\n".join(
        [
            f"## GPT, {args.layers} blocks, d_model {args.d_model}, {args.heads} heads, sequence {args.seq}, "
            f"vocabulary {args.vocab}{size}",
            "",
            f"- global batch {args.batch}, M = {args.microbatches} micro-batches per pipeline unless the name ends "
            f"-m<M>; {WORLD} gloo ranks (`-p2-`: P = 2 x D = 2, `-p4-`: P = 4; `-w2`: P = 2 on 2 ranks), one thread "
            f"each; {args.warmup} warm-up steps, {args.steps} timed, one more with its bytes counted",
            "- bubble measured: per pipeline, the mean over its ranks of the share of its compute window (first "
            "action's start to last's end) a rank does not compute, median over the timed steps; idle share per "
            "rank: the same per rank. The machine has 2 CPUs for 4 ranks: a rank also waits for a CPU, which "
            "stretches its actions (the measured bubble is then below the schedule's) and holds back its neighbours",
            "- p2p MiB/step: bytes all ranks send (`c10d.send`); collective: each rank's collectives' payload "
            "(all-reduce's tensor, all-gather's output, reduce-scatter's input, broadcast), summed over the ranks",
            "- peak MiB per rank: VmHWM, reset after the warm-up; loss: every step's global-batch loss against eager "
            "PyTorch in one process",
            "- host memory: "
            + (
                f"kept between steps in every system's processes (`GLIBC_TUNABLES={GLIBC_TUNABLES}`)"
                if args.keep_host_memory
                else "glibc's malloc defaults (freed memory may go back to the system and fault in again)"
            ),
            f"- machine: {machine['cpu_count']} CPUs ({machine['cpu']}), torch {machine['torch']}, "
            f"zgraph {machine['zgraph']}, {machine['date']}",
            "",
            markdown_table(rows),
            "",
            "### Checks (issue 42's targets; read with the load notes above)",
            "",
            *checks(rows),
            "",
            *(["### Errors", "", *errors] if errors else []),
        ]
    )


def checks(rows: list[Row]) -> list[str]:
    """The targets, row by row: each 1F1B bubble against ``(P - 1) / (M + P - 1)`` (within 5 %, relative), ZB-H1's
    against 1F1B's, zgraph's median step against ``torch.distributed.pipelining``'s with the same schedule."""
    by_name = {r.system: r for r in rows if r.error is None}
    lines = []
    for r in by_name.values():
        if r.system.split("-")[2:3] == ["1f1b"] and r.bubble is not None and r.ideal is not None:
            rel = r.bubble / r.ideal - 1
            verdict = "within" if abs(rel) <= 0.05 else "outside"
            lines.append(f"- `{r.system}` bubble {r.bubble:.3f} vs {r.ideal:.3f}: {rel:+.0%}, {verdict} 5 %")
            if r.at_measured is not None:
                lines.append(
                    f"  - against the schedule at its measured action times ({r.at_measured:.3f}, unequal stages): "
                    f"{r.bubble / r.at_measured - 1:+.0%}"
                )
        zb = by_name.get(r.system.replace("-1f1b", "-zb_h1"))
        if "-1f1b" in r.system and zb is not None and zb.bubble is not None and r.bubble is not None:
            verdict = "below" if zb.bubble < r.bubble else "NOT below"
            lines.append(f"- `{zb.system}` bubble {zb.bubble:.3f}: {verdict} `{r.system}`'s {r.bubble:.3f}")
    for r in by_name.values():
        peer = by_name.get(r.system.replace("zgraph-", "torch-", 1))
        if r.system.startswith("zgraph-p") and peer is not None and r.steps and peer.steps:
            ratio = r.steps[1] / peer.steps[1]
            lines.append(
                f"- `{r.system}` median step {ratio:.2f}x `{peer.system}`'s ({'no slower' if ratio <= 1 else 'SLOWER'})"
            )
    return lines or ["- (no rows to compare)"]


# ------------------------------------------------------------------------------------------------ driver
parse_systems = systems_parser(SYSTEMS)  # the --systems argument


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", type=parse_systems, default=list(SYSTEMS), help="'all' or a comma list")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, 1 warm-up and 2 timed steps: a smoke run")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one system's run may take")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument(
        "--keep-host-memory",
        action="store_true",
        help="run every system's processes with glibc keeping freed memory (GLIBC_TUNABLES, what "
        "zgraph.Config(keep_host_memory=True) sets for its own process); results go to pipeline_kept.*",
    )
    add_model_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.d_model, args.heads, args.seq, args.vocab, args.batch, args.warmup, args.steps = 32, 2, 16, 128, 16, 1, 2
        args.microbatches = 4
    if args.batch % (2 * args.microbatches) or args.layers % 8:
        parser.error("--batch must be a multiple of 2 x --microbatches (P = 2 x D = 2), --layers of 8 (P x v = 8)")
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the ``finally`` that stops the ranks


def main(argv: list[str] | None = None) -> list[Row]:
    """Run the systems one after another, writing the results after each."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.keep_host_memory:  # inherited by every system's processes (base_env copies the environment)
        os.environ["GLIBC_TUNABLES"] = GLIBC_TUNABLES
    machine = machine_facts("not run", (float("nan"), None))
    rows: list[Row] = []
    raw: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="zgraph-pipeline-") as tmp:
        for system in args.systems:
            row, raw[system] = run_system(system, args, Path(tmp))
            rows.append(row)
            print(progress(row), flush=True)
            report = write_results(args, machine, rows, raw)
    print("\n" + report, flush=True)
    return rows


def write_results(args: argparse.Namespace, machine: dict, rows: list[Row], raw: dict[str, list]) -> str:
    """Compare the rows so far, write ``pipeline.md`` and ``.json`` (``pipeline_quick.*``, ``*_kept.*``); returns
    the report."""
    for row in rows:
        row.notes = [n for n in row.notes if not n.startswith(("FAILED", "LOSS", "other processes"))]
    compare(rows)
    params = next((r["params"] for ranks in raw.values() for r in ranks if r.get("params")), None)
    report = markdown_report(args, machine, params, rows)
    stem = ("pipeline_quick" if args.quick else "pipeline") + ("_kept" if args.keep_host_memory else "")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.md").write_text(report)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    payload = {"settings": settings, "machine": machine, "rows": [asdict(r) for r in rows], "ranks": raw}
    (args.out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    return report + f"\nwrote {args.out_dir / stem}.md and .json"


def progress(row: Row) -> str:
    head = f"  {row.system:<22} ({row.wall_s:6.1f} s wall)"
    if row.error:
        return f"{head} FAILED: {cause(row.error)}"
    assert row.steps is not None
    bubble_text = "" if row.bubble is None else f", bubble {row.bubble:.3f}"
    return f"{head} median {row.steps[1]:.3f} s/step{bubble_text}, final loss {row.final_loss:.5f}"


if __name__ == "__main__":
    main()
