"""``zgraph estimate``: memory and communication of a model's training step per rank, before running it.

The model is built on the meta device (no weights in memory) and a plain step — forward, next-token loss,
``backward()``, AdamW ``step()``, ``zero_grad()`` — is estimated with ``step.estimate`` for ``--world`` ranks on
``--device`` (``cpu``: gloo; ``cuda``: NCCL, CUDA's attention, autocast and allocator, with the CPU plan's peak
beside it: see ``zgraph.inspect.estimate``).
``--budget`` finds the largest micro-batch that fits: every node's live bytes is linear in the micro-batch (the
graph is the same, activations scale with it), so two traces (micro-batch 1 and 2) give the exact line per node;
the answer is checked by a third trace. When even micro-batch 1 does not fit it says which stage and precision
settings would. ``--budget`` with ``--plan`` instead prints the memory plan ``Config(memory_budget=...)`` would run
at ``--micro-batch`` (``zgraph.inspect.budget``: remat, offload, reuse), without running it.
``--ranks-per-node`` says which collectives cross nodes (their groups' ranks lie on more than one node): they are
priced at ``--inter-node-gbps`` and ``--inter-node-latency-us`` (defaults: ``zgraph.runtime.cost_model.INTER_NODE``)
and their bytes are printed apart from those within a node; ``--shard-group-size`` (hybrid sharding) and
``--secondary-shard-group-size`` (hpZ) set the ``Config`` fields of those names.
``--pipeline-parallel P`` estimates a pipelined step, a row per stage (``zgraph.cli.estimate_pipeline``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from zgraph.binding.arguments import StepCall
from zgraph.cli.estimate_pipeline import PipelineFlags, describe_pipeline, pipeline_fields, pipeline_of, stage_rows
from zgraph.cli.estimate_pipeline import add_arguments as add_pipeline_arguments
from zgraph.cli.units import EstimateInputError, gib, parse_bytes
from zgraph.config import Config
from zgraph.demos.llama import LLAMA_7B, LLAMA_13B, LLAMA_70B, Llama, LlamaConfig
from zgraph.demos.models import BENCH_GPT, GPT, GPT_100M, GPTConfig, lm_loss
from zgraph.errors import MemoryBudgetError
from zgraph.inspect.budget import MemoryPlan, plan_memory
from zgraph.inspect.estimate import DEVICES, Estimate, estimate_step
from zgraph.runtime.cost_model import CostModel, analytical_cost_model, known_cost_model, with_inter_node
from zgraph.runtime.hybrid import check_group_size, check_pipeline_groups


def _gpt(config: GPTConfig) -> Callable[[int], nn.Module]:
    return lambda seq: GPT(replace(config, seq=seq))


def _llama(config: LlamaConfig) -> Callable[[int], nn.Module]:  # position tables of seq rows at least
    return lambda seq: Llama(replace(config, max_seq=max(seq, config.max_seq)))


MODELS: dict[str, tuple[Callable[[int], nn.Module], int, int]] = {  # name: (build(seq), vocab, default seq)
    "gpt-bench": (_gpt(BENCH_GPT), BENCH_GPT.vocab, BENCH_GPT.seq),
    "gpt-100m": (_gpt(GPT_100M), GPT_100M.vocab, GPT_100M.seq),
    "llama-7b": (_llama(LLAMA_7B), LLAMA_7B.vocab, 512),
    "llama-13b": (_llama(LLAMA_13B), LLAMA_13B.vocab, 512),
    "llama-70b": (_llama(LLAMA_70B), LLAMA_70B.vocab, 512),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BF16_RECIPE = {"param_dtype": "bf16", "master_dtype": "bf16", "optimizer_state_dtype": "bf16", "autocast": "bf16"}
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # the backend an estimate plans collectives for, per device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--world", type=int, required=True, help="ranks (data-parallel world size)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (gloo) or cuda (NCCL's collectives, CUDA's attention, autocast and allocator; the CPU plan's peak "
        "beside it); default cpu",
    )
    parser.add_argument(
        "--stage", type=int, default=None, help="ZeRO stage 0-3 (default 3; 0 with --pipeline-parallel)"
    )
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (default 1)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    parser.add_argument(
        "--max-reuse-distance",
        type=int,
        default=0,
        help="stage 3: Config.max_reuse_distance, elements (DeepSpeed's stage3_max_reuse_distance; default 0)",
    )
    for flag in ("param-dtype", "master-dtype", "optimizer-state-dtype", "autocast"):
        parser.add_argument(f"--{flag}", choices=sorted(DTYPES), default=None)
    parser.add_argument(
        "--ranks-per-node", type=int, default=None, help="consecutive ranks per node (default: one node)"
    )
    parser.add_argument("--inter-node-gbps", type=float, default=None, help="each rank's link across nodes, Gbit/s")
    parser.add_argument("--inter-node-latency-us", type=float, default=None, help="latency across nodes, microseconds")
    parser.add_argument("--shard-group-size", type=int, default=None, help="Config.shard_group_size (hybrid sharding)")
    parser.add_argument("--sequence-parallel", type=int, default=None, help="Config.sequence_parallel (Ulysses)")
    parser.add_argument(
        "--secondary-shard-group-size", type=int, default=None, help="Config.secondary_shard_group_size (hpZ, stage 3)"
    )
    add_pipeline_arguments(parser)
    parser.add_argument("--budget", default=None, help="memory per rank, e.g. 80GiB: the largest micro-batch that fits")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="with --budget: the memory plan (remat, offload, reuse) Config(memory_budget=...) runs at --micro-batch",
    )
    parser.add_argument("--plot", default=None, help="PNG of live bytes over the step's nodes (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


@dataclass(frozen=True)
class Setting:
    """A model, a world and the stage and precision of one estimate."""

    model: str
    world: int
    stage: int
    seq: int
    dtypes: tuple[tuple[str, str | None], ...]
    max_reuse_distance: int = 0
    device: str = "cpu"
    groups: tuple[int | None, int | None] = (None, None)  # Config.shard_group_size, secondary_shard_group_size
    ranks_per_node: int | None = None
    inter_node: tuple[float | None, float | None] = (None, None)  # Gbit/s, seconds of latency
    sequence_parallel: int | None = None  # each rank traces its slice of every sequence
    pipeline: PipelineFlags | None = None

    def config(self) -> Config:
        d = {k: (DTYPES[v] if v else None) for k, v in self.dtypes}
        return Config(
            stage=self.stage,
            backend="eager",
            param_dtype=d["param_dtype"],
            master_dtype=d["master_dtype"],
            optimizer_state_dtype=d["optimizer_state_dtype"],
            autocast_dtype=d["autocast"],
            max_reuse_distance=self.max_reuse_distance,
            shard_group_size=self.groups[0],
            secondary_shard_group_size=self.groups[1],
            sequence_parallel=self.sequence_parallel,
            **pipeline_fields(self.pipeline),
        )

    def describe(self) -> str:
        chosen = [f"{k}={v}" for k, v in self.dtypes if v]
        reuse = f", max_reuse_distance={self.max_reuse_distance}" if self.max_reuse_distance and self.stage == 3 else ""
        names = ("shard_group_size", "secondary_shard_group_size")
        groups = "".join(f", {name}={size}" for name, size in zip(names, self.groups) if size)
        groups += f", sequence_parallel={self.sequence_parallel}" if self.sequence_parallel else ""
        groups += describe_pipeline(self.pipeline)
        return f"stage {self.stage}" + (f", {', '.join(chosen)}" if chosen else ", fp32") + reuse + groups


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: Tensor, targets: Tensor) -> Tensor:
    loss = lm_loss(model(idx), targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _meta_call(setting: Setting, micro_batch: int) -> StepCall:
    """A call of the plain AdamW step on the setting's model built on the meta device, at ``micro_batch``."""
    build, _, _ = MODELS[setting.model]
    batch = micro_batch * (setting.pipeline.microbatches if setting.pipeline else 1)  # a pipeline's call: M of them
    with torch.device("meta"):
        model = build(setting.seq)
        idx = torch.zeros(batch, setting.seq // (setting.sequence_parallel or 1), dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return StepCall.of(_train_step, (model, opt, idx, idx), {})


def run_plan(setting: Setting, micro_batch: int, budget: int) -> MemoryPlan:
    """The memory plan for one setting at one micro-batch under ``budget`` (the model on the meta device)."""
    call = _meta_call(setting, micro_batch)
    with _gc_paused():
        try:
            return plan_memory(call, setting.config(), budget, setting.world, setting.device)
        except MemoryBudgetError as error:
            raise EstimateInputError(str(error)) from error


@functools.lru_cache(maxsize=16)
def run_estimate(setting: Setting, micro_batch: int) -> Estimate:
    """Estimate one setting at one micro-batch (the model on the meta device; collectives priced as NCCL's: on
    ``cuda`` by this machine's NCCL measurement when it has one, else analytically); once per ``run``."""
    call = _meta_call(setting, micro_batch)
    with _gc_paused():
        model, rpn = _cost_model(setting), setting.ranks_per_node
        return estimate_step(call, setting.config(), setting.world, model, setting.device, ranks_per_node=rpn)


def _cost_model(setting: Setting) -> CostModel:
    """NCCL's: this machine's measurement on ``cuda`` when it has one, else analytical; across nodes, the flags'."""
    model = known_cost_model("nccl", "cuda", setting.world) if setting.device == "cuda" else None
    return with_inter_node(model or analytical_cost_model("nccl"), "nccl", *setting.inter_node)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while one estimate runs (this command's own process): the graphs and
    fake tensors live until it ends, and every full collection walks all of them (a tenth of the time at
    Llama-70B's size); what is left is collected afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def setting_from_args(args: argparse.Namespace) -> Setting:
    if args.model not in MODELS:
        raise EstimateInputError(f"unknown model {args.model!r}; choose one of {', '.join(MODELS)}")
    if args.world < 1:
        raise EstimateInputError(f"--world must be at least 1, got {args.world}")
    if args.device not in DEVICES:
        raise EstimateInputError(f"--device must be one of {', '.join(DEVICES)}, got {args.device!r}")
    if args.stage is None:
        args.stage = 0 if args.pipeline_parallel is not None else 3
    if args.stage not in (0, 1, 2, 3):
        raise EstimateInputError(f"--stage must be 0, 1, 2 or 3, got {args.stage}")
    if args.micro_batch < 1:
        raise EstimateInputError(f"--micro-batch must be at least 1, got {args.micro_batch}")
    seq = args.seq if args.seq is not None else MODELS[args.model][2]
    if seq < 1:
        raise EstimateInputError(f"--seq must be at least 1, got {seq}")
    dtypes = tuple((k, getattr(args, k)) for k in ("param_dtype", "master_dtype", "optimizer_state_dtype", "autocast"))
    groups = (args.shard_group_size, args.secondary_shard_group_size)
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        raise EstimateInputError(f"--ranks-per-node must be at least 1, got {args.ranks_per_node}")
    latency = args.inter_node_latency_us * 1e-6 if args.inter_node_latency_us is not None else None
    setting = Setting(args.model, args.world, args.stage, seq, dtypes, args.max_reuse_distance, args.device, groups)
    links = {"ranks_per_node": args.ranks_per_node, "inter_node": (args.inter_node_gbps, latency)}
    setting = replace(setting, sequence_parallel=args.sequence_parallel, pipeline=pipeline_of(args), **links)
    if args.sequence_parallel and seq % args.sequence_parallel:
        raise EstimateInputError(f"--seq {seq} does not divide by --sequence-parallel {args.sequence_parallel}")
    try:
        setting.config()
        _cost_model(setting)
        check_group_size("shard_group_size", groups[0], args.world)
        check_group_size("secondary_shard_group_size", groups[1], args.world)
        check_group_size("sequence_parallel", args.sequence_parallel, args.world)
        if setting.pipeline is not None:
            check_pipeline_groups(groups[0], setting.pipeline.parallel, args.world)
    except ValueError as error:
        raise EstimateInputError(str(error).splitlines()[0]) from error
    return setting


def table(setting: Setting, micro_batch: int, e: Estimate) -> str:
    """The estimate as a readable table."""
    on = " on cuda" if setting.device == "cuda" else ""
    rows = [
        f"zgraph estimate: {setting.model}, {setting.world} rank(s){on}, {setting.describe()}, micro-batch "
        f"{micro_batch}, sequence {setting.seq}",
        f"  parameters            {e.params:,}",
        "  model state per rank",
    ]
    for kind, nbytes in e.model_state_bytes.items():
        if nbytes or kind == "total":
            rows.append(f"    {kind:<20}{gib(nbytes):>14}")
    rows.append(f"  peak per rank         {gib(e.peak_bytes):>14}   at node {e.peak_node} (of {e.nodes})")
    largest = ", ".join(f"{name} {gib(n)}" for name, n in e.alive_at_peak[:4])
    rows.append(f"    largest alive there: {largest}")
    rows.append(f"  activations per rank  {gib(e.activation_bytes):>14}   (saved for the backward, at most at once)")
    rows.append("  communication per step")
    for kind in sorted(e.comm_bytes):
        rows.append(
            f"    {kind:<24}{e.comm_count[kind]:>6} x  {gib(e.comm_bytes[kind]):>12}  "
            f"~{e.comm_seconds[kind] * 1e3:.1f} ms ({e.cost_model_source})"
        )
    if not e.comm_bytes:
        rows.append("    none (one rank)")
    else:
        ops = ", ".join(f"{op} {n}" for op, n in sorted(e.comm_ops.items()))
        rows.append(f"    as {BACKENDS[e.device]} runs them: {ops}")
        links = e.link_bytes
        rows.append(f"    within a node {gib(links['intra_node']):>12}, across nodes {gib(links['inter_node']):>12}")
    return "\n".join(rows + stage_rows(e))


def plot(e: Estimate, path: str, title: str) -> bool:
    """Live bytes over the step's nodes as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot([b / 2**30 for b in e.live_bytes])
    ax.set_xlabel("node (execution order)")
    ax.set_ylabel("live GiB per rank")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def largest_micro_batch(setting: Setting, budget: int) -> tuple[int, Estimate] | None:
    """The largest micro-batch whose peak fits ``budget`` and its estimate; None when micro-batch 1 does not fit.

    Each node's live bytes is ``a + c * micro_batch`` (same graph, activations linear in the batch): traces at 1
    and 2 give ``a`` and ``c`` per node, the bound is the smallest ``(budget - a) / c``; a trace at the answer
    checks it."""
    one, two = run_estimate(setting, 1), run_estimate(setting, 2)
    if one.peak_bytes > budget:
        return None
    if len(one.live_bytes) != len(two.live_bytes):  # the graph changed with the batch: bisect on traces
        raise EstimateInputError("the step's graph depends on the micro-batch; --budget cannot fit a line to it")
    bound = None
    for a1, a2 in zip(one.live_bytes, two.live_bytes):
        slope = a2 - a1
        if slope > 0:
            fits = 1 + (budget - a1) // slope
            bound = fits if bound is None else min(bound, fits)
    if bound is None:  # nothing grows with the batch
        return 2**31, two
    checked = run_estimate(setting, bound)
    if checked.peak_bytes > budget:
        raise AssertionError(f"micro-batch {bound} was predicted to fit but its trace peaks at {checked.peak_bytes}")
    return bound, checked


def alternatives(setting: Setting, micro_batch: int, budget: int) -> list[tuple[Setting, Estimate]]:
    """Higher stages and the bf16 recipe (bf16 parameters, master weights, optimizer states, autocast), each
    estimated at ``micro_batch``, that fit ``budget``."""
    recipe = tuple((k, BF16_RECIPE[k]) for k, _ in setting.dtypes)
    candidates = []
    for stage in range(setting.stage, 4):
        for dtypes in (setting.dtypes, recipe):
            candidate = replace(setting, stage=stage, dtypes=dtypes)
            if candidate != setting and candidate not in candidates:
                candidates.append(candidate)
    fitting = []
    for candidate in candidates:
        e = run_estimate(candidate, micro_batch)
        if e.peak_bytes <= budget:
            fitting.append((candidate, e))
    return fitting


def run(args: argparse.Namespace) -> str:
    """The command's output for ``args``; raises ``EstimateInputError`` (or ``zgraph.CaptureError``) on bad input."""
    run_estimate.cache_clear()
    setting = setting_from_args(args)
    budget = parse_bytes(args.budget) if args.budget is not None else None
    if args.plan:
        if budget is None:
            raise EstimateInputError("--plan needs --budget (the memory per rank to plan for)")
        plan = run_plan(setting, args.micro_batch, budget)
        chosen = {"changes": plan.chosen.changes, **plan.chosen.estimate.to_json()}
        out = {"model": setting.model, "micro_batch": args.micro_batch, "budget_bytes": budget, "plan": chosen}
        return json.dumps(out, indent=2) if args.json else "\n".join(plan.lines())
    e = run_estimate(setting, args.micro_batch)
    out: dict = {"model": setting.model, "micro_batch": args.micro_batch, "seq": setting.seq, **e.to_json()}
    lines = [table(setting, args.micro_batch, e)]
    if setting.device != "cpu":  # the same step planned for the CPU, for comparison
        host = run_estimate(replace(setting, device="cpu"), args.micro_batch)
        out["cpu_peak_bytes"] = host.peak_bytes
        lines.append(
            f"  peak on cpu/{BACKENDS['cpu']}: {gib(host.peak_bytes)}; on {setting.device}/{BACKENDS[setting.device]}: "
            f"{gib(e.peak_bytes)}"
        )
    if budget is not None:
        if e.model_state_bytes["total"] > budget:
            fits = alternatives(setting, args.micro_batch, budget)
            hint = (
                f"; {fits[0][0].describe()} fits (peak {gib(fits[0][1].peak_bytes)})"
                if fits
                else (f"; no stage or bf16 setting fits on {setting.world} rank(s): use more ranks")
            )
            raise EstimateInputError(
                f"budget {gib(budget)} is below the model states alone ({gib(e.model_state_bytes['total'])} per "
                f"rank at {setting.describe()}){hint}"
            )
        found = largest_micro_batch(setting, budget)
        out["budget_bytes"] = budget
        out["largest_micro_batch"] = found[0] if found else 0
        if found:
            lines.append(
                f"  budget {gib(budget)}: largest micro-batch that fits: {found[0]} (peak {gib(found[1].peak_bytes)})"
            )
        if e.peak_bytes > budget:
            fits = alternatives(setting, args.micro_batch, budget)
            out["fitting_settings"] = [s.describe() for s, _ in fits]
            said = "; ".join(f"{s.describe()} (peak {gib(f.peak_bytes)})" for s, f in fits) or "none: use more ranks"
            lines.append(f"  micro-batch {args.micro_batch} does not fit {gib(budget)}; settings that fit: {said}")
    if args.plot:
        drawn = plot(e, args.plot, f"{setting.model}, {setting.world} ranks, {setting.describe()}")
        lines.append(f"  plot: {args.plot}" if drawn else "  plot: matplotlib is not installed, none drawn")
    return json.dumps(out, indent=2) if args.json else "\n".join(lines)
