"""The longest sequence the ~100M GPT trains on at 1, 2 and 4 ranks under a fixed per-rank memory budget, with
Ulysses sequence parallelism over all the ranks (``Config(sequence_parallel=R)``, issue 31), ZeRO-3, micro-batch 1.

The parent estimates, running nothing: for each rank count R, ``step.estimate(..., world_size=R)`` of the step on
a slice of ``L / R`` tokens, at L doubling from ``--granularity * R`` until the estimated peak per rank passes the
budget, then bisected to a multiple of ``--granularity * R``: the longest L that fits, its estimated peak,
activation memory (``Estimate.activation_bytes``) and all-to-all bytes per step. Then R gloo ranks
(``tests/dist_harness.py``'s ``run_ranks``, with a deadline) train at that L: the first call (capture) is timed
apart, then one call measured by the live-tensor tracker (``estimate_cases.holding``: model state, optimizer
state and the batch counted before the call, everything the call allocates; its ``.peak``) beside the resident-set
high-water mark (VmHWM reset with ``/proc/self/clear_refs`` after the first call). Results are rewritten after
each rank count. Times come from one shared 2-core machine: reported, never asserted.

    python -m benchmarks.long_sequence [--budget-gib 2.5] [--ranks 1 2 4] [--granularity 128] [--timeout 1500]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import zgraph
from benchmarks.compare_worker import reset_peak_rss, status_kib
from zgraph.demos.gpt_demo import train_step
from zgraph.demos.models import GPT, GPT_100M, count_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "long_sequence")
GiB = 2**30


def config(ranks: int) -> zgraph.Config:
    return zgraph.Config(stage=3, backend="eager", sequence_parallel=ranks if ranks > 1 else None)


def build(length: int) -> tuple[GPT, torch.optim.Optimizer]:
    """The ~100M GPT with a position table of ``length`` rows, and its AdamW."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(GPT_100M, seq=length))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


# --- the parent: estimates, nothing runs -------------------------------------------------------------------------


def estimate(ranks: int, length: int) -> zgraph.Estimate:
    model, opt = build(length)
    idx = torch.zeros(1, length // ranks, dtype=torch.long)
    return zgraph.distribute(config(ranks))(train_step).estimate(model, opt, idx, idx, world_size=ranks)


def longest(ranks: int, budget: int, granularity: int) -> dict:
    """The longest multiple of ``granularity * ranks`` whose estimated peak per rank fits ``budget``."""
    unit, tried = granularity * ranks, {}

    def fits(length: int) -> bool:
        tried[length] = estimate(ranks, length)
        print(f"  {ranks} rank(s), L={length}: peak {tried[length].peak_bytes / GiB:.2f} GiB", flush=True)
        return tried[length].peak_bytes <= budget

    low, high = 0, unit
    while fits(high):
        low, high = high, 2 * high
    while high - low > unit:
        middle = (low + high) // 2 // unit * unit
        low, high = (middle, high) if fits(middle) else (low, middle)
    if not low:
        return {"ranks": ranks, "length": 0, "tried": {k: e.peak_bytes for k, e in tried.items()}}
    e = tried[low]
    return {
        "ranks": ranks,
        "length": low,
        "estimated_peak": e.peak_bytes,
        "estimated_activations": e.activation_bytes,
        "model_state_bytes": dict(e.model_state_bytes),
        "all_to_all_bytes": e.comm_bytes.get("all_to_all", 0),
        "all_to_all_count": e.comm_count.get("all_to_all", 0),
        "comm_bytes": dict(e.comm_bytes),
        "tried": {k: v.peak_bytes for k, v in sorted(tried.items())},
    }


# --- the ranks ---------------------------------------------------------------------------------------------------


def ranks_main(rank: int, world: int, out: str, length: int) -> None:
    """Worker (``run_ranks``): one step at ``length`` (capture), then one tracked; rank 0 writes every rank's
    numbers as JSON to ``out``."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_harness import all_gather_values
    from estimate_cases import holding

    model, opt = build(length)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, GPT_100M.vocab, (1, length + 1), generator=g)
    idx, tgt = zgraph.shard_sequence((tokens[:, :-1], tokens[:, 1:]), world, rank=rank)
    step = zgraph.distribute(config(world))(train_step)
    start = time.perf_counter()
    first_loss = float(step(model, opt, idx, tgt))
    first = time.perf_counter() - start
    gc.collect()
    reset_peak_rss()
    rss_before = status_kib("VmRSS") * 1024
    tracker = holding(model, opt, idx, tgt)
    start = time.perf_counter()
    with tracker:
        loss = float(step(model, opt, idx, tgt))
    mine = {
        "first_call_s": first,
        "step_s": time.perf_counter() - start,
        "losses": [first_loss, loss],
        "peak": tracker.peak,
        "rss_before": rss_before,
        "rss_hwm": status_kib("VmHWM") * 1024,
    }
    found = all_gather_values(mine)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)


def measure(ranks: int, length: int, timeout: float) -> list[dict]:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_harness import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        run_ranks(ranks, "benchmarks.long_sequence.ranks_main", out, length, timeout=timeout)
        with open(out) as f:
            return json.load(f)


# --- report ------------------------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    lines = [
        f"# Longest sequence, ~100M GPT ({results['params'] / 1e6:.0f} M parameters), ZeRO-3, micro-batch 1, "
        f"budget {results['budget'] / GiB:.2f} GiB per rank",
        "",
        f"Machine: {results['machine']}; load before: {results['load']}",
        "",
        "| ranks (= sequence parallel) | longest L | estimated peak | measured peak (tracker, max rank) "
        "| estimated activations | all-to-alls per step | all-to-all bytes | first call | tracked step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        measured = row.get("measured") or []
        peak = max((r["peak"] for r in measured), default=0)
        first = max((r["first_call_s"] for r in measured), default=0.0)
        step = max((r["step_s"] for r in measured), default=0.0)
        lines.append(
            f"| {row['ranks']} | {row['length']} | {row.get('estimated_peak', 0) / GiB:.2f} GiB | "
            f"{peak / GiB:.2f} GiB | {row.get('estimated_activations', 0) / GiB:.2f} GiB | "
            f"{row.get('all_to_all_count', 0)} | {row.get('all_to_all_bytes', 0) / 2**20:.1f} MiB | "
            f"{first:.0f} s | {step:.0f} s |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-gib", type=float, default=2.5, help="memory budget per rank (default 2.5 GiB)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--granularity", type=int, default=128, help="tokens per rank the length is a multiple of")
    parser.add_argument("--timeout", type=float, default=1500, help="deadline of each rank count's real steps")
    parser.add_argument("--no-run", action="store_true", help="estimates only")
    args = parser.parse_args(argv)
    model, _ = build(GPT_100M.seq)
    results = {
        "params": count_params(model),
        "budget": int(args.budget_gib * GiB),
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}",
        "load": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "rows": [],
    }
    del model
    for ranks in args.ranks:
        start = time.perf_counter()
        row = longest(ranks, results["budget"], args.granularity)
        row["search_s"] = time.perf_counter() - start
        if row["length"] and not args.no_run:
            row["measured"] = measure(ranks, row["length"], args.timeout)
        results["rows"].append(row)
        with open(OUT + ".json", "w") as f:
            json.dump(results, f, indent=1)
        with open(OUT + ".md", "w") as f:
            f.write(markdown(results))
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
