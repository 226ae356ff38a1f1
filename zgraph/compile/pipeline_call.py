"""A pipelined step's call (``Config.pipeline_parallel``): this rank's schedule of its compiled stages
(``zgraph.compile.pipeline``) run against the live state (``zgraph.runtime.pipeline_run``), and the step's results
combined over the micro-batches: state is read once per call and written back after the updates; a 0-d result (a
mean loss) is combined over the micro-batches by its kind (``zgraph.passes.micro_batch_loss``), another
concatenated along dim 0.

Each backward is seeded with its micro-batch's share of the whole batch (the graph input ``loss_share``,
``zgraph.passes.micro_batch_loss``): ``1 / M`` for a mean over samples, else 1; a mean over tokens divides by the
whole batch's count (inputs of kind ``batch_count``), counted before any action by the ranks whose stages read it
(``zgraph.passes.token_count``, summed over the micro-batches and the pipelines), as Hugging Face's gradient
accumulation divides by the batch's items. Each value a backward makes per sample is then eager's on the whole
batch (each sum over its samples a part of eager's sum), so fp16 loss scaling overflows where eager's does per
sample; where eager's overflows only in a sum over the whole batch, the micro-batches' parts may not (a dynamic
scale settles up to ``M`` times higher). The gradients summed over the micro-batches are then divided by the
pipelines for a mean (what their reduction sums over), else by 1. Without shares (``LossCombine.shared`` False) or
for a token mean counted by its forward (labels made from activations: kind ``token``) every seed is 1 and the
summed gradients are divided by the whole batch's division: ``M`` x pipelines, or the counted tokens, summed from
each micro-batch's forward by the rank whose stage counts them and broadcast over the pipeline.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from zgraph.capture.as_written import hyperparameters
from zgraph.compile.run import finish_call, unalias
from zgraph.compile.variant import CompiledStep, PipelineCompiled
from zgraph.errors import RankMismatchError
from zgraph.graph import GraphInput
from zgraph.passes.micro_batch_loss import LOSS_SHARE
from zgraph.runtime.pipeline_run import Divisor, Feed, Peers, RankPlan, RankRunner, Shape
from zgraph.runtime.process_group import ProcessGroupInfo
from zgraph.runtime.stage_state import released_state
from zgraph.runtime.state import Binding
from zgraph.runtime.state_io import StateIO
from zgraph.sizes import concrete_shape


def run_pipeline(
    compiled: CompiledStep, binding: Binding, micro: list[list[tuple[str, Tensor]]], group: ProcessGroupInfo
) -> object:
    """Run this rank's schedule of ``compiled`` on the live state; ``micro``: each micro-batch's user tensors."""
    program = compiled.pipeline
    io = StateIO(binding, binding.plan)
    hyper: dict[tuple[int, int], dict[str, float]] = {}
    state: dict[GraphInput, Tensor] = {}

    def feed(spec: GraphInput, mb: int | None) -> Tensor:
        if spec.kind in ("input", "input_grad"):
            return io.read(spec, micro[mb or 0], hyper)
        if spec.kind == "hparam" and (spec.optimizer, spec.group) not in hyper:
            opt = binding.optimizers[spec.optimizer].optimizer
            hyper[(spec.optimizer, spec.group)] = hyperparameters(opt, opt.param_groups[spec.group])
        if spec not in state:  # state is read once per call
            state[spec] = io.read(spec, micro[0], hyper)
        return state[spec]

    peers = program.peers
    _same_rows(micro, peers)
    pending: list[tuple[dist.Work, Tensor]] = []  # the token count's broadcast from its rank, in flight
    share, divisor = _shares(program, peers, pending)
    state[LOSS_SHARE] = share
    state.update(_batch_counts(program, peers, feed))
    plan = RankPlan(
        schedule=program.schedule,
        rank=program.rank,
        stages=program.stages,
        peers=peers,
        update_reduces=program.update_reduces,
        totals=tuple(program.totals),
        regather=program.regather,
    )
    sizes = {symbol: micro[0][index][1].shape[dim] for symbol, (index, dim) in program.sizes.items()}
    shape = functools.partial(concrete_shape, sizes=sizes)
    results = RankRunner(plan, feed, divisor, shape).run()
    user: dict[int, Tensor] = {}
    for s, (inputs, outputs) in results.updates.items():
        part = program.stages[s].update
        unalias(outputs, inputs, part.updated_inputs)
        for role, value in zip(part.outputs, outputs):
            if role.kind == "user":
                user[role.index] = value
            else:
                io.write(role, value, micro[0])
    released_state(binding, program.state_elsewhere)
    for (_, index), values in results.user.items():
        kind = program.combine.results.get(index, "mean")
        user[index] = _combined([values[mb] for mb in sorted(values)], kind, results.divisor)
    values = [_shared(index, user.get(index), program, peers, shape) for index in sorted(program.results)]
    values = [
        _over_pipelines(v, program.combine.results.get(i, "mean"), peers)
        for i, v in zip(sorted(program.results), values)
    ]
    for work, _ in pending:
        work.wait()
    return finish_call(compiled, binding, micro[0], values)


def _same_rows(micro: list[list[tuple[str, Tensor]]], peers: Peers) -> None:
    """Every rank of a pipeline (of one sequence slice) must pass the same rows: its first stage reads the inputs,
    its last the labels. Each argument tensor's fingerprint (its sum and a position-weighted sum of up to 1024 of
    its elements, in float64) is compared over the pipeline's ranks, one all-gather a step; where they differ every
    rank of the pipeline raises ``RankMismatchError`` naming the arguments, before anything runs."""
    if len(peers.ranks) == 1 or not micro[0]:
        return
    parts = []
    for rows in micro:
        for _, t in rows:
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 1024)].double()
            weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=flat.device)
            fingerprint = torch.stack([flat.sum(dtype=torch.float64), (sample * weights).sum()])
            parts.append(fingerprint.nan_to_num(nan=0.5, posinf=1.5, neginf=-1.5))
    mine = torch.stack(parts)
    every = torch.empty((len(peers.ranks) * len(parts), 2), dtype=mine.dtype, device=mine.device)
    dist.all_gather_into_tensor(every, mine, group=peers.group)
    differ = (every.view(-1, *mine.shape) != mine).any(0).any(-1).reshape(len(micro), -1).any(0).tolist()
    if any(differ):
        names = [path for (path, _), d in zip(micro[0], differ) if d]
        raise RankMismatchError(
            f"the ranks of a pipeline (global ranks {peers.ranks}) passed different values of {', '.join(names)}: "
            "every rank of a pipeline must pass the same rows (its first stage reads the inputs, its last the "
            "labels). Give each rank its pipeline's rows with zgraph.pipeline_batch(batch, P), not a sampler's "
            "share per rank"
        )


def _shares(program: PipelineCompiled, peers: Peers, pending: list[tuple[dist.Work, Tensor]]) -> tuple[Tensor, Divisor]:
    """The seeds' share and what the summed gradients are divided by."""
    one = torch.ones(())
    if program.combine.kind == "mean" and program.combine.shared:
        pipelines = float(peers.pipelines)
        return one / program.schedule.microbatches, lambda counts: pipelines
    return one, functools.partial(_divisor, program, peers, pending)


def _batch_counts(program: PipelineCompiled, peers: Peers, feed: Feed) -> dict[GraphInput, Tensor]:
    """Each whole batch's count this rank's stage graphs read (``batch_count``): its graph run on every
    micro-batch, summed, summed over the pipelines, and cast to the dtype the graphs read."""
    parts = [p for s in program.stages.values() for p in (s.forward, s.backward, s.input_grad, s.weight_grad)]
    examples = {spec: e for p in parts for spec, e in zip(p.inputs, p.examples) if spec.kind == "batch_count"}
    counts = {}
    for spec, part in program.counts:
        if spec in examples:
            per = [part.run([feed(s, mb) for s in part.inputs])[0] for mb in range(program.schedule.microbatches)]
            total = torch.stack(per).sum()
            if peers.data is not None:
                dist.all_reduce(total, group=peers.data)  # the whole batch's, over every pipeline's rows
            counts[spec] = total.to(examples[spec].dtype)
    return counts


def _combined(values: list[Tensor], kind: str, divisor: Tensor | float) -> Tensor:
    """A result over the micro-batches: a 0-d one by its kind (``LossCombine``), another concatenated along dim 0."""
    if values[0].dim():
        return torch.cat(values)
    total = torch.stack(values).sum()
    if kind == "sum":
        return total
    return total / (divisor if kind == "token" else len(values))


def _divisor(
    program: PipelineCompiled, peers: Peers, pending: list[tuple[dist.Work, Tensor]], counts: dict[int, Tensor]
) -> Tensor | float:
    """What the summed gradients are divided by: the micro-batch count for a mean, 1 for a sum, the whole batch's
    counted tokens for a token mean (summed on the rank whose stage counts them, and broadcast: that rank does not
    wait for the others to receive it, its broadcast joins ``pending``, waited for at the end of the call)."""
    kind = program.combine.kind
    if kind != "token":
        return 1.0 if kind == "sum" else float(program.schedule.microbatches * peers.pipelines)
    source = peers.ranks[program.schedule.rank_of(program.count_stage)]
    total = torch.stack([counts[mb] for mb in sorted(counts)]).sum() if counts else None
    if len(peers.ranks) > 1 and total is None:
        total = torch.empty((), dtype=program.combine.count_dtype)
        dist.broadcast(total, source, group=peers.group)
    elif len(peers.ranks) > 1:
        sent = total.clone()  # ``total`` goes on: all-reduced over the pipelines below
        pending.append((dist.broadcast(sent, source, group=peers.group, async_op=True), sent))
    assert total is not None
    if peers.data is not None:
        dist.all_reduce(total, group=peers.data)  # the whole batch's count, over every pipeline's rows
    return total


def _over_pipelines(value: Tensor, kind: str, peers: Peers) -> Tensor:
    """A 0-d result over the whole batch from each pipeline's (a mean averaged, a sum or a token mean's part
    summed); another (concatenated along the samples) stays the pipeline's rows."""
    if peers.data is None or value.dim() or kind in ("same", "step"):
        return value
    dist.all_reduce(value, group=peers.data)
    return value / peers.pipelines if kind == "mean" else value


def _shared(index: int, value: Tensor | None, program: PipelineCompiled, peers: Peers, shape: Shape) -> Tensor:
    """Result ``index`` on every rank of the pipeline: broadcast by the rank whose stage makes it (``shape``: its
    example's shape at the call's sizes)."""
    stage, example = program.results[index]
    if len(peers.ranks) == 1:
        assert value is not None
        return value
    if value is None:
        count, one = program.schedule.microbatches, shape(example.shape)
        value = torch.empty(one if not one else (one[0] * count, *one[1:]), dtype=example.dtype, device=example.device)
    dist.broadcast(value, peers.ranks[program.schedule.rank_of(stage)], group=peers.group)
    return value
