"""One rank of one system of ``benchmarks.pipeline``: warm-up, timed steps with each compute action's span, and one
step with its communication counted.

    python -m benchmarks.pipeline_worker --system=zgraph-p4-1f1b --out=rank0.json [--layers 8 --d-model 128 ...]

Every system trains the same GPT (same seed) with ``torch.optim.AdamW`` (weight decay on matrices only) on the same
global batches (step ``i``: ``--batch`` random sequences from a generator seeded by ``--seed`` and ``i``; the system
takes its rows, ``benchmarks.pipeline_systems``). Each step is timed between barriers. During the timed steps the
rank records its compute actions' spans (``benchmarks.pipeline_timeline.Recorder``); after them it reads its peak
resident set (VmHWM, reset after the warm-up), then runs one more step under ``CommBytes`` (a dispatch mode: slow,
so not timed) for the bytes it sends point to point and its collectives' payload.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks.compare_worker import peak_rss_mib, reset_peak_rss, rss_mib, run_and_report, sync
from benchmarks.pipeline_systems import build
from benchmarks.pipeline_timeline import CommBytes, Recorder
from zgraph.demos.models import GPT, GPTConfig, count_params


@dataclass
class RankResult:
    """What one rank measured; written as JSON for the driver after every step."""

    system: str
    rank: int
    world_size: int
    pipeline: int | None = None
    params: int = 0
    step_s: list[float] = field(default_factory=list)  # the timed steps
    step_start: list[float] = field(default_factory=list)  # their start on perf_counter
    spans: list[list[list]] = field(default_factory=list)  # per timed step: [kind, start, end, cpu] per action
    losses: list[float | None] = field(default_factory=list)  # every step's, where the rank knows it
    p2p_bytes: int | None = None  # sent by this rank in the counted step
    collective_bytes: int | None = None
    calls: dict[str, int] = field(default_factory=dict)
    baseline_rss_mib: float | None = None
    peak_mib: float | None = None
    error: str | None = None


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, d_model=args.d_model, layers=args.layers, heads=args.heads, seq=args.seq)


def global_batch(step: int, args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    """Step ``step``'s whole batch: inputs and their next-token targets."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def init_group(system: str, world: int) -> None:
    """gloo for every system on several ranks (zgraph uses the group it finds; DeepSpeed wraps it)."""
    if world == 1:
        return
    dist.init_process_group(backend="gloo")
    if system.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")


def run(args: argparse.Namespace, result: RankResult) -> None:
    init_group(args.system, result.world_size)
    result.baseline_rss_mib = rss_mib()
    torch.manual_seed(args.seed)
    gpt = GPT(model_config(args))
    result.params = count_params(gpt)
    recorder = Recorder()
    system = build(args.system, gpt, args.lr, args.microbatches, args.batch, recorder)
    result.pipeline = system.pipeline
    timed, counted = range(args.warmup, args.warmup + args.steps), args.warmup + args.steps
    for i in range(counted + 1):
        if i == timed.start:
            sync()
            reset_peak_rss()
        if i == counted:
            result.peak_mib = peak_rss_mib()
        recorder.on = i in timed
        counter = CommBytes() if i == counted else contextlib.nullcontext()
        sync()
        start = time.perf_counter()
        with counter:
            loss = system.step(*global_batch(i, args))
        sync()
        seconds = time.perf_counter() - start
        spans = recorder.take()
        if i in timed:
            result.step_s.append(seconds)
            result.step_start.append(start)
            result.spans.append([list(s) for s in spans])
        if isinstance(counter, CommBytes):
            result.p2p_bytes, result.collective_bytes, result.calls = counter.p2p, counter.collective, counter.calls
        result.losses.append(loss)
        save_so_far(result, args.out)


def save_so_far(result: RankResult, out: str) -> None:
    partial = Path(out + ".partial")
    partial.write_text(json.dumps(asdict(result)))
    os.replace(partial, out)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model, batch and step options the driver passes on to every rank."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="global batch: sequences per step over all ranks")
    parser.add_argument("--microbatches", type=int, default=8, help="M, unless the system's name says -m<M>")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (one more is run to count bytes)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", required=True)
    parser.add_argument("--out", required=True, help="where this rank writes its JSON result")
    add_model_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one rank; the JSON result is written even when the system fails (with ``error`` set)."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    result = RankResult(args.system, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    return run_and_report(lambda: run(args, result), result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
