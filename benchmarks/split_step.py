"""Split step vs one-graph step: the bench GPT at ZeRO-3 on 2 ranks (gloo, CPU), side by side in one run.

One-graph: ``loss.backward(); opt.step()`` inside one ``@zgraph.distribute`` step. Split: a forward step that
returns the loss (with a ``grad_fn``), ``loss.backward()`` outside it (the compiled, sharded backward), and an
optimizer step. The two alternate call by call on the same ranks, so machine noise hits both alike; the result
is the ratio of medians (the issue asks for at most 1.10).

    python -m benchmarks.split_step [--steps 20] [--backend eager]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zgraph
from zgraph.demos.models import BENCH_GPT, GPT, lm_loss


def _one_graph(model, opt, idx, tgt):
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _forward(model, idx, tgt):
    return lm_loss(model(idx), tgt)


def _update(opt):
    opt.step()
    opt.zero_grad()


def _rank(rank: int, world: int, port: int, steps: int, backend: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    base = GPT(BENCH_GPT)
    models = [base, copy.deepcopy(base)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    config = zgraph.Config(stage=3, backend=backend)
    one, fwd, upd = (zgraph.distribute(config)(f) for f in (_one_graph, _forward, _update))
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, BENCH_GPT.vocab, (8, BENCH_GPT.seq), generator=g)
    tgt = torch.randint(0, BENCH_GPT.vocab, (8, BENCH_GPT.seq), generator=g)

    def split() -> torch.Tensor:
        loss = fwd(models[1], idx, tgt)
        loss.backward()
        upd(opts[1])
        return loss.detach()

    runs = {"one_graph": lambda: one(models[0], opts[0], idx, tgt), "split": split}
    times: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(steps + 2):  # two warm-up calls each (capture, compile)
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            loss = run()
            dist.barrier()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
            losses[name].append(float(loss))
    if rank == 0:
        medians = {k: statistics.median(v) for k, v in times.items()}
        ratios = [b / a for a, b in zip(times["one_graph"], times["split"])]  # call by call, side by side
        result = {
            "model": "bench GPT",
            "stage": 3,
            "world": world,
            "backend": backend,
            "steps": steps,
            "min_median_max_s": {k: [min(v), medians[k], max(v)] for k, v in times.items()},
            "split_over_one_graph": medians["split"] / medians["one_graph"],
            "per_step_ratio_min_median_max": [min(ratios), statistics.median(ratios), max(ratios)],
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses["one_graph"], losses["split"])),
        }
        print(json.dumps(result, indent=2))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "split_step.json"))
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(2, port, args.steps, args.backend, args.out), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
