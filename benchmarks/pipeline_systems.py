"""The systems of ``benchmarks.pipeline``, each built on one rank from the same GPT (same seed, same weights).

A system's name says what it runs: ``zgraph-p4-1f1b`` (zgraph, ``P = 4``), ``torch-p2-gpipe``
(``torch.distributed.pipelining``, ``P = 2`` x ``D = 2``), ``deepspeed-p4-1f1b`` (DeepSpeed's ``PipelineModule``,
its 1F1B), ``zgraph-p4-1f1b-m4`` (4 micro-batches instead of ``--microbatches``), ``zgraph-p2-1f1b-w2`` (on 2
ranks instead of 4: one pipeline, a CPU per rank on this machine), ``zgraph-z3`` (zgraph ZeRO-3 on
every rank, no pipelines) and ``eager-1proc`` (the reference: eager PyTorch on the whole batch in one process).
Schedules: ``gpipe``, ``1f1b``, ``interleaved`` (interleaved 1F1B, 2 stages per rank), ``zb_h1`` (zero bubble).

Every pipeline splits the blocks alike: ``P * v`` stages of equal block counts, the embeddings with the first, the
final norm and head with the last. With ``D = world / P`` pipelines, pipeline ``d`` takes rows ``d`` of ``D``
equal slices of the global batch (``zgraph.pipeline_batch``); each stage's gradients are summed over the pipelines
once per step. ``build`` returns a ``System``: ``step(idx, tgt)`` on the global batch (the system takes its rows)
returning the loss where this rank knows it (None elsewhere), and which pipeline the rank is in.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.compare_worker import adamw, train_step
from benchmarks.pipeline_timeline import Recorder
from zgraph.demos.models import GPT, Block, lm_loss

SCHEDULES = {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "interleaved": ("interleaved_1f1b", 2), "zb_h1": ("zb_h1", 1)}
"""A system name's schedule: zgraph's name for it and the stages per rank."""
NAME = re.compile(
    r"(zgraph|torch|deepspeed)-p([24])-(gpipe|1f1b|interleaved|zb_h1)(?:-m(\d+))?(?:-w(\d+))?(-compiled)?"
)

StepFn = Callable[[Tensor, Tensor], float | None]


@dataclass
class System:
    """A built system: ``step(idx, tgt) -> loss or None`` on the global batch, and the rank's pipeline."""

    step: StepFn
    pipeline: int | None = None


@dataclass(frozen=True)
class Spec:
    """What a pipelined system's name says."""

    impl: str
    ranks: int  # P
    schedule: str  # zgraph's name
    virtual: int
    microbatches: int
    world: int = 4
    compiled: bool = False  # zgraph: backend="inductor" (its default); torch: each stage module torch.compile'd


def parse(name: str, microbatches: int) -> Spec | None:
    """The spec of a pipelined system's name (None for ``zgraph-z3`` and ``eager-1proc``)."""
    match = NAME.fullmatch(name)
    if match is None:
        return None
    impl, p, schedule, m, w, compiled = match.groups()
    zgraph_name, virtual = SCHEDULES[schedule]
    return Spec(impl, int(p), zgraph_name, virtual, int(m) if m else microbatches, int(w) if w else 4, bool(compiled))


def split_points(layers: int, stages: int) -> list[int]:
    """The first block of each stage: equal counts (``layers`` a multiple of ``stages``)."""
    if layers % stages:
        raise ValueError(f"{layers} blocks do not split into {stages} equal stages")
    return [s * layers // stages for s in range(stages)]


def rows(t: Tensor, ranks: int) -> Tensor:
    """This rank's pipeline's rows of ``t`` (``zgraph.pipeline_batch``)."""
    import zgraph

    return zgraph.pipeline_batch(t, ranks)


# ------------------------------------------------------------------------------------------------ eager, zgraph
def build_eager(gpt: GPT, lr: float) -> System:
    opt = adamw(gpt, lr)
    return System(lambda idx, tgt: float(train_step(gpt, opt, idx, tgt)))


def build_zgraph_z3(gpt: GPT, lr: float) -> System:
    import zgraph

    opt = adamw(gpt, lr)
    step = zgraph.distribute(zgraph.Config(stage=3, backend="eager"))(train_step)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def run(idx: Tensor, tgt: Tensor) -> float:
        b = idx.shape[0] // world
        return float(step(gpt, opt, idx[rank * b : (rank + 1) * b], tgt[rank * b : (rank + 1) * b]))

    return System(run)


def build_zgraph(gpt: GPT, lr: float, spec: Spec, recorder: Recorder) -> System:
    import zgraph
    from zgraph.runtime.pipeline_run import RankRunner

    for method, kind in (("_forward", "F"), ("_backward", "B"), ("_input_grad", "I"), ("_weight_grad", "W")):
        recorder.wrap(RankRunner, method, kind)
    starts = split_points(len(gpt.blocks), spec.ranks * spec.virtual)[1:]
    config = zgraph.Config(
        backend="inductor" if spec.compiled else "eager",
        pipeline_parallel=spec.ranks, microbatches=spec.microbatches, schedule=spec.schedule,
        pipeline_virtual_stages=spec.virtual, pipeline_split=[f"blocks.{s}" for s in starts],
    )  # fmt: skip
    opt = adamw(gpt, lr)
    step = zgraph.distribute(config)(train_step)
    return System(lambda idx, tgt: float(step(gpt, opt, rows(idx, spec.ranks), rows(tgt, spec.ranks))),
                  int(os.environ.get("RANK", "0")) // spec.ranks)  # fmt: skip


# ------------------------------------------------------------------------------------------------ torch
class StageModule(nn.Module):
    """Blocks ``[first, end)`` of ``gpt`` (the same modules), the embeddings before them on the first stage, the
    final norm and head after them on the last."""

    def __init__(self, gpt: GPT, first: int, end: int):
        super().__init__()
        self.embed = Embed(gpt) if first == 0 else None
        self.blocks = nn.ModuleList(gpt.blocks[first:end])
        self.head = Head(gpt) if end == len(gpt.blocks) else None

    def forward(self, x: Tensor) -> Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


class Embed(nn.Module):
    def __init__(self, gpt: GPT):
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos

    def forward(self, idx: Tensor) -> Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self, gpt: GPT):
        super().__init__()
        self.ln, self.head = gpt.ln, gpt.head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.ln(x))


def pipeline_groups(ranks: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None, int]:
    """This rank's pipeline group (consecutive ranks, as zgraph's), its data-parallel group (same place in every
    pipeline; None with one pipeline) and its pipeline's index. Every rank creates every group, in one order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pipes = [dist.new_group(list(range(d * ranks, (d + 1) * ranks))) for d in range(world // ranks)]
    datas = [dist.new_group(list(range(p, world, ranks))) for p in range(ranks)] if world > ranks else []
    return pipes[rank // ranks], (datas[rank % ranks] if datas else None), rank // ranks


def build_torch(gpt: GPT, lr: float, spec: Spec, recorder: Recorder) -> System:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )
    from torch.distributed.pipelining.stage import _PipelineStageBase

    for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
        recorder.wrap(_PipelineStageBase, method, kind)
    group, data, pipeline = pipeline_groups(spec.ranks)
    place, count = dist.get_rank(group), spec.ranks * spec.virtual
    starts = [*split_points(len(gpt.blocks), count), len(gpt.blocks)]
    mine = [s for s in range(count) if s % spec.ranks == place]
    modules = [StageModule(gpt, starts[s], starts[s + 1]) for s in mine]
    run = [torch.compile(m) if spec.compiled else m for m in modules]
    stages = [PipelineStage(m, s, count, torch.device("cpu"), group=group) for m, s in zip(run, mine)]
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
            "zb_h1": ScheduleInterleavedZeroBubble}[spec.schedule]  # fmt: skip
    single = kind in (ScheduleGPipe, Schedule1F1B)
    schedule = kind(stages[0] if single else stages, spec.microbatches, loss_fn=lm_loss)
    opts = [adamw(m, lr) for m in modules]
    first, last = 0 in mine, count - 1 in mine

    def step(idx: Tensor, tgt: Tensor) -> float | None:
        losses: list[Tensor] = []
        idx, tgt = rows(idx, spec.ranks), rows(tgt, spec.ranks)
        schedule.step(*((idx,) if first else ()), target=tgt if last else None, losses=losses)
        if data is not None:
            for m in modules:
                _all_reduce_mean(list(m.parameters()), data)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        return float(torch.stack(losses).mean()) if last else None

    return System(step, pipeline)


def _all_reduce_mean(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """The gradients averaged over ``group``: one flat all-reduce (a bucket per stage, as zgraph's)."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for g, value in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(value.view_as(g))


# ------------------------------------------------------------------------------------------------ DeepSpeed
def deepspeed_config(micro_batch: int, microbatches: int, data: int) -> dict:
    """fp32, no clipping (DeepSpeed's default clips at 1.0), ``microbatches`` accumulated per step, quiet."""
    return {
        "train_batch_size": micro_batch * microbatches * data,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": microbatches,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def build_deepspeed(gpt: GPT, lr: float, spec: Spec, recorder: Recorder, batch: int) -> System:
    """DeepSpeed's ``PipelineModule`` over the embeddings, the blocks and the head, split by block count
    (``partition_method="type:Block"``: the same split), its 1F1B ``PipelineEngine``, gloo."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe import schedule as ds_schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    actions = PipelineEngine._INSTRUCTION_MAP  # what its schedule's instructions call
    for instruction, kind in ((ds_schedule.ForwardPass, "F"), (ds_schedule.BackwardPass, "B")):
        actions[instruction] = recorder.timed(actions[instruction], kind)
    layers = [Embed(gpt), *gpt.blocks, Head(gpt)]
    module = PipelineModule(layers, num_stages=spec.ranks, loss_fn=lm_loss, partition_method=f"type:{Block.__name__}")
    data = dist.get_world_size() // spec.ranks
    config = deepspeed_config(batch // (data * spec.microbatches), spec.microbatches, data)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=adamw(module, lr), config=config)
    pipeline = engine.grid.get_data_parallel_id()

    def step(idx: Tensor, tgt: Tensor) -> float:
        b = idx.shape[0] // data
        mine = idx[pipeline * b : (pipeline + 1) * b], tgt[pipeline * b : (pipeline + 1) * b]
        return float(engine.train_batch(_micro_batches(*mine, spec.microbatches)))

    return System(step, pipeline)


def _micro_batches(idx: Tensor, tgt: Tensor, count: int) -> Iterator[tuple[Tensor, Tensor]]:
    return iter(zip(idx.chunk(count), tgt.chunk(count)))


# ------------------------------------------------------------------------------------------------ dispatch
def build(name: str, gpt: GPT, lr: float, microbatches: int, batch: int, recorder: Recorder) -> System:
    """The system ``name`` on this rank (the process group is up for torch and DeepSpeed)."""
    if name == "eager-1proc":
        return build_eager(gpt, lr)
    if name == "zgraph-z3":
        return build_zgraph_z3(gpt, lr)
    spec = parse(name, microbatches)
    if spec is None:
        raise ValueError(f"unknown system {name!r}")
    if spec.impl == "zgraph":
        return build_zgraph(gpt, lr, spec, recorder)
    if spec.impl == "torch":
        return build_torch(gpt, lr, spec, recorder)
    return build_deepspeed(gpt, lr, spec, recorder, batch)
