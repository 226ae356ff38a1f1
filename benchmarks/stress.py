"""Looking for native crashes: zgraph's multi-rank programs in a loop, every non-zero exit recorded with its signal
and stack (not part of the test suite).

    python -m benchmarks.stress --minutes 30 --load --malloc-check --out   # all cases, one busy core
    python -m benchmarks.stress --cases gpt,exit --rounds 5

Each round runs every case of ``--cases`` once (default all of ``CASES``): ``zgraph demo``; the parity cases
(``tests/zero_cases``) at worlds 2 and 4; split steps; stage-3 steps with parameters and states in files (nvme);
the stage-3 bf16 GPT with a global-norm clip whose ranks end through the interpreter's exit (the CI SIGABRT);
``tests/exit_program.py`` (ten 2-rank runs of a program that never destroys its group). Rounds repeat until
``--rounds`` or ``--minutes`` is reached (no run starts after it; Ctrl-C ends early, with a summary). Every process
runs with ``PYTHONFAULTHANDLER=1`` (a fatal signal prints every thread's Python stack), core files allowed
(``RLIMIT_CORE``) in a directory of its own; ``--malloc-check`` adds ``MALLOC_CHECK_=3`` and a random
``MALLOC_PERTURB_`` (glibc's heap checks; the byte is in the record); ``--load`` keeps one busy-loop process
running throughout (the other core loaded). A failed run is classified by the signal faulthandler, torch's launcher
or the exit status names, its log kept, and, where it left a core file and ``gdb`` exists, the crashing thread's
``bt`` saved beside it. The summary table (runs, clean, failures by signal per case) is printed; ``--out`` writes
it with every failure's stack to ``benchmarks/results/stress-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CASES: dict[str, list[str]] = {
    "demo": [PY, "-m", "zgraph.cli", "demo", "--steps", "40"],
    "parity-2": [PY, "-m", "benchmarks.stress_cases", "parity", "2"],
    "parity-4": [PY, "-m", "benchmarks.stress_cases", "parity", "4"],
    "split-2": [PY, "-m", "benchmarks.stress_cases", "split", "2"],
    "offload-2": [PY, "-m", "benchmarks.stress_cases", "offload", "2"],
    "gpt": [PY, "-m", "benchmarks.stress_cases", "gpt", "100"],
    "exit": [PY, str(ROOT / "tests" / "exit_program.py"), "10"],
}
FAULTHANDLER_NAMES = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
NATIVE_MESSAGE = re.compile(r"^(terminate called.*|malloc\(\).*|free\(\).*|munmap_chunk.*|double free.*|corrupted .*)$")


@dataclass
class Run:
    case: str
    seconds: float
    returncode: int | None  # None: killed at the deadline
    kind: str  # "clean", a signal name, "exit N" or "timeout"
    perturb: int | None
    log: Path
    stack: str = ""


def signal_of(text: str, returncode: int | None) -> str:
    """What ended a run: the signal its log names (faulthandler, torch's launcher, exit_program's statuses),
    else its exit status."""
    if returncode == 0:
        return "clean"
    if returncode is None:
        return "timeout"
    found = re.search(r"Fatal Python error: ([A-Za-z ]+)", text)
    if found and found.group(1).strip() in FAULTHANDLER_NAMES:
        return FAULTHANDLER_NAMES[found.group(1).strip()]
    found = re.search(r"terminated with signal (SIG\w+)", text) or re.search(r"^run \d+: .*?-(\d+)\b", text, re.M)
    if found:
        name = found.group(1)
        return name if name.startswith("SIG") else signal.Signals(int(name)).name
    return f"signal {-returncode}" if returncode < 0 else f"exit {returncode}"


def stack_of(text: str) -> str:
    """The native message (glibc's, the C++ runtime's) and the first faulthandler block of a log, if any."""
    lines = text.splitlines()
    native = [line for line in lines if NATIVE_MESSAGE.match(line.strip())][:3]
    start = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    block = lines[start : start + 40] if start is not None else lines[-25:]
    return "\n".join(native + block)


def core_backtraces(directory: Path) -> str:
    """``bt`` of the crashing thread of every core file under ``directory`` (the cores are then removed)."""
    found = []
    for core in sorted(directory.rglob("core*")):
        if not core.is_file():
            continue
        if shutil.which("gdb"):
            command = ["gdb", "-batch", "-q", "-ex", "bt 30", PY, str(core)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            found.append(f"gdb bt of {core.name}:\n{result.stdout[-6000:]}")
        core.unlink()
    return "\n".join(found)


def allow_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_once(case: str, args: argparse.Namespace, logs: Path, number: int) -> Run:
    directory = Path(tempfile.mkdtemp(prefix=f"{case}-{number}-", dir=logs))
    env = dict(os.environ, PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    perturb = random.randint(1, 255) if args.malloc_check else None
    if perturb is not None:
        env.update(MALLOC_CHECK_="3", MALLOC_PERTURB_=str(perturb))
    log = directory / "log.txt"
    start = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(
            CASES[case],
            cwd=directory,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=allow_cores,
            start_new_session=True,
        )
        try:
            returncode: int | None = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process)
            returncode = None
        except KeyboardInterrupt:  # its own session: Ctrl-C does not reach it
            kill_tree(process)
            raise
    text = log.read_text(errors="replace")
    run = Run(case, time.monotonic() - start, returncode, signal_of(text, returncode), perturb, log)
    if run.kind != "clean":
        run.stack = "\n".join(s for s in (stack_of(text), core_backtraces(directory)) if s)
    else:
        shutil.rmtree(directory, ignore_errors=True)
    return run


def kill_tree(process: subprocess.Popen) -> None:
    """End a run that overran its deadline and every process it started (its session)."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def summary_table(runs: list[Run]) -> str:
    rows = ["| case | runs | clean | failures by signal | mean s |", "|---|---|---|---|---|"]
    for case in dict.fromkeys(run.case for run in runs):
        mine = [run for run in runs if run.case == case]
        failures = Counter(run.kind for run in mine if run.kind != "clean")
        text = ", ".join(f"{kind} {count}" for kind, count in sorted(failures.items())) or "-"
        mean = sum(run.seconds for run in mine) / len(mine)
        rows.append(f"| {case} | {len(mine)} | {len(mine) - sum(failures.values())} | {text} | {mean:.0f} |")
    return "\n".join(rows)


def report(runs: list[Run], args: argparse.Namespace, minutes: float) -> str:
    head = (
        f"# Stress {datetime.date.today()}\n\n`python -m benchmarks.stress {' '.join(sys.argv[1:])}`: "
        f"{minutes:.1f} minutes, load {'one busy core' if args.load else 'none added'}, "
        f"malloc checks {'on' if args.malloc_check else 'off'}, code at `{args.head}`.\n\n"
    )
    failures = [
        f"## {run.case}: {run.kind} ({run.seconds:.0f} s, MALLOC_PERTURB_={run.perturb}, log {run.log})\n\n"
        f"```\n{run.stack}\n```\n"
        for run in runs
        if run.kind != "clean"
    ]
    return head + summary_table(runs) + "\n\n" + "\n".join(failures)


def git_head() -> str:
    result = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() or "?"


def start_load() -> subprocess.Popen:
    return subprocess.Popen([PY, "-c", "while True: pass"])


def loop(args: argparse.Namespace, runs: list[Run], deadline: float) -> None:
    """Rounds of every case until ``args.rounds`` of them ran or ``deadline`` (no run starts after it)."""
    for _ in range(args.rounds):
        for case in args.cases.split(","):
            if time.monotonic() > deadline:
                return
            runs.append(run_once(case, args, args.logs, len(runs)))
            print(f"{case}: {runs[-1].kind} ({runs[-1].seconds:.0f} s)", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=1000, help="rounds of every case (at most)")
    parser.add_argument("--minutes", type=float, default=30.0, help="no new run starts after this")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (then killed)")
    parser.add_argument("--load", action="store_true", help="keep one busy-loop process running")
    parser.add_argument("--malloc-check", action="store_true", help="MALLOC_CHECK_=3 and MALLOC_PERTURB_")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "zgraph-stress")
    parser.add_argument("--out", nargs="?", const=ROOT / "benchmarks" / "results", type=Path, help="write here")
    args = parser.parse_args(argv)
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.head = git_head()  # the code the runs ran, before anything changes
    args.logs.mkdir(parents=True, exist_ok=True)
    load = start_load() if args.load else None
    runs: list[Run] = []
    start = time.monotonic()
    try:
        loop(args, runs, start + args.minutes * 60)
    except KeyboardInterrupt:
        print("interrupted: the runs so far", flush=True)
    finally:
        if load is not None:
            load.kill()
            load.wait()
    text = report(runs, args, (time.monotonic() - start) / 60)
    print(summary_table(runs))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"stress-{datetime.date.today()}.md"
        with open(path, "a") as f:
            f.write(text + "\n")
        print(f"written to {path}")


if __name__ == "__main__":
    main()
