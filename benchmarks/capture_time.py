"""Where a step's first call goes: the trace, functionalization, each pass, lowering, the first run.

Two cases, each in a fresh process (one thread per rank, the eager backend, AdamW):

- ``gpt2``: Hugging Face GPT-2 (12 layers, n_embd 256, 4 heads, vocab 1000), one process, a batch of 4 x 64
  tokens (needs ``transformers``: the ``hf`` extra);
- ``100m``: the ~100M GPT of ``benchmarks.compare`` (``GPT_100M``), 2 gloo ranks, ZeRO stage 3, 1 x 64 tokens
  per rank (rank 0's times).

The first call's wall time is split into: ``trace`` (the step traced on fake tensors, every trace the capture
made, functionalized as it runs), ``functionalize`` (the functional graph finished: named, random layout, phases),
the rest of the capture (binding, first optimizer state), each pass of the pass list, ``lowering`` (the backend's
rewrites and compilation), ``first run`` (running
the graph the first time, state read and written back) and the rest. Also its CPU time (rank 0's: less sensitive
to other load on the machine), and the second call's wall time (the steady step).

    python -m benchmarks.capture_time [--cases gpt2,100m] [--rounds 1] [--out benchmarks/results/capture_time.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CASES = ("gpt2", "100m")
WORLD = {"gpt2": 1, "100m": 2}
TIMED = {  # (module, attribute) wrapped with a timer -> the row it adds to
    ("zgraph.capture.protocol", "trace_step"): "trace",
    ("zgraph.capture.protocol", "trace_joint"): "trace",
    ("zgraph.capture.protocol", "functional_step"): "functionalize",
    ("zgraph.compile.build", "lower"): "lowering",
    ("zgraph.dispatch", "run"): "run",
}


@contextlib.contextmanager
def timers(totals: dict[str, list[float]]) -> Iterator[None]:
    """Each function of ``TIMED`` wrapped: the seconds of each of its calls appended to ``totals[row]``."""
    import importlib

    saved = []
    for (module_name, attribute), row in TIMED.items():
        module = importlib.import_module(module_name)
        original = getattr(module, attribute)

        @functools.wraps(original)
        def timed(*args: Any, _original: Callable = original, _row: str = row, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_row].append(time.perf_counter() - start)

        saved.append((module, attribute, original))
        setattr(module, attribute, timed)
    try:
        yield
    finally:
        for module, attribute, original in saved:
            setattr(module, attribute, original)


def _gpt2() -> tuple[Callable[[], object], Any]:
    """HF GPT-2 with AdamW, one process; returns (one call of the zgraph step, the step)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    import zgraph

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=256, n_head=4, vocab_size=1000, n_positions=512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(model: Any, opt: Any, ids: Any) -> Any:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    zstep = zgraph.distribute(zgraph.Config(backend="eager"))(step)
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(1))
    return lambda: zstep(model, opt, ids), zstep


def _gpt_100m() -> tuple[Callable[[], object], Any]:
    """The ~100M GPT with AdamW, ZeRO stage 3 on this rank's group; returns (one call, the step)."""
    import torch

    import zgraph
    from benchmarks.compare_worker import MODELS, adamw, train_step
    from zgraph.demos.models import GPT

    config = MODELS["100m"]
    torch.manual_seed(0)
    model = GPT(config)
    opt = adamw(model, 1e-3)
    zstep = zgraph.distribute(zgraph.Config(stage=3, backend="eager"))(train_step)
    rank = int(os.environ.get("RANK", "0"))
    idx = torch.randint(0, config.vocab, (1, 64), generator=torch.Generator().manual_seed(rank))
    return lambda: zstep(model, opt, idx, idx), zstep


def measure(case: str) -> dict:
    """In this process (one rank): the first call's split and the second call's seconds."""
    import torch

    torch.set_num_threads(1)
    call, zstep = _gpt2() if case == "gpt2" else _gpt_100m()
    totals: dict[str, list[float]] = defaultdict(list)
    with timers(totals):
        start, cpu = time.perf_counter(), time.process_time()
        call()
        first, first_cpu = time.perf_counter() - start, time.process_time() - cpu
        start = time.perf_counter()
        call()
        second = time.perf_counter() - start
    compiled = zstep._compiled()
    passes = {r.name: r.seconds for r in compiled.records}
    capture = compiled.capture_seconds
    trace, functional = sum(totals["trace"]), sum(totals["functionalize"])
    rows = {
        "trace": trace,
        "functionalize": functional,
        "capture, rest": capture - trace - functional,
        **{f"pass {name}": seconds for name, seconds in passes.items()},
        "lowering": sum(totals["lowering"]),
        "first run": totals["run"][0],
    }
    rows["rest"] = first - sum(rows.values())
    return {
        "case": case,
        "world": WORLD[case],
        "traces": len(totals["trace"]),
        "first_s": first,
        "first_cpu_s": first_cpu,
        "second_s": second,
        "second_run_s": totals["run"][1],
        "rows": rows,
    }


def _rank(rank: int, port: int, case: str, out: str) -> None:
    if WORLD[case] > 1:  # one process: no process group (zgraph would start one of size 1 from these)
        world = str(WORLD[case])
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=world)
    result = measure(case)
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(case: str) -> dict:
    """``case`` in fresh processes (one per rank); rank 0's result."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "result.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        code = (
            "import sys, torch.multiprocessing as mp; from benchmarks.capture_time import _rank; "
            f"mp.start_processes(_rank, args=({_free_port()}, {case!r}, {out!r}), nprocs={WORLD[case]}, "
            "start_method='spawn')"
        )
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
        return json.loads(Path(out).read_text())


def minimum(runs: list[dict]) -> dict:
    """Each number's minimum over ``runs`` of one case (other load on the machine only adds time)."""
    best = {k: min(r[k] for r in runs) if isinstance(v, float) else v for k, v in runs[0].items()}
    best["rows"] = {name: min(r["rows"][name] for r in runs) for name in runs[0]["rows"]}
    return best


def table(results: list[dict]) -> str:
    """The split of each case's first call, one column per case, in seconds."""
    names = list(dict.fromkeys(name for r in results for name in r["rows"]))
    head = " | ".join(f"{r['case']} ({r['world']} rank{'s' if r['world'] > 1 else ''})" for r in results)
    lines = [f"| first call, s | {head} |", "|---|" + "---:|" * len(results)]
    for name in names:
        cells = " | ".join(f"{r['rows'][name]:.3f}" if name in r["rows"] else "-" for r in results)
        lines.append(f"| {name} | {cells} |")
    totals = (("**first call**", "first_s"), ("first call, CPU s", "first_cpu_s"), ("second call", "second_s"))
    for label, key in totals:
        lines.append(f"| {label} | " + " | ".join(f"{r[key]:.3f}" for r in results) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=1, help="runs per case; each row's minimum is reported")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "capture_time.json")
    args = parser.parse_args(argv)
    results, runs = [], []
    for case in args.cases.split(","):
        if case not in CASES:
            parser.error(f"unknown case {case!r}; choose from {', '.join(CASES)}")
        for _ in range(args.rounds):
            runs.append(run_case(case))
            print(f"{case}: first call {runs[-1]['first_s']:.2f} s, second {runs[-1]['second_s']:.2f} s", flush=True)
        results.append(minimum(runs[-args.rounds :]))
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"minimum": results, "runs": runs}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
