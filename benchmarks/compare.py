"""Side-by-side distributed step time, memory and loss: eager PyTorch, DDP, FSDP2, DeepSpeed ZeRO, zgraph.

Every system trains the same ``zgraph.demos.models.GPT`` (same seed) on the same batches (global batch 16 x seq 128;
2 gloo ranks x 8 sequences, or one process on all 16) with AdamW, each run in a fresh group of processes
with one thread each. Systems alternate across repeats; the median step time over all timed steps of all
repeats is reported, with peak RSS per rank and the loss after the last timed step.

    python -m benchmarks.compare [--model bench|100m|both] [--backend eager|inductor] [--steps 10]
        [--warmup 3] [--repeats 2] [--systems ddp,zgraph-z3,...] [--timeout 900] [--wait-idle 60]

Writes ``benchmarks/results/compare_<model>.md`` and ``.json`` (``compare_<model>_inductor.*`` with
``--backend inductor``). See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.compare_machine import (
    FOREIGN_LOAD_WARN,
    ROOT,
    WORLD_SIZE,
    ForeignLoad,
    base_env,
    deepspeed_status,
    free_port,
    last_lines,
    machine_facts,
    rank_env,
    revision_span,
    systems_parser,
    terminate,
    undisturbed_probe,
    wait_for_idle,
    wait_ranks,
    zgraph_revision,
)
from zgraph.demos.models import BENCH_GPT, GPT_100M, GPTConfig
from zgraph.runtime.host_memory import GLIBC_TUNABLES

RESULTS = Path(__file__).resolve().parent / "results"
MICRO_BATCH = 8
GLOBAL_BATCH = WORLD_SIZE * MICRO_BATCH
SINGLE_PROCESS = "eager-1proc"
DEEPSPEED_SYSTEMS = ("deepspeed-z1", "deepspeed-z2", "deepspeed-z3")
COMPILED_PEERS = ("ddp-compiled", "fsdp2-compiled")  # the peers with torch.compile (inductor) on the model
# stage 3 with parameters gathered once per step (held from forward to backward): FSDP2's
# reshard_after_forward=False, zgraph's max_reuse_distance as large as the model (DeepSpeed's default reuse)
GATHERED_ONCE = ("fsdp2-keep", "zgraph-z3-keep")
CONTROL = "ddp-control"  # benchmarks.control_ddp: a plain DDP script, the harness's control (issue 17)
SYSTEMS = (
    SINGLE_PROCESS,
    "ddp",
    CONTROL,
    "fsdp2",
    *DEEPSPEED_SYSTEMS,
    "zgraph-z0",
    "zgraph-z1",
    "zgraph-z2",
    "zgraph-z3",
    *GATHERED_ONCE,
    *COMPILED_PEERS,
)
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in COMPILED_PEERS + GATHERED_ONCE)  # --systems all adds them
MODELS: dict[str, tuple[str, GPTConfig]] = {"bench": ("bench GPT", BENCH_GPT), "100m": ("GPT 100M", GPT_100M)}
LOSS_RTOL = 1e-3


# ------------------------------------------------------------------------------------------------ results
@dataclass
class RunResult:
    """One system, one repeat: the ranks' JSON results, or why it failed."""

    system: str
    repeat: int
    attempt: int = 0
    ranks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0
    foreign_cpu: float | None = None


@dataclass
class Summary:
    """One row of the table."""

    system: str
    median_s: float | None = None
    ratio_ddp: float | None = None
    ratio_eager: float | None = None
    peak_mib: float | None = None
    state_mib: float | None = None
    final_loss: float | None = None
    first_step_s: float | None = None
    cpu_s: float | None = None
    foreign_cpu: float | None = None
    timed_steps: int = 0
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ environment
def make_data(path: Path, vocab: int, seq: int, batches: int, seed: int) -> None:
    """``batches`` global batches of next-token windows from zgraph's local text corpus (byte tokens)."""
    from zgraph.demos.data import batch, corpus_tokens

    tokens = corpus_tokens()
    if int(tokens.max()) >= vocab:
        raise ValueError(f"the corpus's byte tokens do not fit a vocabulary of {vocab}")
    generator = torch.Generator().manual_seed(seed)
    pairs = [batch(tokens, GLOBAL_BATCH, seq, generator) for _ in range(batches)]
    torch.save({"idx": torch.stack([i for i, _ in pairs]), "tgt": torch.stack([t for _, t in pairs])}, path)


# ------------------------------------------------------------------------------------------------ processes
def worker_command(system: str, args: argparse.Namespace, model: str, data: Path, out: Path) -> list[str]:
    """The command line of one rank."""
    if system == CONTROL:
        control = f"--model={model} --data={data} --out={out} --warmup={args.warmup} --steps={args.steps}"
        return [sys.executable, "-m", "benchmarks.control_ddp", *control.split(), f"--micro-batch={MICRO_BATCH}"]
    return [
        sys.executable,
        "-m",
        "benchmarks.compare_worker",
        f"--system={system}",
        f"--model={model}",
        f"--data={data}",
        f"--out={out}",
        f"--warmup={args.warmup}",
        f"--steps={args.steps}",
        f"--micro-batch={MICRO_BATCH}",
        f"--backend={args.backend}",
        f"--lr={args.lr}",
        f"--seed={args.seed}",
    ]


def disturbed(run: RunResult) -> bool:
    """True if other processes used more than FOREIGN_LOAD_WARN of the CPUs during the run."""
    return run.foreign_cpu is not None and run.foreign_cpu > FOREIGN_LOAD_WARN


def run_system(system: str, repeat: int, attempt: int, args: argparse.Namespace, model: str, data: Path) -> RunResult:
    """Run one system once in a fresh group of processes; collect each rank's JSON result."""
    world = 1 if system == SINGLE_PROCESS else WORLD_SIZE
    run_dir = data.parent / f"{system}.{repeat}.{attempt}"
    run_dir.mkdir()
    commands = [worker_command(system, args, model, data, run_dir / f"rank{rank}.json") for rank in range(world)]
    result = RunResult(system, repeat, attempt)
    wait_for_idle(args.wait_idle)
    start = time.perf_counter()
    with ForeignLoad() as load:
        why = launch_and_wait(commands, run_dir, args.timeout)
    result.wall_s = time.perf_counter() - start
    result.foreign_cpu = load.share
    result.ranks, errors = read_ranks(run_dir, world)
    if why is not None or errors:
        result.error = "; ".join(e for e in (why, errors[0] if errors else None) if e)
    return result


def launch_and_wait(commands: list[list[str]], run_dir: Path, timeout: float) -> str | None:
    """Start one process per rank (each in its own session, output to ``rank<r>.log``) and wait for them all;
    None if every rank exited 0, else why not. No process outlives this call."""
    world, port = len(commands), free_port()
    procs: list[subprocess.Popen] = []
    try:
        for rank, cmd in enumerate(commands):
            env = base_env() if world == 1 else rank_env(rank, world, port)
            with open(run_dir / f"rank{rank}.log", "w") as log:
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        return wait_ranks(procs, timeout)
    finally:
        terminate(procs)


def read_ranks(run_dir: Path, world: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Each rank's JSON result, and the errors, first failure first: the tracebacks of ranks that caught one (in
    the order they were written), then the log tails of ranks that wrote no result (killed or crashed hard)."""
    ranks, caught, lost = [], [], []
    for rank in range(world):
        path = run_dir / f"rank{rank}.json"
        if path.exists():
            data = json.loads(path.read_text())
            ranks.append(data)
            if data.get("error"):
                caught.append((path.stat().st_mtime, f"rank {rank}:\n" + last_lines(data["error"], 10)))
        else:
            log = (run_dir / f"rank{rank}.log").read_text(errors="replace")
            lost.append(f"rank {rank} wrote no result; log tail:\n" + last_lines(log, 10))
    return ranks, [e for _, e in sorted(caught)] + lost


# ------------------------------------------------------------------------------------------------ summarising
def step_times(run: RunResult) -> list[float]:
    """Per timed step, the slowest rank's time (ranks meet at a barrier, so they nearly agree)."""
    if run.error or not run.ranks:
        return []
    return [max(ts) for ts in zip(*(r["step_s"] for r in run.ranks))]


def final_loss(run: RunResult) -> float | None:
    """The loss of the last timed step, averaged over ranks (= the global-batch mean loss)."""
    if run.error or not run.ranks or not all(r["losses"] for r in run.ranks):
        return None
    return statistics.fmean(r["losses"][-1] for r in run.ranks)


def summarize(system: str, runs: list[RunResult]) -> Summary:
    """Median step time over every timed step of every repeat; max peak memory; the last repeat's loss."""
    summary = Summary(system)
    ok = [r for r in runs if not r.error]
    times = [t for r in ok for t in step_times(r)]
    if times:
        summary.median_s = statistics.median(times)
        summary.timed_steps = len(times)
        summary.peak_mib = max(rank["peak_mib"] for r in ok for rank in r.ranks)
        summary.state_mib = max(rank["state_mib"] for r in ok for rank in r.ranks)
        summary.first_step_s = statistics.median(max(rank["warmup_s"][0] for rank in r.ranks) for r in ok)
        summary.cpu_s = statistics.fmean(rank["cpu_s"] / len(rank["step_s"]) for r in ok for rank in r.ranks)
        threads = sorted({rank["threads_after"] for r in ok for rank in r.ranks} - {1})
        if threads:
            summary.notes.append(f"torch threads changed during the run to {threads}")
        losses = [loss for loss in map(final_loss, ok) if loss is not None]
        summary.final_loss = losses[-1] if losses else None
        if len(set(losses)) > 1:
            summary.notes.append(f"final loss varies across repeats: {min(losses):.6f}..{max(losses):.6f}")
    loads = [r.foreign_cpu for r in runs if r.foreign_cpu is not None]
    summary.foreign_cpu = max(loads) if loads else None
    if any(map(disturbed, runs)):
        summary.notes.append(f"other processes used {summary.foreign_cpu:.0%} of the CPUs: timing disturbed")
    for r in runs:
        if r.error:
            summary.notes.append(f"repeat {r.repeat + 1} failed: {last_lines(r.error, 1)}")
            summary.errors.append(f"repeat {r.repeat + 1}: {r.error}")
    return summary


def add_ratios(rows: list[Summary]) -> None:
    """Ratios of step time to ddp and to eager-1proc; flag losses more than LOSS_RTOL off ddp's."""
    by_name = {r.system: r for r in rows}
    ddp, eager = by_name.get("ddp"), by_name.get(SINGLE_PROCESS)
    reference = ddp if ddp and ddp.final_loss is not None else eager
    for row in rows:
        if row.median_s is None:
            continue
        if ddp and ddp.median_s:
            row.ratio_ddp = row.median_s / ddp.median_s
        if eager and eager.median_s:
            row.ratio_eager = row.median_s / eager.median_s
        if reference and reference.final_loss is not None and row.final_loss is not None and row is not reference:
            rel = abs(row.final_loss - reference.final_loss) / abs(reference.final_loss)
            if rel > LOSS_RTOL:
                row.notes.insert(0, f"LOSS MISMATCH: {rel:.2e} relative to {reference.system}")


# ------------------------------------------------------------------------------------------------ output
def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def markdown_table(rows: list[Summary]) -> str:
    """The results as a Markdown table (errors and flags in the notes column, one line)."""
    head = (
        "| system | median s/step | vs ddp | vs eager-1proc | peak MiB/rank | model state MiB/rank | final loss "
        "| CPU s/step/rank | 1st step s | other load | notes |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        notes = "; ".join(n.replace("|", "\\|") for n in r.notes)
        cells = [
            r.system,
            _cell(r.median_s, ".4f"),
            _cell(r.ratio_ddp, ".2f"),
            _cell(r.ratio_eager, ".2f"),
            _cell(r.peak_mib, ".0f"),
            _cell(r.state_mib, ".1f"),
            _cell(r.final_loss, ".5f"),
            _cell(r.cpu_s, ".3f"),
            _cell(r.first_step_s, ".2f"),
            _cell(r.foreign_cpu, ".0%"),
            notes,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_errors(rows: list[Summary]) -> list[str]:
    """A section with the tail of every failed run's traceback (empty if none failed)."""
    lines = []
    for row in rows:
        for error in row.errors:
            lines += [f"`{row.system}`, {error.splitlines()[0]}", "", "```", *error.splitlines()[1:], "```", ""]
    return ["### Errors", "", *lines] if lines else []


def markdown_report(model: str, params: int | None, args: argparse.Namespace, machine: dict, rows: list) -> str:
    """Title, setup and machine facts, then the table."""
    name, config = MODELS[model]
    size = f", {params / 1e6:.1f} M parameters" if params else ""
    scaling, probe_load = machine["two_process_scaling"], machine["two_process_scaling_other_load"]
    probe_note = "" if probe_load is None else f", other load meanwhile {probe_load:.0%}"
    return "\n".join(
        [
            f"## {name}{size}",
            "",
            f"- global batch {GLOBAL_BATCH} x seq {config.seq} ({WORLD_SIZE} gloo ranks x {MICRO_BATCH}; "
            f"`{SINGLE_PROCESS}`: one process, all {GLOBAL_BATCH}), AdamW lr {args.lr:g} "
            f"(weight decay 0.1 on matrices only), seed {args.seed}",
            f"- {args.warmup} warm-up steps (untimed), {args.steps} timed steps, {args.repeats} repeat(s) "
            f"alternating systems; zgraph backend `{args.backend}`",
            "- host memory: "
            + (
                f"kept between steps in every system's processes (`GLIBC_TUNABLES={GLIBC_TUNABLES}`)"
                if args.keep_host_memory
                else "glibc's defaults (freed memory returned to the OS) in every system"
            ),
            f"- {machine['date']}; {machine['cpu_count']} CPUs ({machine['cpu']}); torch {machine['torch']}; "
            f"DeepSpeed {machine['deepspeed']}; zgraph {machine['zgraph']}; Python {machine['python']}; "
            f"{machine['threads_per_rank']} thread per process (OMP_NUM_THREADS=1, torch.set_num_threads(1))",
            f"- two concurrent 1-thread processes reach {scaling:.2f}x the throughput of one (2.00 = two "
            f"independent cores{probe_note}); *other load*: share of all CPUs' time used by processes outside the "
            "benchmark during the run (worst repeat; a disturbed run is run again, up to `--retries` times, and the "
            "least disturbed attempt is kept)",
            "",
            markdown_table(rows),
            "",
            *markdown_errors(rows),
        ]
    )


def write_outputs(stem: str, report: str, payload: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """``<stem>.md`` and ``<stem>.json`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md.write_text(report)
    js.write_text(json.dumps(payload, indent=1))
    return md, js


# ------------------------------------------------------------------------------------------------ driver
def progress(run: RunResult) -> str:
    """One line per run for the console."""
    load = f", other load {run.foreign_cpu:.0%}" if run.foreign_cpu is not None else ""
    retry = f" (retry {run.attempt})" if run.attempt else ""
    head = f"  [repeat {run.repeat + 1}{retry}] {run.system:<13} ({run.wall_s:5.1f} s wall{load})"
    if run.error:
        return f"{head} FAILED: {last_lines(run.error, 1)}"
    times, loss = step_times(run), final_loss(run)
    return f"{head} median {statistics.median(times):.4f} s/step, final loss {loss:.5f}"


def run_undisturbed(
    system: str, repeat: int, args: argparse.Namespace, model: str, data: Path, discarded: list[RunResult]
) -> RunResult:
    """Run a system; while other processes disturbed the run, run it again (at most ``args.retries`` more
    times). Returns the failed run if one failed, else the least disturbed; the others go to ``discarded``."""
    attempts = [run_system(system, repeat, 0, args, model, data)]
    print(progress(attempts[-1]), flush=True)
    while disturbed(attempts[-1]) and not attempts[-1].error and len(attempts) <= args.retries:
        attempts.append(run_system(system, repeat, len(attempts), args, model, data))
        print(progress(attempts[-1]), flush=True)
    best = min(attempts, key=lambda r: (r.error is None, r.foreign_cpu or 0.0))  # a failure is never hidden
    discarded.extend(r for r in attempts if r is not best)
    return best


def benchmark_model(model: str, systems: list[str], args: argparse.Namespace, machine: dict, skipped: dict) -> str:
    """Run every system ``args.repeats`` times (alternating), summarise, write the outputs; returns the report."""
    name, config = MODELS[model]
    runs: dict[str, list[RunResult]] = {s: [] for s in systems}
    discarded: list[RunResult] = []
    revision = zgraph_revision()
    with tempfile.TemporaryDirectory(prefix="zgraph-compare-") as tmp:
        data = Path(tmp) / "data.pt"
        make_data(data, config.vocab, config.seq, args.warmup + args.steps, args.seed)
        print(f"{name}: {len(systems)} systems x {args.repeats} repeat(s)", flush=True)
        for repeat in range(args.repeats):
            for system in systems:
                if system not in skipped:
                    runs[system].append(run_undisturbed(system, repeat, args, model, data, discarded))
    rows = [summarize(s, runs[s]) for s in systems]
    for row in rows:
        if row.system in skipped:
            row.notes.append(f"skipped: {skipped[row.system]}")
    add_ratios(rows)
    machine = {**machine, "zgraph": revision_span(revision, zgraph_revision())}
    params = next((r["params"] for rs in runs.values() for run in rs for r in run.ranks if r.get("params")), None)
    report = markdown_report(model, params, args, machine, rows)
    payload = {
        "model": model,
        "params": params,
        "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "machine": machine,
        "summary": [asdict(r) for r in rows],
        "runs": [asdict(run) for rs in runs.values() for run in rs],
        "discarded_runs": [asdict(run) for run in discarded],
    }
    stem = f"compare_{model}" + ("" if args.backend == "eager" else f"_{args.backend}")
    stem += "_kept" if args.keep_host_memory else ""
    md, js = write_outputs(stem, report, payload, args.out_dir)
    print("\n" + report)
    print(f"wrote {md.relative_to(ROOT) if md.is_relative_to(ROOT) else md} and {js.name}", flush=True)
    return report


parse_systems = systems_parser(SYSTEMS)  # the --systems argument


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("bench", "100m", "both"), default="bench")
    parser.add_argument("--backend", choices=("eager", "inductor"), default="eager", help="zgraph's backend")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (zgraph captures on the first)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="times the whole list of systems is run")
    parser.add_argument("--systems", type=parse_systems, default=list(DEFAULT_SYSTEMS), help="'all' or a comma list")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run of one system may take")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=60.0,
        help="before each run, wait up to this many seconds for other processes to leave the CPUs idle (0: off)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="run a system again, at most this many times, when other processes used the CPUs during its run",
    )
    parser.add_argument(
        "--keep-host-memory",
        action="store_true",
        help="run every system's processes with glibc keeping freed memory (GLIBC_TUNABLES, what "
        "zgraph.Config(keep_host_memory=True) sets for its own process); results go to compare_<model>_kept.*",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1 or args.retries < 0:
        parser.error("--warmup, --steps and --repeats must be at least 1, --retries at least 0")
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the ``finally`` that stops the ranks


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.keep_host_memory:  # inherited by every system's processes (base_env copies the environment)
        os.environ["GLIBC_TUNABLES"] = GLIBC_TUNABLES
    skipped: dict[str, str] = {}
    ds_version = "not run"
    if any(s in DEEPSPEED_SYSTEMS for s in args.systems):
        version, why = deepspeed_status()
        skipped.update({s: why for s in DEEPSPEED_SYSTEMS if why})
        ds_version = version or f"unavailable ({why})"
        print(f"DeepSpeed: {ds_version}", flush=True)
    machine = machine_facts(ds_version, undisturbed_probe(args))
    print(f"machine: {json.dumps(machine)}", flush=True)
    for model in ("bench", "100m") if args.model == "both" else (args.model,):
        benchmark_model(model, args.systems, args, machine, skipped)


if __name__ == "__main__":
    main()
