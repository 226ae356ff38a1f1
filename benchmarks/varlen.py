"""Variable sequence lengths side by side (issue 41, item 6): first pass, steady step, captures, peak memory.

Every system trains the same model on the same batches, 24 steps whose sequence length cycles over 8 values (global
batch 4): in one process (eager PyTorch, ``torch.compile(dynamic=True)``, zgraph with the eager and the inductor
backend) and on 2 gloo ranks (DDP, FSDP2, ``torch.compile(dynamic=True)`` + DDP, zgraph stage 3 with either
backend), each run in a fresh group of one-thread processes (``benchmarks.varlen_worker``). zgraph's eager rows find
the symbolic sizes automatically (the default ``Config.dynamic=None``: two captures); its inductor rows, beside
``torch.compile(dynamic=True)``, ask for them from the first call (``Config(dynamic=True)``: one).

    python -m benchmarks.varlen [--model gpt2|gpt100m] [--steps 24] [--systems all|a,b,...] [--quick]

Reported per system: the first pass (the first 8 steps, one per length: zgraph captures, torch.compile compiles),
seconds per step over the rest (min / median / max, and the total against the reference's), the captures or
compiles (after the first pass / at the end), peak RSS per rank (VmHWM) in the first pass and after it, and each
step's loss against eager PyTorch in one process on the global batch. Writes ``benchmarks/results/varlen_<model>.md``
and ``.json`` (``varlen_quick.*`` with ``--quick``). See ``benchmarks/README.md``, "Variable lengths".
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.compare import _cell, launch_and_wait, read_ranks
from benchmarks.compare_machine import (
    FOREIGN_LOAD_WARN,
    WORLD_SIZE,
    ForeignLoad,
    last_lines,
    machine_facts,
    systems_parser,
    wait_for_idle,
)
from benchmarks.varlen_worker import ONE_PROCESS, SYSTEMS

RESULTS = Path(__file__).resolve().parent / "results"
LENGTHS = {  # cycled in this order (no two neighbours close); up to GPT_100M's 128 positions
    "gpt2": (40, 97, 61, 128, 23, 115, 77, 104),
    "gpt100m": (40, 97, 61, 128, 23, 115, 77, 104),
    "tiny": (17, 32),
}
MODEL_NAMES = {
    "gpt2": "Hugging Face GPT-2 (12 layers, n_embd 256, 4 heads, vocabulary 1000)",
    "gpt100m": "GPT 100M (zgraph.demos.models.GPT_100M)",
    "tiny": "tiny GPT (2 layers, d 64, vocabulary 256)",
}
INDUCTOR = ("compile-1proc", "compile-ddp", "zgraph-inductor-1proc", "zgraph-z3-inductor")  # run last, in this order
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in INDUCTOR)
REFERENCE = {True: "eager-1proc", False: "ddp"}  # by "runs in one process"
LOSS_RTOL = 1e-3


@dataclass
class Row:
    """One system's line of the table."""

    system: str
    world: int
    first_pass_s: float | None = None
    first_pass_ratio: float | None = None
    steady: tuple[float, float, float] | None = None  # min, median, max seconds per step
    steady_total_s: float | None = None
    steady_ratio: float | None = None
    captures_first_pass: int | None = None
    captures: int | None = None
    peak_first_pass_mib: float | None = None
    peak_steady_mib: float | None = None
    loss_rel: float | None = None
    other_load: float | None = None
    wall_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None


# ------------------------------------------------------------------------------------------------ running
def worker_command(system: str, args: argparse.Namespace, out: Path) -> list[str]:
    lengths = ",".join(map(str, args.lengths))
    return [
        sys.executable, "-m", "benchmarks.varlen_worker", f"--system={system}", f"--model={args.model}",
        f"--lengths={lengths}", f"--steps={args.steps}", f"--batch={args.batch}", f"--seed={args.seed}",
        f"--out={out}",
    ]  # fmt: skip


def run_system(system: str, args: argparse.Namespace, tmp: Path) -> tuple[Row, list[dict[str, Any]]]:
    """Run one system in a fresh group of processes; its row (timings not yet compared) and raw rank results."""
    world = 1 if system in ONE_PROCESS else WORLD_SIZE
    run_dir = tmp / system
    run_dir.mkdir()
    wait_for_idle(args.wait_idle)
    row, start = Row(system, world), time.perf_counter()
    with ForeignLoad() as load:
        why = launch_and_wait([worker_command(system, args, run_dir / f"rank{r}.json") for r in range(world)],
                              run_dir, args.timeout)  # fmt: skip
    row.wall_s, row.other_load = time.perf_counter() - start, load.share
    ranks, errors = read_ranks(run_dir, world)
    if why is not None or errors:
        row.error = "; ".join(e for e in (why, errors[0] if errors else None) if e)
        row.notes.append(done_before(ranks, args.steps))
    else:
        fill(row, ranks, len(args.lengths))
    return row, ranks


def done_before(ranks: list[dict[str, Any]], steps: int) -> str:
    """What a failed run finished first (each rank writes its result after every step)."""
    done = min((len(r["step_s"]) for r in ranks), default=0)
    seconds = sum(max(ts) for ts in zip(*(r["step_s"] for r in ranks)))
    return f"{done} of {steps} steps done ({seconds:.0f} s)"


def fill(row: Row, ranks: list[dict[str, Any]], first: int) -> None:
    """The row's own numbers from its ranks: per step the slowest rank's time, the ranks' mean loss (the global
    batch's: every rank has as many rows of the same length)."""
    times = [max(ts) for ts in zip(*(r["step_s"] for r in ranks))]
    row.first_pass_s = sum(times[:first])
    if times[first:]:
        rest = times[first:]
        row.steady, row.steady_total_s = (min(rest), statistics.median(rest), max(rest)), sum(rest)
    row.losses = [statistics.fmean(ls) for ls in zip(*(r["losses"] for r in ranks))]
    row.captures_first_pass = max(r["captures_first_pass"] or 0 for r in ranks)
    row.captures = max(r["captures"] for r in ranks)
    row.peak_first_pass_mib = max(r["peak_first_pass_mib"] for r in ranks)
    steady_peaks = [r["peak_steady_mib"] for r in ranks if r["peak_steady_mib"] is not None]
    row.peak_steady_mib = max(steady_peaks) if steady_peaks else None


def compare(rows: list[Row]) -> None:
    """Ratios to the reference of the same world size (eager-1proc, ddp): first pass, and the steady steps' total
    (every system runs the same lengths); each step's loss against eager-1proc's."""
    by_name = {r.system: r for r in rows if r.error is None}
    eager = by_name.get("eager-1proc")
    for row in rows:
        if row.error is not None:
            row.notes.insert(0, "FAILED: " + cause(row.error))
            continue
        ref = by_name.get(REFERENCE[row.world == 1])
        if ref is not None and ref.first_pass_s:
            row.first_pass_ratio = row.first_pass_s / ref.first_pass_s
        if ref is not None and ref.steady_total_s and row.steady_total_s:
            row.steady_ratio = row.steady_total_s / ref.steady_total_s
        if eager is not None and row is not eager:
            row.loss_rel = max(abs(a - b) / abs(b) for a, b in zip(row.losses, eager.losses))
            if row.loss_rel > LOSS_RTOL:
                row.notes.append(f"LOSS MISMATCH: {row.loss_rel:.1e} relative to eager-1proc")
        if row.other_load is not None and row.other_load > FOREIGN_LOAD_WARN:
            row.notes.append(f"other processes used {row.other_load:.0%} of the CPUs: timing disturbed")


# ------------------------------------------------------------------------------------------------ output
def cause(error: str) -> str:
    """The exception line of a traceback (its last ``SomethingError: ...`` line; else the first line: the harness's
    reason, a timeout say), shortened."""
    found = re.findall(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b.*$", error, re.MULTILINE)
    line = found[-1] if found else error.splitlines()[0]
    return line if len(line) <= 300 else line[:297] + "..."


def markdown_table(rows: list[Row]) -> str:
    head = (
        "| system | ranks | first pass s | vs ref | steady s/step min / median / max | steady vs ref "
        "| captures (1st pass / end) | peak MiB/rank 1st pass | peak MiB/rank steady | max loss rel. diff | notes |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        steady = "—" if r.steady is None else " / ".join(f"{t:.3f}" for t in r.steady)
        captures = "—" if r.captures is None else f"{r.captures_first_pass} / {r.captures}"
        cells = [
            r.system, str(r.world), _cell(r.first_pass_s, ".2f"), _cell(r.first_pass_ratio, ".2f"), steady,
            _cell(r.steady_ratio, ".3f"), captures, _cell(r.peak_first_pass_mib, ".0f"),
            _cell(r.peak_steady_mib, ".0f"), _cell(r.loss_rel, ".1e"), "; ".join(r.notes).replace("|", "\\|"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_report(args: argparse.Namespace, machine: dict[str, Any], params: int | None, rows: list[Row]) -> str:
    size = f", {params / 1e6:.1f} M parameters" if params else ""
    errors = [f"`{r.system}`: {cause(r.error)}\n\n```\n{last_lines(r.error, 12)}\n```\n" for r in rows if r.error]
    return "\n".join(
        [
            f"## {MODEL_NAMES[args.model]}{size}",
            "",
            f"- {args.steps} steps, global batch {args.batch}, sequence lengths cycling over "
            f"{', '.join(map(str, args.lengths))}; first pass = the first {len(args.lengths)} steps (one per "
            "length), steady = the rest",
            f"- `vs ref`: against `eager-1proc` for one process, `ddp` for {WORLD_SIZE} ranks (steady: the total of "
            "the steady steps, the same lengths for every system); loss: every step's global-batch loss against "
            "`eager-1proc`",
            "- captures: zgraph's captured variants (`step._dispatch.variants()`); torch.compile's compiled graphs "
            "(`torch._dynamo.utils.counters['stats']['unique_graphs']`, recompiles included)",
            "- peak MiB/rank: VmHWM (resident set, what the allocator keeps included), reset after the first pass",
            f"- machine: {machine['cpu_count']} CPUs ({machine['cpu']}), torch {machine['torch']}, one thread per "
            f"rank, zgraph {machine['zgraph']}, {machine['date']}",
            "",
            markdown_table(rows),
            "",
            *(["### Errors", "", *errors] if errors else []),
        ]
    )


# ------------------------------------------------------------------------------------------------ driver
parse_systems = systems_parser(SYSTEMS)  # the --systems argument


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2", "gpt100m"), default="gpt2")
    parser.add_argument("--steps", type=int, default=24, help="steps per system (the first pass is one per length)")
    parser.add_argument("--batch", type=int, default=4, help="global batch: sequences per step over all ranks")
    parser.add_argument(
        "--systems",
        type=parse_systems,
        default=list(DEFAULT_SYSTEMS),
        help=f"'all' (adds the inductor rows: {', '.join(INDUCTOR)}) or a comma list of {', '.join(SYSTEMS)}",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, 2 lengths, 6 steps: a smoke run (< 1 min)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one system's run may take")
    parser.add_argument("--wait-idle", type=float, default=0.0, help="wait up to this long for idle CPUs first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--suffix", default="", help="results go to varlen_<model>_<suffix>.md / .json")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.steps = "tiny", 6
    args.lengths = list(LENGTHS[args.model])
    if args.steps < len(args.lengths) or args.batch % WORLD_SIZE:
        parser.error(f"--steps must be at least {len(args.lengths)}, --batch a multiple of {WORLD_SIZE}")
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the ``finally`` that stops the ranks


def main(argv: list[str] | None = None) -> list[Row]:
    """Run the systems (the default ones first, then the inductor rows), writing the results after each."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    machine = machine_facts("not run", (float("nan"), None))
    done: dict[str, Row] = {}
    raw: dict[str, list[dict[str, Any]]] = {}
    order = [s for s in args.systems if s not in INDUCTOR] + [s for s in INDUCTOR if s in args.systems]
    with tempfile.TemporaryDirectory(prefix="zgraph-varlen-") as tmp:
        for system in order:
            done[system], raw[system] = run_system(system, args, Path(tmp))
            print(progress(done[system]), flush=True)
            rows = [copy.deepcopy(done[s]) for s in args.systems if s in done]
            report = write_results(args, machine, rows, raw)
    print("\n" + report, flush=True)
    return rows


def write_results(args: argparse.Namespace, machine: dict, rows: list[Row], raw: dict[str, list]) -> str:
    """Compare the rows run so far, write ``varlen_<model>.md`` and ``.json``; returns the report."""
    compare(rows)
    params = next((r["params"] for ranks in raw.values() for r in ranks if r.get("params")), None)
    report = markdown_report(args, machine, params, rows)
    stem = "varlen_" + ("quick" if args.quick else args.model) + (f"_{args.suffix}" if args.suffix else "")
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
    median = row.steady[1] if row.steady else float("nan")
    return f"{head} first pass {row.first_pass_s:.1f} s, steady median {median:.4f} s/step, captures {row.captures}"


if __name__ == "__main__":
    main()
