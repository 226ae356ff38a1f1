"""Hybrid sharding and hpZ (issue 30): bytes per step on each link class, and step time, on 4 gloo ranks as 2
"nodes" of 2 (ranks 0-1 and 2-3), for flat ZeRO-3, HSDP (``shard_group_size=2``) and hpZ
(``secondary_shard_group_size=2``), each also with ``cross_group_dtype=torch.bfloat16``, on the bench GPT and the
~100M GPT.

Bytes are counted from each step's lowered graph (rank 0's; every rank's graph has the same shapes): every
collective's bytes (the whole tensor gathered or reduced, as ``Estimate.comm_bytes`` counts them) go to the link
class of its group — *inter-node* when the group's ranks lie on both nodes, else *intra-node* — and to
*parameters* (all-gathers) or *gradients* (reduce-scatters, all-reduces). The parent also asks the estimate for
the same step (``step.estimate(..., world_size=4, ranks_per_node=2)``, in one process) and records its
``link_bytes`` beside the count. Both link classes are loopback on one machine: the step times (the first call
untimed, then ``--steps`` calls, min / median / max, measured side by side in one run) are a sanity check; the
bytes are the result. ZeRO++'s claim to compare with: the parameter bytes crossing nodes fall to 1/N of flat
ZeRO-3's (N: ranks per group).

    python -m benchmarks.hybrid [--models bench,100m] [--micro-batch 2] [--steps 3] [--timeout 1800]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import zgraph
from zgraph.demos.models import BENCH_GPT, GPT, GPT_100M, count_params, lm_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"bench": BENCH_GPT, "100m": GPT_100M}
WORLD, RANKS_PER_NODE = 4, 2
LAYOUTS = {
    "flat": {},
    "hsdp": {"shard_group_size": 2},
    "hpz": {"secondary_shard_group_size": 2},
    "hsdp+bf16": {"shard_group_size": 2, "cross_group_dtype": torch.bfloat16},
    "hpz+bf16": {"secondary_shard_group_size": 2, "cross_group_dtype": torch.bfloat16},
}


def train_step(model, opt, idx, tgt):
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def config(layout: str) -> zgraph.Config:
    return zgraph.Config(stage=3, backend="eager", **LAYOUTS[layout])


def build(model_name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(MODELS[model_name])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(model_name: str, micro_batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = MODELS[model_name]
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq), generator=g)
    return idx, torch.randint(0, cfg.vocab, (micro_batch, cfg.seq), generator=g)


def link_bytes(step: object) -> dict[str, dict[str, int]]:
    """``{link class: {"params": bytes, "grads": bytes}}`` of the step's lowered graph (run on a rank)."""
    import torch.distributed as dist

    from zgraph.graph import COLLECTIVE, collective_bytes, collective_kind

    out = {"intra_node": {"params": 0, "grads": 0}, "inter_node": {"params": 0, "grads": 0}}
    for node in step.graphs["lower_collectives"].graph.nodes:
        if COLLECTIVE not in node.meta:
            continue
        name = next(a for a in reversed(node.args) if isinstance(a, str))
        ranks = dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name))
        link = "inter_node" if len({r // RANKS_PER_NODE for r in ranks}) > 1 else "intra_node"
        what = "params" if collective_kind(node) == "all_gather_into_tensor" else "grads"
        out[link][what] += collective_bytes(node)
    return out


def ranks(rank: int, world: int, out: str, model_name: str, micro_batch: int, steps: int) -> None:
    """Worker (``run_ranks``): each layout on a fresh model; rank 0 writes the results as JSON after each."""
    results = {}
    for layout in LAYOUTS:
        model, opt = build(model_name)
        step = zgraph.distribute(config(layout))(train_step)
        idx, tgt = batch(model_name, micro_batch, rank)
        step(model, opt, idx, tgt)  # capture: untimed
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step(model, opt, idx, tgt)
            times.append(time.perf_counter() - start)
        results[layout] = {
            "bytes": link_bytes(step),
            "step_s": {"min": min(times), "median": statistics.median(times), "max": max(times)},
        }
        del model, opt, step
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)


def estimated(model_name: str, micro_batch: int) -> dict:
    """Each layout's estimate in this process (no process group): its ``link_bytes`` and seconds."""
    found = {}
    for layout in LAYOUTS:
        model, opt = build(model_name)
        step = zgraph.distribute(config(layout))(train_step)
        start = time.perf_counter()
        idx, tgt = batch(model_name, micro_batch, 0)
        e = step.estimate(model, opt, idx, tgt, world_size=WORLD, ranks_per_node=RANKS_PER_NODE)
        found[layout] = {"link_bytes": dict(e.link_bytes), "comm_bytes": dict(e.comm_bytes)}
        found[layout]["estimate_s"] = time.perf_counter() - start
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bench,100m")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "hybrid.json"))
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_harness import run_ranks

    report = {"world": WORLD, "ranks_per_node": RANKS_PER_NODE, "load_before": os.getloadavg(), "models": {}}
    for model_name in args.models.split(","):
        entry = {"params": count_params(build(model_name)[0]), "estimate": estimated(model_name, args.micro_batch)}
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ranks.json")
            work = (path, model_name, args.micro_batch, args.steps)
            run_ranks(WORLD, "benchmarks.hybrid.ranks", *work, timeout=args.timeout)
            with open(path) as f:
                entry["measured"] = json.load(f)
        report["models"][model_name] = entry
        _print(model_name, entry)
    report["load_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


def _print(model_name: str, entry: dict) -> None:
    flat = entry["measured"]["flat"]["bytes"]["inter_node"]["params"]
    print(f"{model_name} ({entry['params'] / 1e6:.0f}M parameters), bytes per step on rank 0:")
    for layout, result in entry["measured"].items():
        b, t = result["bytes"], result["step_s"]
        est = entry["estimate"][layout]["link_bytes"]
        inter = b["inter_node"]["params"]
        print(
            f"  {layout:9} inter-node params {inter:>12,} ({inter / flat:.2f}x flat)"
            f"  grads {b['inter_node']['grads']:>12,} | intra-node params {b['intra_node']['params']:>12,}"
            f" grads {b['intra_node']['grads']:>12,} | estimate {est} | step median {t['median']:.2f} s"
            f" (min {t['min']:.2f}, max {t['max']:.2f})"
        )


if __name__ == "__main__":
    main()
