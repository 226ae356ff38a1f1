"""What verifying checkpoints costs: ``zgraph.save`` / ``zgraph.load`` / ``zgraph.consolidate`` of the ~100M GPT
with AdamW state, with and without the sha256 of every file, one process.

    python -m benchmarks.checkpoint_cost [--model 100m|bench] [--repeats 3] [--dir /tmp]

"Save without checksums" replaces the sha256 by a size-only entry (what a save would cost if it wrote no
checksums: the checkpoint it writes then only loads with ``verify=False``); "load without verification" is
``zgraph.load(..., verify=False)`` (sizes are still checked). Files are read back from the page cache right
after being written, as a resume on the same machine would; a cold read from disk adds the same read time to
the DCP read and to the hash alike. Prints a Markdown table (median of ``--repeats`` runs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

import zgraph
from zgraph.checkpoint import io as checkpoint_io
from zgraph.demos.models import BENCH_GPT, GPT, GPT_100M, count_params


def _state(config) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # creates exp_avg, exp_avg_sq, step
    opt.zero_grad(set_to_none=True)
    return model, opt


def _median(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _size_only(file: str) -> dict:
    return {"size": os.path.getsize(file), "sha256": ""}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["100m", "bench"], default="100m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args(argv)
    config = GPT_100M if args.model == "100m" else BENCH_GPT
    model, opt = _state(config)
    work = tempfile.mkdtemp(prefix="zgraph_ckpt_cost_", dir=args.dir)
    path = os.path.join(work, "ck")
    try:
        rows = []
        save_on = _median(lambda: zgraph.save(path, model, opt), args.repeats)
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
        real_digest = checkpoint_io.digest
        checkpoint_io.digest = _size_only
        try:
            save_off = _median(lambda: zgraph.save(path + "-nosum", model, opt), args.repeats)
        finally:
            checkpoint_io.digest = real_digest
        rows.append(("save", save_off, save_on))
        fresh, fresh_opt = _state(config)
        load_off = _median(lambda: zgraph.load(path, fresh, fresh_opt, verify=False), args.repeats)
        load_on = _median(lambda: zgraph.load(path, fresh, fresh_opt), args.repeats)
        rows.append(("load", load_off, load_on))
        out = os.path.join(work, "model.pt")
        cons_off = _median(lambda: zgraph.consolidate(path, out, verify=False), args.repeats)
        cons_on = _median(lambda: zgraph.consolidate(path, out), args.repeats)
        rows.append(("consolidate", cons_off, cons_on))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{args.model}: {count_params(model) / 1e6:.1f} M parameters, AdamW state; checkpoint {size / 2**30:.2f} GiB; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}\n"
    )
    print("| operation | without checksums (s) | with sha256 (s) | cost |")
    print("|---|---|---|---|")
    for name, off, on in rows:
        print(f"| {name} | {off:.2f} | {on:.2f} | +{on - off:.2f} s (+{(on / off - 1) * 100:.0f} %) |")


if __name__ == "__main__":
    main()
