"""Where a distributed step's time goes: compute, collectives (exposed waiting), copies, and the rest.

    python -m benchmarks.profile_step                       # bench GPT: ddp, fsdp2, zgraph-z0..z3
    python -m benchmarks.profile_step --systems ddp,zgraph-z3 --steps 5

Each system runs on 2 gloo ranks (one thread each, as in ``benchmarks.compare``), warms up, then runs
``--steps`` steps under ``torch.profiler`` on every rank. Rank 0's operator self times (CPU, main thread) are
split into:

- *compute*: aten operators that compute (matmuls, elementwise, reductions, the optimizer's arithmetic);
- *copies*: operators that only move bytes (``copy_``, ``cat``, ``_chunk_cat``, ``clone``, split copies, pads);
- *collectives*: issuing collectives and waiting for them (``_c10d_functional.*``, ``wait_tensor``, the c10d
  and gloo ops DDP/FSDP2 call): the waiting is communication the schedule did not hide;
- *other*: the step's wall time minus the above: Python, the interpreter of the graph (eager backend), the
  autograd engine, hooks, allocation.

Results are printed and written to ``benchmarks/results/profile_<model>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.compare_worker import MODELS, build_system, init_group
from zgraph.demos.data import batch, corpus_tokens
from zgraph.demos.models import GPT

RESULTS = os.path.join(os.path.dirname(__file__), "results")
WORLD = 2

COPY_OPS = {
    "aten::copy_",
    "aten::cat",
    "aten::_chunk_cat",
    "aten::clone",
    "aten::split_with_sizes_copy",
    "aten::constant_pad_nd",
    "aten::contiguous",
    "aten::_to_copy",
    "aten::empty_strided",
    "aten::fill_",
    "aten::zero_",
    "aten::index_put_",
}
COLLECTIVE_MARKS = ("c10d", "gloo", "wait_tensor", "all_gather", "reduce_scatter", "all_reduce", "allreduce")


def category(name: str) -> str | None:
    """The bucket of one profiler event, or None for events that are not operators (their time is nested)."""
    if any(mark in name.lower() for mark in COLLECTIVE_MARKS):
        return "collectives"
    if name in COPY_OPS:
        return "copies"
    if name.startswith("aten::"):
        return "compute"
    return None


def _rank(rank: int, port: int, system: str, model_name: str, warmup: int, steps: int, backend: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    args = argparse.Namespace(lr=1e-3, backend=backend, micro_batch=8)
    init_group(system)
    torch.manual_seed(0)
    config = MODELS[model_name]
    model = GPT(config)
    built = build_system(system, model, args)
    tokens = corpus_tokens()
    g = torch.Generator().manual_seed(rank)

    for _ in range(warmup):
        built.step(*batch(tokens, 8, config.seq, g))
    dist.barrier()
    wall = 0.0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            data = batch(tokens, 8, config.seq, g)
            dist.barrier()
            start = time.perf_counter()
            built.step(*data)
            dist.barrier()
            wall += time.perf_counter() - start
    totals: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        bucket = category(event.key)
        if bucket is not None:
            totals[bucket] += event.self_cpu_time_total / 1e6
            top[f"{bucket}: {event.key}"] += event.self_cpu_time_total / 1e6
    result = {
        "system": system,
        "wall_s": wall / steps,
        **{k: v / steps for k, v in totals.items()},
        "top": sorted(((k, v / steps) for k, v in top.items()), key=lambda kv: -kv[1])[:8],
    }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def profile(system: str, model: str, warmup: int, steps: int, backend: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "result.json")
        args = (port, system, model, warmup, steps, backend, out)
        mp.start_processes(_rank, args=args, nprocs=WORLD, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def table(results: list[dict]) -> str:
    lines = [
        "| system | wall s/step | compute | copies | collectives | other | top operators (self s/step) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        known = r.get("compute", 0) + r.get("copies", 0) + r.get("collectives", 0)
        tops = "; ".join(f"{k} {v:.4f}" for k, v in r["top"][:4])
        lines.append(
            f"| {r['system']} | {r['wall_s']:.4f} | {r.get('compute', 0):.4f} | {r.get('copies', 0):.4f} | "
            f"{r.get('collectives', 0):.4f} | {r['wall_s'] - known:.4f} | {tops} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="bench")
    parser.add_argument("--systems", default="ddp,fsdp2,zgraph-z0,zgraph-z1,zgraph-z2,zgraph-z3")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", choices=("eager", "inductor"), default="eager", help="zgraph's backend")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    results = [profile(s, args.model, args.warmup, args.steps, args.backend) for s in args.systems.split(",")]
    text = (
        f"{args.model} GPT, 2 gloo ranks x 1 thread, micro-batch 8, zgraph backend {args.backend}, "
        f"{args.steps} profiled steps after "
        f"{args.warmup} warm-up; rank 0's main-thread operator self time per step, seconds\n\n{table(results)}\n"
    )
    os.makedirs(RESULTS, exist_ok=True)
    suffix = "" if args.backend == "eager" else f"_{args.backend}"
    with open(os.path.join(RESULTS, f"profile_{args.model}{suffix}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
