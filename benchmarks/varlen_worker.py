"""One rank of one system of ``benchmarks.varlen``: steps whose sequence length changes, timed and counted.

    python -m benchmarks.varlen_worker --system=zgraph-z3 --model=gpt2 --lengths=80,194,... --steps=24 \
        --out=rank0.json

Every system trains the same model (same seed) on the same batches: step ``i`` is a global batch of ``--batch``
sequences of ``lengths[i % len(lengths)]`` tokens (random tokens from a generator seeded by ``--seed`` and ``i``;
rank ``r`` of ``w`` takes rows ``[r * B / w, (r + 1) * B / w)``), with ``torch.optim.AdamW`` (weight decay on
matrices only, as ``benchmarks.compare_worker``). Each step is timed between barriers; after the run the worker
counts the captures (zgraph: ``step._dispatch.variants()``) or compiles (``torch.compile``: the graphs Dynamo
compiled, ``counters["stats"]["unique_graphs"]``, recompiles included) and reads the peak RSS (VmHWM) of the first
pass and of the steps after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.compare_worker import (
    adamw,
    init_group,
    peak_rss_mib,
    reset_peak_rss,
    rss_mib,
    run_and_report,
    sync,
)
from zgraph.demos.models import GPT, GPT_100M, GPTConfig, count_params, lm_loss

ONE_PROCESS = ("eager-1proc", "compile-1proc", "zgraph-1proc", "zgraph-inductor-1proc")
TWO_RANKS = ("ddp", "fsdp2", "compile-ddp", "zgraph-z3", "zgraph-z3-inductor")
SYSTEMS = ONE_PROCESS + TWO_RANKS
MODELS = ("gpt2", "gpt100m", "tiny")
TINY = GPTConfig(vocab=256, d_model=64, layers=2, heads=2, seq=32)

StepFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class RankResult:
    """What one rank measured; written as JSON for the harness."""

    system: str
    rank: int
    world_size: int
    params: int = 0
    lengths: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    captures_first_pass: int | None = None
    captures: int | None = None
    baseline_rss_mib: float | None = None
    peak_first_pass_mib: float | None = None
    peak_steady_mib: float | None = None
    error: str | None = None


# ------------------------------------------------------------------------------------------------ models
def build_model(name: str, max_length: int) -> tuple[nn.Module, int, list[nn.Module]]:
    """The model (built after ``torch.manual_seed``), its vocabulary, and its transformer blocks (FSDP2 shards
    each). ``gpt2``: Hugging Face GPT-2, 12 layers, n_embd 256, 4 heads, vocabulary 1000, dropout off (so that
    every system's losses compare); ``gpt100m``: ``zgraph.demos.models.GPT_100M``; ``tiny``: 2 layers, d 64."""
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=1000, n_positions=max_length, n_embd=256, n_layer=12, n_head=4)
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        config.bos_token_id = config.eos_token_id = 0  # within the vocabulary
        model = GPT2LMHeadModel(config)
        return model, config.vocab_size, list(model.transformer.h)
    config = GPT_100M if name == "gpt100m" else TINY
    if max_length > config.seq:
        config = dataclasses.replace(config, seq=max_length)
    model = GPT(config)
    return model, config.vocab, list(model.blocks)


def batch(step: int, length: int, vocab: int, rows: int, seed: int, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """This rank's rows of step ``step``'s global batch: ``rows`` random sequences of ``length`` tokens (inputs and
    their next-token targets)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (rows, length + 1), generator=generator)
    mine = tokens[rank * rows // world : (rank + 1) * rows // world]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


# ------------------------------------------------------------------------------------------------ systems
def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: Tensor, tgt: Tensor) -> Tensor:
    """The step every system runs (zgraph compiles exactly this function); a Hugging Face output's ``logits``."""
    out = model(idx)
    loss = lm_loss(getattr(out, "logits", out), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def build_system(name: str, model: nn.Module, blocks: list[nn.Module], lr: float) -> tuple[StepFn, Callable[[], int]]:
    """The system's ``step(idx, tgt) -> loss`` and a function counting its captures or compiles so far (0 for the
    systems that never compile)."""
    if name.startswith("zgraph"):
        import zgraph

        opt = adamw(model, lr)
        inductor = "inductor" in name  # beside torch.compile(dynamic=True): symbolic sizes from the first call
        backend, dynamic = ("inductor", True) if inductor else ("eager", None)
        config = zgraph.Config(stage=3 if "z3" in name else 0, backend=backend, dynamic=dynamic)
        step = zgraph.distribute(config)(train_step)
        return (lambda idx, tgt: step(model, opt, idx, tgt)), step._dispatch.variants
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped: nn.Module = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model) if name in ("ddp", "compile-ddp") else model
    opt = adamw(wrapped, lr)
    if name.startswith("compile"):
        # DDPOptimizer (the graph split at DDP's buckets) fails on symbolic sizes ("'float' object has no attribute
        # 'meta'"); torch's advice for dynamic shapes is one graph (pytorch/pytorch#111636): DDP's hooks all-reduce
        torch._dynamo.config.optimize_ddp = False
        wrapped = torch.compile(wrapped, dynamic=True)
        return (lambda idx, tgt: train_step(wrapped, opt, idx, tgt)), dynamo_graphs
    return (lambda idx, tgt: train_step(wrapped, opt, idx, tgt)), lambda: 0


def dynamo_graphs() -> int:
    """The graphs ``torch.compile`` compiled in this process so far (each recompile is one more)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ------------------------------------------------------------------------------------------------ running
def timed_call(step: StepFn, idx: Tensor, tgt: Tensor) -> tuple[float, float]:
    """One step between barriers: seconds and the loss."""
    sync()
    start = time.perf_counter()
    loss = step(idx, tgt)
    sync()
    return time.perf_counter() - start, float(loss.detach().float().item())


def run(args: argparse.Namespace, result: RankResult) -> None:
    """Build, run the first pass (one step per length) and the rest, count captures, read peak RSS."""
    init_group(args.system)
    lengths = args.lengths
    torch.manual_seed(args.seed)
    model, vocab, blocks = build_model(args.model, max(lengths))
    result.params = count_params(model)
    step, captures = build_system(args.system, model, blocks, args.lr)
    result.baseline_rss_mib = rss_mib()
    reset_peak_rss()
    for i in range(args.steps):
        if i == len(lengths):
            result.captures_first_pass = captures()
            result.peak_first_pass_mib = peak_rss_mib()
            sync()
            reset_peak_rss()
        length = lengths[i % len(lengths)]
        inputs = batch(i, length, vocab, args.batch, args.seed, result.rank, result.world_size)
        seconds, loss = timed_call(step, *inputs)
        result.lengths.append(length)
        result.step_s.append(seconds)
        result.losses.append(loss)
        save_so_far(result, args.out)
    result.captures = captures()
    if result.peak_first_pass_mib is None:
        result.peak_first_pass_mib = peak_rss_mib()
    else:
        result.peak_steady_mib = peak_rss_mib()


def save_so_far(result: RankResult, out: str) -> None:
    """The result so far, replaced whole (what a run stopped on its timeout did is read from it)."""
    partial = Path(out + ".partial")
    partial.write_text(json.dumps(asdict(result)))
    os.replace(partial, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--model", choices=MODELS, default="gpt2")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences per step, all ranks)")
    parser.add_argument("--out", required=True, help="where this rank writes its JSON result")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one rank; the JSON result is written even when the system fails (with ``error`` set)."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    result = RankResult(args.system, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    return run_and_report(lambda: run(args, result), result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
