"""The host update's throughput: AdamW steps on CPU tensors, in parameters per second per core, for torch's fused
and foreach CPU AdamW and DeepSpeed's ``DeepSpeedCPUAdam`` (ZeRO-Offload's host optimizer; its extension is built
just in time on first use, which needs ninja and a C++ compiler, and says so when it cannot).

    python -m benchmarks.host_adam                         # 1 and 2 threads, 2^23 parameters, 9 repeats
    python -m benchmarks.host_adam --threads 1,4 --params 16777216 --repeats 15 --json out.json

Each thread count runs in a fresh process (``OMP_NUM_THREADS`` and ``torch.set_num_threads`` both set, as
DeepSpeed's extension has an OpenMP runtime of its own). In it every optimizer holds its own copy of the same float32
parameters (``--tensors`` tensors; gradients fixed) and the optimizers step in turn, one step each per repeat after
a warm-up step, so that a slower period of the machine falls on all of them alike. Reported: seconds per step (min /
median / max), parameters per second per core (from the median) and each optimizer's speed over torch's fused one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

OPTIMIZERS = ("torch-fused", "torch-foreach", "deepspeed-cpu-adam")
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def make_optimizer(name: str, params: list) -> object:
    import torch

    if name == "deepspeed-cpu-adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER)
    return torch.optim.AdamW(params, fused=name == "torch-fused", foreach=name == "torch-foreach", **HYPER)


def measure(threads: int, count: int, tensors: int, repeats: int) -> dict:
    """In this process: every optimizer's step times on ``count`` parameters in ``tensors`` tensors."""
    import torch

    torch.set_num_threads(threads)
    sizes = [count // tensors + (i < count % tensors) for i in range(tensors)]
    generator = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=generator) for n in sizes]
    grads = [torch.randn(n, generator=generator) * 1e-3 for n in sizes]
    steps, errors = {}, {}
    for name in OPTIMIZERS:
        params = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        try:
            opt = make_optimizer(name, params)
            opt.step()  # warm-up: the states are made here
            steps[name] = (opt, [])
        except Exception as err:  # DeepSpeed absent or its extension not built: the row says why
            errors[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    for _ in range(repeats):
        for opt, times in steps.values():
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
    return {"threads": threads, "params": count, "times": {n: t for n, (_, t) in steps.items()}, "errors": errors}


def rows(result: dict) -> list[str]:
    times, threads, count = result["times"], result["threads"], result["params"]
    fused = statistics.median(times["torch-fused"]) if "torch-fused" in times else None
    out = []
    for name in OPTIMIZERS:
        if name not in times:
            out.append(f"| {threads} | {name} | — | — | — | not run: {result['errors'].get(name)} |")
            continue
        t = times[name]
        median = statistics.median(t)
        ratio = f"{fused / median:.2f}" if fused else "—"
        seconds = f"{min(t) * 1e3:.1f} / {median * 1e3:.1f} / {max(t) * 1e3:.1f}"
        out.append(f"| {threads} | {name} | {seconds} | {count / median / threads / 1e6:.1f} | {ratio} | |")
    return out


def report(results: list[dict], tensors: int, repeats: int) -> str:
    params = results[0]["params"]
    head = [
        f"AdamW on the host: {params:,} float32 parameters in {tensors} tensors, {repeats} steps after one warm-up",
        "",
        "| threads | optimizer | ms per step min / median / max | M params/s per core | vs torch fused | note |",
        "|---:|---|---|---:|---:|---|",
    ]
    return "\n".join(head + [line for r in results for line in rows(r)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="comma list of thread counts, each in a fresh process")
    parser.add_argument("--params", type=int, default=2**23)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, default=None, help="also write the measurements here")
    parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # a child: measure with this many
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.params, args.tensors, args.repeats)))
        return 0
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        command = [sys.executable, "-m", "benchmarks.host_adam", f"--one={threads}", f"--params={args.params}"]
        command += [f"--tensors={args.tensors}", f"--repeats={args.repeats}"]
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(report(results, args.tensors, args.repeats))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
