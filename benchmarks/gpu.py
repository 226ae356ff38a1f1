"""The GPU check in one command: zgraph's GPU tests, then a side-by-side table on a ~1B Llama, then one GPU whose
AdamW states do not fit next to the model (optimizer offload), within one time budget.

    python -m benchmarks.gpu                      # everything that fits in --budget (540 s: one 10-minute call)
    python -m benchmarks.gpu --parts table,offload --budget 1800 --steps 20
    python -m benchmarks.gpu --dry-run            # the summary and tables from made-up numbers (any machine)
    python -m benchmarks.gpu --kit DIR --parts offload   # issue 43's run: the kit installed, the offload rows

``--kit DIR`` first installs the GPU kit (``benchmarks.gpu_kit``: DeepSpeed and what it needs, offline; zgraph from
this checkout, editable); a kit that does not install is reported and the run goes on without it.

Parts, run in ``PLAN``'s order (tests first, then the eager systems of both tables, the compiled ones last); an
item that does not fit in what is left of ``--budget`` is skipped, and said so, as is a system that does not
install (DeepSpeed, Triton for inductor):

- ``tests``: ``python -m pytest tests/gpu`` (quick form unless ``--full-tests``: stages 0 and 3; the tests report
  their measured distances and the estimate's ratio to ``max_memory_allocated``);
- ``table``: DDP, FSDP2 (eager and ``torch.compile``), DeepSpeed ZeRO-3 and ZeRO-Offload, zgraph (eager and
  inductor, ZeRO-3) on a ~1.1B Llama (``benchmarks.gpu_worker.LLAMA_1B``), one rank per GPU: step time
  (min / median / max over ``--steps`` after ``--warmup``), tokens/s, peak device memory (``max_memory_allocated``);
- ``offload``: one GPU; the model sized so that parameters and gradients take ``OFFLOAD_SHARE`` of the device
  memory available (``torch.cuda.mem_get_info``, capped by ``--offload-device-gib``) and its AdamW states (as large
  again) do not fit beside them: zgraph's update on the host (``offload_update="host"``), DeepSpeed ZeRO-Offload
  (its CPU Adam where that builds, else torch's CPU AdamW, said in the row), zgraph's host update one step late
  (``offload_overlap="one_step"``), FSDP2 with ``CPUOffloadPolicy``, zgraph ``offload_optimizer="cpu"`` with the
  update on the device; same batches; each row with tokens/s, device and host peaks and the bytes over PCIe of one
  step (profiled: ``benchmarks.gpu_pcie``); zgraph's exact update over DeepSpeed in tokens/s (target: at least 1.5).
  A zgraph without ``Config.offload_update`` / ``offload_overlap`` skips those rows, saying so.

Each system runs in its own processes (``benchmarks.gpu_worker``) with a timeout, so a failure or an OOM ends only
its row. Results: ``<out-dir>/gpu-<card>-<date>.json`` (default ``benchmarks/results``) and a Markdown table on
stdout (both made by ``benchmarks.gpu_report``). The exit status is 1 when a test failed or a zgraph system failed
(a peer's failure is only reported). Without CUDA it prints "no CUDA device: nothing run" and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.compare_machine import free_port, last_lines, terminate, wait_ranks
from benchmarks.gpu_machine import COMPILED, DEEPSPEED, install_kit, machine_facts, probe_gpus, unavailable
from benchmarks.gpu_report import (
    GIB,
    LABELS,
    OFFLOAD_REFERENCE,
    OFFLOAD_TARGET,
    TABLE_REFERENCE,
    Row,
    add_ratios,
    failed_checks,
    offload_verdict,
    report,
    summarize,
    tests_lines,
    write_result,
)
from benchmarks.gpu_worker import SYSTEMS, model_config, params_of

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("tests", "table", "offload")
OFFLOAD_SHARE = 0.55  # parameters + gradients (8 bytes per parameter) take this share of the device memory
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Item:
    """One thing to run: ``part`` (``tests``, ``table``, ``offload``), ``system`` (a worker system, or the tests),
    at least ``min_s`` seconds left to start it, at most ``cap_s`` seconds."""

    part: str
    system: str
    min_s: float
    cap_s: float


PLAN = (
    Item("tests", "tests/gpu", 90, 300),
    Item("offload", "zgraph-host", 60, 240),
    Item("offload", "deepspeed-offload", 120, 300),  # its CPU Adam is built first (about a minute on 16 cores)
    Item("offload", "zgraph-host-overlap", 60, 240),
    Item("offload", "fsdp2-offload", 60, 240),
    Item("offload", "zgraph-offload", 60, 240),
    Item("table", "ddp", 40, 180),
    Item("table", "zgraph-eager", 60, 240),
    Item("table", "fsdp2", 40, 180),
    Item("table", "deepspeed-z3", 60, 240),
    Item("table", "deepspeed-offload", 90, 300),
    Item("table", "zgraph-inductor", 150, 420),
    Item("table", "fsdp2-compiled", 120, 360),
)


# ------------------------------------------------------------------------------------------------ machine
def deepspeed_version(timeout: float = 120) -> tuple[str | None, str | None]:
    """``(version, None)`` where ``import deepspeed`` works in a fresh process, else ``(None, why)``."""
    if importlib.util.find_spec("deepspeed") is None:
        return None, "DeepSpeed is not installed (pip install deepspeed)"
    code = "import deepspeed; print(deepspeed.__version__)"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env())
    except subprocess.TimeoutExpired:
        return None, f"`import deepspeed` took more than {timeout:.0f} s"
    if proc.returncode != 0:
        return None, "`import deepspeed` failed: " + last_lines(proc.stderr, 1)
    return proc.stdout.strip().splitlines()[-1], None


def offload_sizing(gpus: dict[str, Any], cap_gib: float) -> dict[str, Any]:
    """The offload case's model: decoder layers such that parameters and gradients (8 bytes per parameter) take
    ``OFFLOAD_SHARE`` of the memory available (free memory, capped at ``cap_gib`` when given); AdamW's two states
    (8 bytes per parameter more) then do not fit beside them."""

    usable = gpus["free"] if not cap_gib else min(gpus["free"], int(cap_gib * GIB))
    base, per_layer = params_of(model_config(0)), params_of(model_config(1)) - params_of(model_config(0))
    layers = max(1, int((OFFLOAD_SHARE * usable / 8 - base) // per_layer))
    params = params_of(model_config(layers))
    where = f"{usable / GIB:.1f} GiB of device memory" + (f" (allocator capped at {cap_gib:g} GiB)" if cap_gib else "")
    text = (
        f"{params / 1e9:.2f} B parameters ({layers} layers); parameters + gradients {8 * params / GIB:.1f} GiB, "
        f"AdamW states {8 * params / GIB:.1f} GiB; {where}"
    )
    return {"layers": layers, "params": params, "usable_bytes": usable, "cap_gib": cap_gib, "text": text}


# ------------------------------------------------------------------------------------------------ processes
def env(rank: int = 0, world: int = 1, port: int = 0, threads: int = 1) -> dict[str, str]:
    """A system's process environment: torchrun's variables, the repository importable, CUDA DeepSpeed."""
    out = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    out.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        PYTHONUNBUFFERED="1",
        DS_ACCELERATOR="cuda",
        OMP_NUM_THREADS=str(threads),
    )
    if port:
        out.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    return out


def launch(commands: list[list[str]], run_dir: Path, timeout: float) -> str | None:
    """One process per rank (each leads its own session; output to ``rank<r>.log``); None if all exited 0, else
    why not. No process outlives this call."""
    world, port = len(commands), free_port()
    threads = max(1, (os.cpu_count() or 1) // world)  # DeepSpeed's CPU Adam and FSDP2's host optimizer use them
    procs: list[subprocess.Popen] = []
    try:
        for rank, cmd in enumerate(commands):
            with open(run_dir / f"rank{rank}.log", "w") as log:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env(rank, world, port, threads),
                        cwd=ROOT,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        return wait_ranks(procs, timeout)
    finally:
        terminate(procs)


def run_system(item: Item, args: argparse.Namespace, world: int, layers: int | None, timeout: float, tmp: Path) -> Row:
    """One system in fresh processes; its row."""
    run_dir = tmp / f"{item.part}-{item.system}"
    run_dir.mkdir()
    options = [
        f"--system={item.system}",
        f"--micro-batch={args.offload_micro_batch if item.part == 'offload' else args.micro_batch}",
        f"--seq={args.seq}",
        f"--warmup={args.warmup}",
        f"--steps={args.steps}",
        f"--precision={args.precision}",
        f"--lr={args.lr}",
    ]
    if layers is not None:
        options.append(f"--layers={layers}")
    if item.part == "offload":
        options += ["--pcie", *([f"--memory-cap-gib={args.offload_device_gib}"] if args.offload_device_gib else [])]
    commands = [
        [sys.executable, "-m", "benchmarks.gpu_worker", *options, f"--out={run_dir / f'rank{r}.json'}"]
        for r in range(world)
    ]
    start = time.perf_counter()
    why = launch(commands, run_dir, timeout)
    wall = time.perf_counter() - start
    ranks, lost = [], []
    for r in range(world):
        path = run_dir / f"rank{r}.json"
        if path.exists():
            ranks.append(json.loads(path.read_text()))
        else:
            log = (run_dir / f"rank{r}.log").read_text(errors="replace")
            lost.append(f"rank {r} wrote no result; log tail:\n{last_lines(log, 10)}")
    error = "\n".join(e for e in (*lost, why) if e) or None
    if why and "timed out" in why:
        error = f"{why} (the system's time limit: what was left of --budget, at most {item.cap_s:.0f} s)"
    return summarize(item.part, item.system, ranks, error, wall)


def run_tests(args: argparse.Namespace, timeout: float, tmp: Path) -> dict[str, Any]:
    """``python -m pytest tests/gpu``, quick unless ``--full-tests``; counts, failures and what they reported."""
    records_path = tmp / "tests.jsonl"
    environment = env()
    environment["ZGRAPH_GPU_REPORT"] = str(records_path)
    if not args.full_tests:
        environment["ZGRAPH_GPU_QUICK"] = "1"
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rfEs", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    log_path = tmp / "tests.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            why = wait_ranks([proc], timeout)
        finally:
            terminate([proc])
    output = log_path.read_text(errors="replace")
    summary = next(
        (
            line.strip("= ")
            for line in reversed(output.splitlines())
            if re.search(r"\d+ (passed|failed|errors?|skipped)\b.* in [\d.]+s", line)
        ),
        None,
    )
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    records = [json.loads(line) for line in records_path.read_text().splitlines()] if records_path.exists() else []
    status = "ok" if why is None else "failed"
    return {
        "status": status,
        "why": why if why is None or "timed out" not in why else f"{why}: the run was stopped",
        "summary": summary,
        "failed": failed,
        "records": records,
        "wall_s": time.perf_counter() - start,
        "output_tail": last_lines(output, 60),
    }


# ------------------------------------------------------------------------------------------------ driver
def execute(args: argparse.Namespace, gpus: dict[str, Any], skip: dict[str, str], tmp: Path, started: float) -> dict:
    """Run ``PLAN``'s items of ``args.parts`` in order, within ``args.budget`` seconds from ``started``."""
    sizing = offload_sizing(gpus, args.offload_device_gib)
    tests: dict[str, Any] = {"status": "skipped", "why": "not asked for (--parts)"}
    rows: dict[str, list[Row]] = {"table": [], "offload": []}
    for item in PLAN:
        if item.part not in args.parts or (item.part != "tests" and item.system not in args.systems):
            continue
        left = args.budget - (time.monotonic() - started)
        why = skip.get(item.system) if item.part != "tests" else None
        if why is None and left < item.min_s:
            why = f"not enough of --budget left ({left:.0f} s; it needs at least {item.min_s:.0f} s)"
        label = f"{item.part}: {LABELS.get(item.system, item.system)}"
        if why is not None:
            print(f"[skip] {label}: {why}", flush=True)
            if item.part == "tests":
                tests = {"status": "skipped", "why": why}
            else:
                rows[item.part].append(Row(item.part, item.system, why=why))
            continue
        timeout = min(item.cap_s, left)
        print(f"[run ] {label} (at most {timeout:.0f} s)", flush=True)
        if item.part == "tests":
            tests = run_tests(args, timeout, tmp)
            print("       " + "\n       ".join(tests_lines(tests)), flush=True)
            continue
        world = 1 if item.part == "offload" else gpus["count"]
        layers = sizing["layers"] if item.part == "offload" else None
        row = run_system(item, args, world, layers, timeout, tmp)
        rows[item.part].append(row)
        print(f"       {row.status}: " + (f"{row.tokens_per_s:,.0f} tokens/s" if row.status == "ok" else str(row.why)))
    return summary(tests, rows, sizing)


def summary(tests: dict, rows: dict[str, list[Row]], sizing: dict) -> dict:
    """The report's parts: the test run, the table and the offload rows with their ratios and verdict."""
    for part, reference in (("table", TABLE_REFERENCE), ("offload", OFFLOAD_REFERENCE)):
        add_ratios(rows[part], reference)
    ratio, verdict = offload_verdict(rows["offload"])
    return {
        "tests": tests,
        "table": {"rows": [asdict(r) for r in rows["table"]]},
        "offload": {
            "sizing": sizing,
            "rows": [asdict(r) for r in rows["offload"]],
            "zgraph_over_deepspeed": ratio,
            "target": OFFLOAD_TARGET,
            "verdict": verdict,
        },
    }


# made-up bytes over PCIe per parameter per step of the dry run's offload rows
DRY_PCIE = {"zgraph-host": 8, "zgraph-host-overlap": 8, "deepspeed-offload": 4, "fsdp2-offload": 12}
DRY_PCIE["zgraph-offload"] = 24


def dry_run(args: argparse.Namespace) -> dict:
    """The whole summary from made-up numbers: the formatting and the JSON, on any machine."""

    gpus = {"card": "DRY RUN (made-up numbers)", "count": 1, "total": 80 * GIB, "free": 79 * GIB, "cuda": "-"}
    gpus["torch"] = "-"
    sizing = offload_sizing(gpus, args.offload_device_gib)
    rows: dict[str, list[Row]] = {"table": [], "offload": []}
    for n, item in enumerate(PLAN):
        if item.part == "tests":
            continue
        if item.system in COMPILED:
            rows[item.part].append(Row(item.part, item.system, why="made up: skipped for the dry run"))
            continue
        layers = sizing["layers"] if item.part == "offload" else 16
        steps = [0.1 * (1 + n / 10) * (1 + i / 100) for i in range(args.steps)]
        rank = {
            "world_size": 1,
            "params": params_of(model_config(layers)),
            "layers": layers,
            "precision": args.precision,
            "tokens_per_step": args.micro_batch * args.seq,
            "step_s": steps,
            "warmup_s": [5.0 + n],
            "warmup_losses": [5.6],
            "losses": [5.0 - n / 100],
            "peak_bytes": (20 + n) * GIB,
            "warmup_peak_bytes": (21 + n) * GIB,
            "peak_rss_mib": 4096.0 * (n + 1),
            "memory_cap_bytes": int(args.offload_device_gib * GIB) if item.part == "offload" else None,
        }
        if item.part == "offload":
            rank["pcie_bytes"] = {"host_to_device": DRY_PCIE[item.system] * rank["params"] // 2}
            rank["pcie_bytes"]["device_to_host"] = rank["pcie_bytes"]["host_to_device"]
        if item.system == "deepspeed-offload":
            rank["notes"] = ["host optimizer: DeepSpeedCPUAdam"]
        error = "RuntimeError: made up: CUDA out of memory" if item.system == "fsdp2" else None
        rows[item.part].append(summarize(item.part, item.system, [rank], error, 30.0 + n))
    record = {"test": "estimate[nccl-1-z0-fp32]", "ratio": 0.98, "raw_ratio": 0.95, "estimated_mib": 980.0}
    record.update(measured_mib=1000.0, outside_mib=40.0)
    tests = {"status": "ok", "summary": "60 passed, 15 skipped in 120.00s", "failed": [], "records": [record]}
    tests["wall_s"] = 120.0
    return {"machine": machine_facts(gpus, "-"), **summary(tests, rows, sizing)}


def parse_systems(text: str) -> list[str]:
    wanted = list(SYSTEMS) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SYSTEMS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    return wanted


def parse_parts(text: str) -> list[str]:
    wanted = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    return wanted


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=parse_parts, default=list(PARTS), help="comma list of tests,table,offload")
    parser.add_argument("--systems", type=parse_systems, default=list(SYSTEMS), help="'all' or a comma list")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for everything (default: one 10-min call)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (zgraph captures on the first)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per system")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step (the table)")
    parser.add_argument("--offload-micro-batch", type=int, default=2, help="sequences per step (the offload case)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--precision", choices=("autocast", "fp32"), default="autocast")
    parser.add_argument(
        "--offload-device-gib",
        type=float,
        default=16.0,
        help="device memory the offload case may use (the allocator is capped there and the model sized from it; "
        "default 16, so that the case runs in minutes; 0: all the free memory)",
    )
    parser.add_argument("--full-tests", action="store_true", help="every stage in tests/gpu (else stages 0 and 3)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--kit", type=Path, default=None, help="install this GPU kit first (benchmarks.gpu_kit)")
    parser.add_argument("--dry-run", action="store_true", help="made-up numbers through the summary; writes nothing")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the ``finally`` blocks that stop the systems' processes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    if args.dry_run:
        result = {**dry_run(args), "settings": settings, "elapsed_s": 0.0}
        with tempfile.TemporaryDirectory() as tmp:  # the JSON path too, never into benchmarks/results
            written = write_result(result, Path(tmp))
            assert json.loads(written.read_text())["machine"]["card"] == result["machine"]["card"]
        print(report(result))
        print("\ndry run: made-up numbers, nothing written")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing run (python -m benchmarks.gpu --dry-run shows the report's form)")
        return 0
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.monotonic()
    kit = install_kit(args.kit) if args.kit else "not given"
    gpus = probe_gpus()
    ds_version, ds_why = deepspeed_version() if any(s in DEEPSPEED for s in args.systems) else ("not run", None)
    machine = machine_facts(gpus, f"unavailable ({ds_why})" if ds_why else str(ds_version))
    machine["kit"] = kit
    print(f"machine: {json.dumps(machine)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="zgraph-gpu-") as tmp:
        parts = execute(args, gpus, unavailable(ds_why), Path(tmp), started)
    result = {"machine": machine, "settings": settings, **parts, "elapsed_s": time.monotonic() - started}
    text = report(result)
    result["markdown"] = text
    path = write_result(result, args.out_dir)
    print("\n" + text)
    print(f"\nwrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 1 if failed_checks(result) else 0


if __name__ == "__main__":
    raise SystemExit(main())
