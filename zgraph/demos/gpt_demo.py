"""``zgraph demo``: train a small GPT on locally generated text through ``@zgraph.distribute``, on several ranks.

With no arguments it starts 2 local ranks itself (gloo, one CPU thread each) and trains with ZeRO stage 3; under
``torchrun`` (``RANK`` set) the same command runs as one rank of torchrun's job. Where CUDA has a GPU for every
local rank, each rank trains on ``cuda:<local rank>`` (else on the CPU, saying so where GPUs exist); zgraph starts
the process group from the rank's environment on the first step call, with the backend for the model's device
(gloo for the CPU, NCCL for GPUs). Every rank draws the same global batch from a seeded
generator and trains on its own slice of it, so a run is reproducible and its losses do not depend on how the
global batch is split. Rank 0 draws the progress bar and prints the summary.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm import tqdm

import zgraph
from zgraph.demos import multimodal_demo as demo_multimodal
from zgraph.demos.data import VOCAB, batch, corpus_tokens
from zgraph.demos.models import GPT, GPTConfig, count_params, lm_loss
from zgraph.demos.ranks import device_note, local_rank_and_size, rank_device, spawn_ranks, unsharded_state_bytes
from zgraph.inspect.explain import human_bytes
from zgraph.runtime.memory import state_bytes as held_state_bytes

DEMO_GPT = GPTConfig(vocab=VOCAB, d_model=256, layers=4, heads=4, seq=128)
DEFAULT_NPROC = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``zgraph demo`` options."""
    parser.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help=f"local ranks to start (default {DEFAULT_NPROC}); ignored under torchrun, which starts the ranks",
    )
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage (default 3)")
    parser.add_argument("--steps", type=_positive_int, default=40, help="training steps (default 40)")
    parser.add_argument("--batch", type=_positive_int, default=8, help="sequences per rank per step (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--backend", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--dump", default="zgraph_graphs", help="directory for the graphs (default zgraph_graphs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--multimodal",
        action="store_true",
        help="the seeds' disaggregated training: a vision encoder and a caption LM in two groups of --nproc ranks "
        "each (default 2), each side ZeRO-sharded over its own group; losses compared with eager PyTorch",
    )
    parser.add_argument(
        "--sequence-parallel",
        type=_positive_int,
        default=None,
        help="--multimodal only: the LM side trains with Ulysses sequence parallelism over groups of this many of "
        "its ranks (Config.sequence_parallel; must divide --nproc and the LM's 4 heads)",
    )
    parser.add_argument(
        "--launcher",
        default="auto",
        choices=("auto", "ray", "processes"),
        help="--multimodal only: Ray actor groups (auto: when Ray is installed) or local processes in two subgroups",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="--multimodal with Ray: the running cluster to join (ray start's HOST:PORT, or auto; default "
        "RAY_ADDRESS, else a local cluster); each group's actors are packed on one node where they fit",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def train_step(model: GPT, opt: torch.optim.Optimizer, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """The step zgraph compiles: forward, backward, AdamW update."""
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


# ------------------------------------------------------------------------------------------------ entry point
def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the demo; returns the summary numbers on rank 0 (None on the other ranks of a torchrun job).

    Under torchrun (``RANK`` set) or inside an initialised process group this process is one rank; otherwise
    ``--nproc`` ranks are started here (one rank: trained in this process, no process group).
    """
    if getattr(args, "multimodal", False):
        return demo_multimodal.run(args)
    if getattr(args, "sequence_parallel", None):
        raise SystemExit("zgraph demo: --sequence-parallel is for --multimodal (the LM side of the seeds' example)")
    if _is_launched_rank():
        return train(args)
    nproc = args.nproc or DEFAULT_NPROC
    if nproc == 1:
        return train(args)
    return spawn_ranks(args, nproc, train)


def _is_launched_rank() -> bool:
    """True when something else started this process as a rank (torchrun, or a group already initialised)."""
    return "RANK" in os.environ or (dist.is_available() and dist.is_initialized())


# ------------------------------------------------------------------------------------------------- one rank
def train(args: argparse.Namespace) -> dict[str, Any] | None:
    """Train as this process's rank; rank 0 prints the report and returns the summary, other ranks None."""
    rank, world_size = rank_and_world_size()
    owns_group = not dist.is_initialized()  # zgraph starts the group on the first step; then this rank ends it
    if rank == 0 and args.nproc is not None and args.nproc != world_size and "RANK" in os.environ:
        print(f"zgraph demo: running under torchrun with {world_size} ranks; --nproc {args.nproc} is ignored")
    local_rank, local_size = local_rank_and_size(rank, world_size)
    device = rank_device(local_rank, local_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this rank's GPU before anything touches CUDA (no context on cuda:0)
    note = device_note(local_size, _fitting_ranks())
    if rank == 0 and note is not None:
        print(f"zgraph demo: {note}")
    torch.manual_seed(args.seed)
    model = GPT(DEMO_GPT).to(device)  # initialised on the CPU, then moved: the same weights on every device
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    n_params = count_params(model)
    unsharded_bytes = unsharded_state_bytes(model)
    step = zgraph.distribute(zgraph.Config(stage=args.stage, backend=args.backend))(train_step)
    tokens = corpus_tokens()
    generator = torch.Generator().manual_seed(args.seed)
    losses: list[float] = []
    start = None
    bar = tqdm(range(args.steps), desc=f"zgraph ZeRO-{args.stage} x{world_size}", unit="step", disable=rank != 0)
    for i in bar:
        idx, tgt = (t.to(device) for t in rank_batch(tokens, args.batch, rank, world_size, generator))
        loss = mean_over_ranks(step(model, opt, idx, tgt), world_size)
        losses.append(loss)
        if i == 0:
            start = time.perf_counter()  # steady state: after capture and compile
        bar.set_postfix(loss=f"{loss:.3f}")
    bar.close()
    seconds = time.perf_counter() - start if start is not None else math.nan
    global_tokens = args.batch * world_size * DEMO_GPT.seq
    tokens_per_s = (args.steps - 1) * global_tokens / seconds if args.steps > 1 else math.nan
    state_bytes = gather_to_all(held_state_bytes(model, opt)["total"], device)
    summary = None
    if rank == 0:
        paths = step.dump(args.dump)
        summary = {
            "losses": losses,
            "tokens_per_s": tokens_per_s,
            "state_bytes": state_bytes,
            "unsharded_bytes": unsharded_bytes,
            "world_size": world_size,
            "stage": args.stage,
            "graphs_dir": os.path.abspath(args.dump),
            "device": device.type,
        }
        print(step.explain())
        print(report(summary, n_params, len(paths)))
    if owns_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return summary


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the world size: the process group's, else torchrun's variables, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def _fitting_ranks() -> str | None:
    """The option that starts as many ranks as this host has GPUs (for the note when there are too few)."""
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    return f"torchrun --nproc-per-node {count}" if "RANK" in os.environ else f"--nproc {count}"


def rank_batch(
    tokens: Tensor, per_rank: int, rank: int, world_size: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """This rank's slice of the global batch (``per_rank * world_size`` sequences, the same on every rank)."""
    idx, tgt = batch(tokens, per_rank * world_size, DEMO_GPT.seq, generator)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return idx[rows], tgt[rows]


def mean_over_ranks(loss: Tensor, world_size: int) -> float:
    """The loss averaged over ranks (the global batch's mean loss: every rank's slice is the same size)."""
    total = loss.detach().clone()
    if world_size > 1:
        dist.all_reduce(total)
    return total.item() / world_size


def gather_to_all(value: int, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's ``value``, by rank (exchanged on ``device``: the model's, which the group's backend serves)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    everyone = torch.empty(dist.get_world_size(), dtype=torch.int64, device=device)
    dist.all_gather_single(everyone, torch.tensor([value], dtype=torch.int64, device=device))
    return everyone.tolist()


# --------------------------------------------------------------------------------------------- model state
def report(summary: dict[str, Any], n_params: int, n_graphs: int) -> str:
    """Rank 0's closing lines: model, loss, throughput, model state per rank, graphs."""
    losses = summary["losses"]
    unsharded = summary["unsharded_bytes"]
    tokens_per_s = summary["tokens_per_s"]
    throughput = f"{tokens_per_s:,.0f} tokens/s" if math.isfinite(tokens_per_s) else "n/a (one step)"
    lines = [
        f"model: GPT {n_params / 1e6:.1f} M parameters, AdamW; ZeRO stage {summary['stage']} on "
        f"{summary['world_size']} rank(s)",
        f"loss (mean over ranks): {losses[0]:.3f} -> {losses[-1]:.3f} after {len(losses)} steps",
        f"throughput: {throughput} (all ranks, steady state after the first step)",
        f"model state per rank (params + grads + optimizer state) vs unsharded {human_bytes(unsharded)}:",
    ]
    for rank, held in enumerate(summary["state_bytes"]):
        lines.append(f"  rank {rank}: {human_bytes(held)} ({held / unsharded:.2f}x)")
    if summary.get("device", "cpu") != "cpu":
        lines.append(f"device: {summary['device']} (one GPU per rank)")
    lines.append(f"graphs: {n_graphs} files in {summary['graphs_dir']}")
    return "\n".join(lines)
