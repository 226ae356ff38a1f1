"""Cold compile: the first call of the bench GPT training step under zgraph's inductor backend and under
``torch.compile``, each in a fresh process with an empty inductor cache, systems alternated over rounds.

Systems (one process, one thread; AdamW with two parameter groups, micro-batch 8 x 128 tokens):

- ``zgraph``: ``zgraph.distribute(Config(stage=0, backend="inductor"))(train_step)``: forward, backward and the
  optimizer in one compiled graph (capture included in the time);
- ``torch.compile(step)``: ``torch.compile(train_step)``, the same whole step: dynamo compiles the forward and
  backward, breaks the graph at ``backward()``, and compiles the optimizer step;
- ``torch.compile(model)``: only the model compiled (forward and backward), the optimizer step eager: less
  compiled, so less to compile;
- ``torch.compile(model) + opt.step``: the model and ``opt.step`` compiled separately.

The first call's wall time is the cold compile (plus one step); the second call's is the step. Reported: min,
median and max over rounds, per system.

    python -m benchmarks.cold_compile [--rounds 3] [--out benchmarks/results/cold_compile.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMS = ("zgraph", "torch.compile(step)", "torch.compile(model)", "torch.compile(model) + opt.step")


def _train_step(model, opt, idx, tgt):
    from zgraph.demos.models import lm_loss

    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _build(system: str):
    """The model, its optimizer and a callable that runs one training step of ``system``."""
    import torch

    import zgraph
    from zgraph.demos.models import BENCH_GPT, GPT, lm_loss

    torch.manual_seed(0)
    model = GPT(BENCH_GPT)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    idx = torch.randint(0, BENCH_GPT.vocab, (8, BENCH_GPT.seq), generator=torch.Generator().manual_seed(1))
    if system == "zgraph":
        step = zgraph.distribute(zgraph.Config(stage=0, backend="inductor"))(_train_step)
        return lambda: step(model, opt, idx, idx)
    if system == "torch.compile(step)":
        step = torch.compile(_train_step)
        return lambda: step(model, opt, idx, idx)
    compiled = torch.compile(model)
    if system == "torch.compile(model)":
        return lambda: _train_step(compiled, opt, idx, idx)
    opt_step = torch.compile(opt.step)

    def split() -> object:
        loss = lm_loss(compiled(idx), idx)
        loss.backward()
        opt_step()
        opt.zero_grad()
        return loss.detach()

    return split


def worker(system: str) -> dict:
    """In a fresh process: the first and second call's seconds."""
    import torch

    torch.set_num_threads(1)
    run = _build(system)
    start = time.perf_counter()
    first_loss = float(run())
    first = time.perf_counter() - start
    start = time.perf_counter()
    run()
    second = time.perf_counter() - start
    return {"first_s": first, "second_s": second, "first_loss": first_loss}


def _run(system: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": cache}
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.cold_compile", "--worker", system],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=True,
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _spread(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cold_compile.json")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for round_ in range(args.rounds):
        for system in SYSTEMS if round_ % 2 == 0 else reversed(SYSTEMS):
            runs[system].append(_run(system))
            print(f"[round {round_ + 1}] {system:34s} first call {runs[system][-1]['first_s']:.1f} s", flush=True)
    base = statistics.median(r["first_s"] for r in runs["zgraph"])
    print("\n| system | first call s (min / median / max) | vs zgraph | second call s |\n|---|---:|---:|---:|")
    for system, results in runs.items():
        first = [r["first_s"] for r in results]
        print(
            f"| {system} | {_spread(first)} | {statistics.median(first) / base:.2f} "
            f"| {statistics.median(r['second_s'] for r in results):.2f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "runs": runs}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
