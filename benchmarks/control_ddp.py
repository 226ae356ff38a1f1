"""The harness's control: the plainest DDP training script there is, for the bench (or ~100M) GPT, under torchrun.

``benchmarks.compare`` must measure DDP within 5 % of what this script measures on the same machine (issue 17:
an independent harness found compare's DDP row ~1.8x slower than a plain script). Nothing here comes from the
harness: random tokens, the model, ``DistributedDataParallel`` with its defaults, AdamW (weight decay on matrices
only), a barrier-free timed loop (``loss.item()`` ends each step, as a training loop that logs its loss does).

    torchrun --nproc_per_node 2 -m benchmarks.control_ddp [--steps 20] [--warmup 3] [--micro-batch 8]

Prints one JSON line (rank 0): min / median / max seconds per step over the timed steps, and the loss.
``benchmarks.compare`` also runs it as the system ``ddp-control``, beside its own ``ddp`` row: then ``--data``
gives it the harness's batches (so the losses agree) and ``--out`` takes this rank's times, losses and memory in
the harness's result format. Only the measuring loop is this script's own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from zgraph.demos.models import BENCH_GPT, GPT, GPT_100M, lm_loss, weight_decay_groups

MODELS = {"bench": BENCH_GPT, "100m": GPT_100M}


def _batches(args: argparse.Namespace, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The harness's batches (this rank's rows) with ``--data``, else random tokens."""
    count = args.warmup + args.steps
    if args.data:
        data = torch.load(args.data)
        sl = slice(rank * args.micro_batch, (rank + 1) * args.micro_batch)
        return [(data["idx"][i % len(data["idx"])][sl], data["tgt"][i % len(data["tgt"])][sl]) for i in range(count)]
    g = torch.Generator().manual_seed(1 + rank)
    config = MODELS[args.model]
    shape = (args.micro_batch, config.seq)
    random = [torch.randint(0, config.vocab, shape, generator=g) for _ in range(2 * count)]
    return list(zip(random[::2], random[1::2]))


def _vm_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE).group(1)) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--model", choices=sorted(MODELS), default="bench")
    parser.add_argument("--data", help="the harness's batches (torch.save'd {'idx', 'tgt'})")
    parser.add_argument("--out", help="write this rank's result here, in benchmarks.compare's format")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline = _vm_mib("VmRSS")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(GPT(MODELS[args.model]))
    opt = torch.optim.AdamW(weight_decay_groups(model), lr=1e-3)
    times, losses = [], []
    for i, (idx, tgt) in enumerate(_batches(args, rank, world)):
        if i == args.warmup:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak RSS of the timed steps only
            cpu = time.process_time()
        start = time.perf_counter()
        loss = lm_loss(model(idx), tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    timed = times[args.warmup :]
    if args.out:
        state = [*model.parameters(), *(t for s in opt.state.values() for t in s.values())]
        result = {
            "system": "ddp-control", "rank": rank, "world_size": world, "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in model.parameters()), "warmup_s": times[: args.warmup],
            "step_s": timed, "warmup_losses": losses[: args.warmup], "losses": losses[args.warmup :],
            "cpu_s": time.process_time() - cpu, "threads_after": torch.get_num_threads(),
            "peak_mib": _vm_mib("VmHWM"), "baseline_rss_mib": baseline,
            "state_mib": sum(t.untyped_storage().nbytes() for t in state) / 2**20, "error": None,
        }  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(result, f)
    if rank == 0:
        summary = {"system": "ddp (control)", "min_median_max_s": [min(timed), statistics.median(timed), max(timed)]}
        print(json.dumps({**summary, "loss": losses[-1], "steps": args.steps}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
