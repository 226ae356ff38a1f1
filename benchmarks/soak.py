"""A long run at ZeRO-3 with optimizer states on the NVMe tier: does anything grow? (issue 25, item 6)

2 gloo ranks on CPU train the bench GPT (``benchmarks.compare``'s shape and micro-batch) with
``Config(stage=3, offload_optimizer="nvme")``, the files under ``--dir``, on a fixed cycle of 8 batches. After the
first step and every ``--every`` steps each rank samples its resident set (VmRSS), its open files
(``/proc/self/fd``), the offload directory (files' sizes and the blocks allocated to them) and the tensor bytes it
holds (``zgraph.runtime.memory.live_storages``). Flat means no trend after the warm-up: the summary gives each
quantity at the first sample, after ``--warmup`` steps and at the end, its range after the warm-up, and RSS's
least-squares slope after the warm-up in bytes per step. ``--minutes`` ends the run earlier (the steps run are
reported). Results, samples and summary, go to ``benchmarks/results/soak_<model>.json``, rewritten at every sample
(a run cut short leaves what it sampled).

    python -m benchmarks.soak [--steps 5000] [--every 50] [--warmup 500] [--minutes 50] [--dir /path/on/nvme]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zgraph
from benchmarks.compare import MICRO_BATCH
from benchmarks.compare_worker import status_kib
from zgraph.demos.models import BENCH_GPT, GPT, GPT_100M, lm_loss
from zgraph.runtime.memory import live_storages

MODELS = {"bench": BENCH_GPT, "100m": GPT_100M}
FIELDS = ("step", "seconds", "rss", "fds", "dir_size", "dir_allocated", "tensor_bytes")


def _step(model, opt, idx, tgt):
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def dir_bytes(path: str) -> tuple[int, int]:
    """Bytes of the regular files under ``path``: their sizes, and the blocks allocated to them."""
    size = allocated = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:  # removed while walking
                continue
            size, allocated = size + st.st_size, allocated + st.st_blocks * 512
    return size, allocated


def sample(step: int, seconds: float, directory: str) -> list[float]:
    """One row of ``FIELDS`` for this process."""
    fds = len(os.listdir("/proc/self/fd"))
    live = sum(live_storages().values())
    return [step, seconds, status_kib("VmRSS") * 1024, fds, *dir_bytes(directory), live]


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def summarize(rows: list[dict], warmup: int) -> dict:
    """One rank's samples: each quantity first / after the warm-up / at the end, its range after the warm-up,
    RSS's slope after the warm-up, steps per second after the warm-up."""
    after = [r for r in rows if r["step"] >= warmup] or rows[-1:]
    out: dict = {"steps": rows[-1]["step"], "seconds": rows[-1]["seconds"]}
    for key in FIELDS[2:]:
        values = [r[key] for r in after]
        out[key] = {"first": rows[0][key], "after_warmup": after[0][key], "end": rows[-1][key]}
        out[key]["min_max_after_warmup"] = [min(values), max(values)]
    out["rss"]["slope_bytes_per_step_after_warmup"] = _slope([r["step"] for r in after], [r["rss"] for r in after])
    span = after[-1]["seconds"] - after[0]["seconds"]
    out["steps_per_s_after_warmup"] = (after[-1]["step"] - after[0]["step"]) / span if span else None
    return out


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shape = MODELS[args.model]
    torch.manual_seed(0)
    model = GPT(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = zgraph.Config(stage=3, backend="eager", offload_optimizer="nvme", offload_dir=args.dir)
    step = zgraph.distribute(config)(_step)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, shape.vocab, (args.micro_batch, shape.seq + 1), generator=g) for _ in range(8)]
    rows: list[list[dict]] = [[] for _ in range(world)]
    losses: list[float] = []
    start = time.perf_counter()
    for i in range(1, args.steps + 1):
        batch = batches[i % len(batches)]
        loss = step(model, opt, batch[:, :-1], batch[:, 1:])
        if i != 1 and i % args.every and i != args.steps:
            continue
        losses.append(float(loss))
        elapsed = time.perf_counter() - start
        mine = torch.tensor([*sample(i, elapsed, args.dir), elapsed > args.minutes * 60], dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        for r, values in enumerate(gathered):
            rows[r].append(dict(zip(FIELDS, values.tolist())))
        if rank == 0:
            _write(out, args, rows, losses)
        if gathered[0][-1]:  # rank 0's clock decides for everyone
            break
    dist.barrier()
    dist.destroy_process_group()


def _write(out: str, args: argparse.Namespace, rows: list[list[dict]], losses: list[float]) -> None:
    result = {
        "model": args.model,
        "stage": 3,
        "world": 2,
        "offload_optimizer": "nvme",
        "micro_batch": args.micro_batch,
        "steps_asked": args.steps,
        "every": args.every,
        "warmup": args.warmup,
        "summary_per_rank": [summarize(r, args.warmup) for r in rows],
        "losses_rank0_at_samples": losses,
        "samples_per_rank": rows,
    }
    with open(out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(out + ".tmp", out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="bench")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--every", type=int, default=50, help="sample every this many steps")
    parser.add_argument("--warmup", type=int, default=500, help="steps before the trend is judged")
    parser.add_argument("--minutes", type=float, default=float("inf"), help="stop after this long")
    parser.add_argument("--micro-batch", type=int, default=MICRO_BATCH)
    parser.add_argument("--dir", default=None, help="offload_dir (default: a temporary directory)")
    args = parser.parse_args()
    out = os.path.join(os.path.dirname(__file__), "results", f"soak_{args.model}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zgraph-soak-") as scratch:
        args.dir = args.dir or scratch
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank, args=(2, port, args, out), nprocs=2, start_method="spawn")
    with open(out) as f:
        print(json.dumps(json.load(f)["summary_per_rank"], indent=2))


if __name__ == "__main__":
    main()
