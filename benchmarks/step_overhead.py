"""Capture + pass time, and steady-state step time of ``@zgraph.distribute`` vs eager PyTorch, one process.

The bench GPT (4 layers, d_model 256, 4 heads, vocab 1024, seq 128, batch 8, AdamW). Eager PyTorch and the
zgraph step alternate call by call in the same process, so machine noise hits both alike; reported as ratios.

    python -m benchmarks.step_overhead [--steps 30] [--inductor]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch

import zgraph
from zgraph.demos.models import BENCH_GPT, GPT, lm_loss


def train_step(model, opt, idx, tgt):
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--inductor", action="store_true", help="also time the inductor backend")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "step_overhead.json"))
    args = parser.parse_args()

    torch.manual_seed(0)
    base = GPT(BENCH_GPT)
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randint(0, BENCH_GPT.vocab, (8, BENCH_GPT.seq), generator=g),) * 1
        + (torch.randint(0, BENCH_GPT.vocab, (8, BENCH_GPT.seq), generator=g),)
        for _ in range(4)
    ]
    runners = {}
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runners["eager PyTorch"] = (train_step, model, opt)
    setup = {}
    backends = ["eager"] + (["inductor"] if args.inductor else [])
    for backend in backends:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = zgraph.distribute(backend=backend)(train_step)
        start = time.perf_counter()
        step(model, opt, *data[0])
        first = time.perf_counter() - start
        compiled = step._dispatch.last
        passes = sum(r.seconds for r in compiled.records)
        setup[backend] = {
            "capture_s": compiled.capture_seconds,
            "passes_s": passes,
            "compile_s": compiled.executable.compile_seconds,
            "first_call_s": first,
        }
        runners[f"zgraph ({backend})"] = (step, model, opt)

    times: dict[str, list[float]] = {name: [] for name in runners}
    for fn, model, opt in runners.values():  # warm-up
        for batch in data[:2]:
            fn(model, opt, *batch)
    for i in range(args.steps):
        for name, (fn, model, opt) in runners.items():
            batch = data[i % len(data)]
            start = time.perf_counter()
            fn(model, opt, *batch)
            times[name].append(time.perf_counter() - start)
    eager = statistics.median(times["eager PyTorch"])
    rows = []
    for name, ts in times.items():
        median = statistics.median(ts)
        rows.append({"runner": name, "median_s": median, "ratio_to_eager": median / eager})
    result = {"model": "bench GPT", "threads": torch.get_num_threads(), "steps": rows, "setup": setup}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"bench GPT, batch 8 x seq 128, AdamW, {torch.get_num_threads()} threads, {args.steps} alternating steps")
    print("| runner | median step (s) | ratio to eager PyTorch |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['runner']} | {row['median_s']:.4f} | {row['ratio_to_eager']:.3f} |")
    print()
    print("| backend | capture (s) | passes (s) | compile (s) | first call (s) |")
    print("|---|---|---|---|---|")
    for backend, s in setup.items():
        cells = [s["capture_s"], s["passes_s"], s["compile_s"], s["first_call_s"]]
        print(f"| {backend} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
