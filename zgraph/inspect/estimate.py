"""``step.estimate(...)``: memory and communication of the transformed step, per rank, without running it.

The step is captured and transformed as a call would do it, but on stand-ins: the modules and optimizers among
the arguments are copied with every parameter, buffer, ``.grad`` and optimizer state tensor on the meta device (no
memory), traced as fake tensors on the device they stand for, and sharded by a plan for ``world_size`` ranks. The
estimate needs no process group: collectives are never run, and the fake kernels of functional collectives
read only the group's size (the graph names a group, ``zgraph-estimate``, that does not exist). The real step's
modules, optimizers, caches and process group are left as they were.

From the final graph (the passes' result as the eager backend rewrites it, updates in place included):

- model state: what the graph reads and writes back — parameters (split into ``params`` and ``master``: a
  parameter stored in a wider dtype than the step computes in is the master copy; zgraph keeps no second copy),
  the ``.grad`` left after the step, optimizer state, buffers — each rank's padded shard where it is sharded;
- the peak: liveness in execution order (``zgraph.inspect.liveness``);
- communication: every collective node, counted and sized by the graph contract, priced by the cost model.

The device (``device=``; default: the device of the model's parameters, else the CPU) is the one the step is planned
for. For ``"cuda"`` the group's backend is NCCL (the passes lower reduce-scatters natively, not as gloo's all-to-all;
collectives are priced by the NCCL cost model this machine has measured, else the analytical one), offload to host
memory moves state as it does from a GPU, and liveness counts CUDA caching-allocator blocks and NCCL's collectives
(``zgraph.inspect.liveness``). Where this torch can trace CUDA tensors the stand-ins are CUDA fakes (torch's own
autocast and attention choice); elsewhere they are CPU fakes traced under ``zgraph.capture.cuda_trace``, which makes
attention and autocast CUDA's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from zgraph.binding.arguments import StepCall
from zgraph.binding.guards import discover
from zgraph.binding.host_layout import host_layout
from zgraph.binding.micro_batches import microbatches, split_call
from zgraph.binding.setup import plan_state
from zgraph.capture.captured import CapturedGraph
from zgraph.compile.build import pass_context
from zgraph.compile.lower import lower
from zgraph.compile.pipeline import cut_stages, stage_context
from zgraph.config import Config
from zgraph.config_checks import pipeline_world_error
from zgraph.graph import CostModel
from zgraph.graph_copy import copy_graph_module
from zgraph.inspect.liveness import liveness
from zgraph.inspect.model_state import state_pieces, state_totals
from zgraph.inspect.pipeline_estimate import Planned, StageEstimate, pipeline_figures
from zgraph.inspect.reuse import HeldCapture, reused
from zgraph.inspect.shadow import EstimateError, capture_standins, marked_dims, shadow_call
from zgraph.passes import run_passes
from zgraph.runtime.cost_model import CostModel as RuntimeCostModel
from zgraph.runtime.cost_model import analytical_cost_model, crossing_groups, known_cost_model, with_inter_node
from zgraph.runtime.devices import served_backend
from zgraph.runtime.hybrid import planned_group
from zgraph.runtime.process_group import SINGLE_PROCESS, ProcessGroupInfo, ensure_process_group
from zgraph.runtime.state import Binding
from zgraph.runtime.timeline import collective_totals, transfer_seconds
from zgraph.runtime.timeline import estimate as timeline
from zgraph.sizes import size_symbols

ESTIMATE_GROUP = "zgraph-estimate"  # the group an estimate's graph names; never created
DEVICES = ("cpu", "cuda")  # the device types an estimate plans for


@dataclass(frozen=True)
class Estimate:
    """Memory and communication of one call of a step, per rank (every rank's graph has the same shapes).

    Attributes:
        world_size: ranks the step was planned for.
        stage: ZeRO stage.
        params: parameter count of the model(s) (tied parameters once).
        model_state_bytes: bytes held between steps, by kind: ``params`` (parameters stored in the compute
            dtype), ``master`` (parameters stored in a wider dtype than the compute dtype: the master copies),
            ``grads`` (``.grad`` left after the step), ``optimizer`` (optimizer state), ``buffers``; ``total``, their
            sum in memory; and ``offloaded``, the bytes of those that live in the offload tier's files instead
            (``Config.offload_optimizer`` / ``offload_params``; not in ``total`` nor in the kinds above).
        peak_bytes: most bytes alive while the step runs (model state, the batch, gathered parameters, buckets,
            activations, casts, temporaries), from liveness over the final graph.
        peak_node: the graph node running at the peak.
        activation_bytes: activations per rank: the most bytes held at once of values the forward made and the
            backward reads (``zgraph.inspect.liveness``: they grow with the sequence; remat, activation offload
            and sequence parallelism cut them); part of ``peak_bytes``.
        alive_at_peak: ``(node that made it, bytes)`` of each storage alive at the peak, largest first.
        comm_bytes: bytes per collective kind per step (the full tensor gathered or reduced; ``all_to_all``: the
            exchanges of sequence parallelism, the tensor exchanged).
        link_bytes: the same bytes per link class: ``intra_node`` (collectives whose group lies on one node) and
            ``inter_node`` (groups across nodes, ``ranks_per_node`` consecutive ranks per node).
        comm_count: collectives per kind per step.
        comm_seconds: seconds per collective kind per step, from the cost model (``cost_model_source``), each on
            its group's link class (``zgraph.runtime.cost_model``: across nodes at ``inter_node_gbps``).
        comm_ops: collectives per op of the final graph, by name (what runs: a reduce-scatter is
            ``reduce_scatter_tensor`` on NCCL, ``all_to_all_single`` and a sum on gloo).
        live_bytes: bytes alive at each node of the final graph, in execution order (for plotting).
        nodes: the final graph's node count.
        device: the device type the step was planned for, ``"cpu"`` or ``"cuda"``; on ``"cuda"`` every byte count
            above that is memory (model state, peak, live bytes) counts CUDA caching-allocator blocks
            (``zgraph.inspect.liveness.cuda_block_bytes``), as ``torch.cuda.max_memory_allocated`` does.
        step_seconds: predicted seconds of one call: compute and the communication it waits for, from the cost
            model (``zgraph.runtime.timeline``), plus the offload tier's transfers at the tier's bandwidth. A
            figure to compare configs by, not a measurement (with symbolic sizes: at the sizes traced).
        size_symbols: a step with symbolic sizes (arguments marked with ``zgraph.mark_dynamic``): each size
            symbol by name, with the argument path and dimension it stands for; empty for static sizes.
        sizes: the size each symbol was estimated at (``sizes=`` of ``step.estimate``, else the traced size): the
            byte counts above (model state, peak, activations, live bytes) are at these sizes.
        peak_formula: ``peak_bytes`` as an expression of the symbols (``sympy``): the bytes alive at the peak node,
            exact around ``sizes`` (the peak may move to another node far from them: estimate there again).
        activation_formula: ``activation_bytes`` likewise.
        stages: a pipelined step (``Config.pipeline_parallel``): each stage's ``StageEstimate`` (its model state,
            the activations the schedule holds, what it sends, its rank's peak and idle share); empty otherwise.
            Ranks then differ: the per-rank fields above are those of the pipeline's rank with the largest peak
            (``model_state_bytes``: its stages' state and every buffer, which each rank holds whole; ``peak_bytes``,
            ``peak_node``: the action at its peak; ``activation_bytes``: the most saved values it holds at once,
            over its stages and micro-batches); ``comm_*`` and ``link_bytes`` those of the rank sending the most,
            with ``send`` (point-to-point, activations and their gradients) and, with ``world / P`` pipelines,
            ``all_reduce`` at ZeRO stage 0 (each stage's gradients over the pipelines), at stage >= 1 the update's
            ``reduce_scatter_tensor`` (and at stages 1, 2 ``all_gather_into_tensor``), at stage 3 the
            ``all_gather_into_tensor`` of each stage's parameters once per step; ``live_bytes`` is empty
            (``zgraph.inspect.pipeline_estimate``).
        bubble: a pipelined step: the schedule's predicted bubble, the share of rank-time no rank computes (unit
            costs, as ``explain()``; ``(P - 1) / (M + P - 1)`` for GPipe and 1F1B); None otherwise.
    """

    world_size: int
    stage: int
    params: int
    model_state_bytes: Mapping[str, int]
    peak_bytes: int
    peak_node: str
    alive_at_peak: tuple[tuple[str, int], ...]
    comm_bytes: Mapping[str, int]
    comm_count: Mapping[str, int]
    comm_seconds: Mapping[str, float]
    cost_model_source: str = "analytical"
    comm_ops: Mapping[str, int] = field(default_factory=dict)
    live_bytes: tuple[int, ...] = field(default=(), repr=False)
    nodes: int = 0
    device: str = "cpu"
    step_seconds: float = 0.0
    link_bytes: Mapping[str, int] = field(default_factory=dict)
    activation_bytes: int = 0
    size_symbols: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    sizes: Mapping[str, int] = field(default_factory=dict)
    peak_formula: sympy.Expr | None = None
    activation_formula: sympy.Expr | None = None
    stages: tuple[StageEstimate, ...] = ()
    bubble: float | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``live_bytes`` left out; ``alive_at_peak``: the ten largest; formulas as text)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "live_bytes"}
        out["alive_at_peak"] = [list(item) for item in self.alive_at_peak[:10]]
        for name in ("peak_formula", "activation_formula"):
            out[name] = None if out[name] is None else str(out[name])
        out["stages"] = [{**dataclasses.asdict(s), "model_state_bytes": dict(s.model_state_bytes)} for s in self.stages]
        return {k: dict(v) if isinstance(v, Mapping) else v for k, v in out.items()}


def estimate_step(
    call: StepCall,
    config: Config,
    world_size: int | None = None,
    cost_model: CostModel | None = None,
    device: str | torch.device | None = None,
    ranks_per_node: int | None = None,
    inter_node_gbps: float | None = None,
    sizes: Mapping[str | tuple[str, int], int] | None = None,
    held: HeldCapture | None = None,
) -> Estimate:
    """The ``Estimate`` of a step of ``config`` making ``call`` on ``world_size`` ranks (None: the current world),
    planned for ``device`` (``"cpu"``, ``"cuda"`` or a ``torch.device``; None: the device of the model's
    parameters, else the CPU). ``cost_model``: prices collectives (default: the one the step would plan with for
    the backend that serves the device). ``ranks_per_node``: consecutive ranks per node (None: torchrun's
    ``LOCAL_WORLD_SIZE``, else one node); a collective whose group spans nodes is priced at ``inter_node_gbps``
    (Gbit/s per rank; None: the cost model's across-node default) and counted in ``link_bytes["inter_node"]``.
    ``sizes``: for arguments marked with ``zgraph.mark_dynamic`` (traced as size symbols), the sizes to estimate
    at, by symbol name or ``(argument path, dim)`` (``Estimate.size_symbols``); the others at the call's sizes.
    ``held``: the step's own capture of this call, copied where it is the graph the estimate would trace
    (``zgraph.inspect.reuse``)."""
    if config.pipeline_parallel is not None:
        return estimate_pipeline(call, config, world_size, cost_model, device, ranks_per_node, inter_node_gbps, sizes)
    prepared = prepare(call, config, world_size, cost_model, device, ranks_per_node, inter_node_gbps, held)
    config = prepared.config or config
    return estimate_variant(dataclasses.replace(prepared, sizes=dict(sizes or {})), config, copy=False)


def estimate_pipeline(
    call: StepCall,
    config: Config,
    world_size: int | None,
    cost_model: CostModel | None,
    device: str | torch.device | None,
    ranks_per_node: int | None,
    inter_node_gbps: float | None,
    sizes: Mapping[str | tuple[str, int], int] | None,
) -> Estimate:
    """The ``Estimate`` of a pipelined step (``Config.pipeline_parallel``; ``estimate_step``'s arguments): traced on
    its first micro-batch as the step captures it, cut by the pipeline's own passes, each stage and rank figured by
    ``zgraph.inspect.pipeline_estimate``."""
    assert config.pipeline_parallel is not None
    if sizes:
        raise EstimateError("step.estimate(sizes=...) does not combine with Config.pipeline_parallel yet")
    first = split_call(call, microbatches(config))[0]
    prepared = prepare(first, config, world_size, cost_model, device, ranks_per_node, inter_node_gbps)
    world, captured = prepared.group.world_size, prepared.captured
    if world % (config.pipeline_parallel * (config.sequence_parallel or 1)):
        error = pipeline_world_error(config.pipeline_parallel, world, config.sequence_parallel)
        raise ValueError(f"{error} (step.estimate: pass world_size=)")
    if size_symbols(captured.gm):
        raise EstimateError("step.estimate of a pipelined step traces static sizes: leave zgraph.mark_dynamic off")
    ctx = stage_context(prepared.binding)
    records, every, schedule = cut_stages(captured.gm, ctx, config, keep=False)
    cut = records[-1].gm
    pieces = state_pieces(cut, captured, prepared.device.type)
    backend = prepared.binding.backend or prepared.group.backend
    planned = Planned(prepared.device.type, prepared.binding.cost_model, world, ranks_per_node, backend)
    figures = pipeline_figures(cut, every, schedule, pieces, config, ctx, planned)
    top = max(figures.ranks, key=lambda r: r.peak_bytes)
    sender = max(figures.ranks, key=lambda r: sum(r.comm_bytes.values()))
    return Estimate(
        world_size=world,
        stage=config.stage,
        params=sum(r.tensor.numel() for r in prepared.binding.params),
        model_state_bytes=top.model_state_bytes,
        peak_bytes=top.peak_bytes,
        peak_node=f"rank {top.rank} of the pipeline: {top.peak_node}",
        alive_at_peak=top.alive_at_peak,
        comm_bytes=sender.comm_bytes,
        comm_count=sender.comm_count,
        comm_seconds=sender.comm_seconds,
        cost_model_source=prepared.binding.cost_model.source,
        comm_ops=sender.comm_ops,
        nodes=figures.nodes,
        device=prepared.device.type,
        step_seconds=figures.step_seconds,
        link_bytes=sender.link_bytes,
        activation_bytes=top.activation_bytes,
        stages=figures.stages,
        bubble=figures.bubble,
    )


@dataclass(frozen=True)
class Prepared:
    """A step captured once on stand-ins, to estimate under configs that differ only in what the passes do;
    ``ran``: how many leading passes of every such config's pass list already ran on ``captured.gm``."""

    captured: CapturedGraph
    binding: Binding
    group: ProcessGroupInfo
    device: torch.device
    ran: int = 0
    crossing: Mapping[str, bool] = field(default_factory=dict)  # whether each group, by name, crosses nodes
    sizes: Mapping[str | tuple[str, int], int] = field(default_factory=dict)  # where symbolic sizes are estimated
    config: Config | None = None  # the config the state was laid out for (``host_layout`` may change the stage)


def prepare(
    call: StepCall,
    config: Config,
    world_size: int | None = None,
    cost_model: CostModel | None = None,
    device: str | torch.device | None = None,
    ranks_per_node: int | None = None,
    inter_node_gbps: float | None = None,
    held: HeldCapture | None = None,
) -> Prepared:
    """The step of ``config`` making ``call`` captured on stand-ins, or its capture ``held`` copied where that is
    the same graph (``estimate_step``'s arguments)."""
    if ranks_per_node is not None and (type(ranks_per_node) is not int or ranks_per_node < 1):
        raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    shadow, found = shadow_call(call)
    device = _planned_device(device, found)
    group = _group(world_size, device)
    if group.distributed:
        secondary = config.secondary_shard_group_size
        sizes = {"shard_group_size": config.shard_group_size, "secondary_group_size": secondary}
        sizes["sequence_parallel"] = config.sequence_parallel
        group = planned_group(group, **sizes, ranks_per_node=ranks_per_node)
    modules, optimizers = discover(shadow)
    config = host_layout(config, group, device, Binding(modules, optimizers))
    model = cost_model or _cost_model(config, group, device)
    if isinstance(model, RuntimeCostModel):  # a ``zgraph.graph.CostModel`` of the user's is priced as it is
        model = with_inter_node(model, group.backend, inter_node_gbps)
    binding = plan_state(config, group, modules, optimizers, device, model)
    crossing = crossing_groups(group, ranks_per_node) if group.distributed else {}
    captured = reused(held, config, binding, device, marked_dims(shadow, binding, config.dynamic))
    captured = captured or capture_standins(shadow, binding, config, device)
    return Prepared(captured, binding, group, device, crossing=crossing, config=config)


def estimate_variant(prepared: Prepared, config: Config, *, copy: bool = True) -> Estimate:
    """The ``Estimate`` of the prepared step through ``config``'s passes (on a copy of its graph where ``copy``)."""
    return estimate_sizes(prepared, config, [prepared.sizes], copy=copy)[0]


def estimate_sizes(
    prepared: Prepared, config: Config, sizes: Sequence[Mapping[str | tuple[str, int], int]], *, copy: bool = True
) -> list[Estimate]:
    """``estimate_variant`` at each of ``sizes`` (a step with symbolic sizes: ``step.estimate``'s ``sizes=``): the
    passes run once, the liveness of their graph is evaluated at each."""
    captured, binding, device = prepared.captured, prepared.binding, prepared.device
    ctx = pass_context(binding, split=captured.split is not None)
    gm = copy_graph_module(captured.gm) if copy else captured.gm
    records = run_passes(gm, ctx, config.passes()[prepared.ran :], check_input=not prepared.ran, keep=False)
    backend_records, _ = lower(records[-1].gm if records else gm, ctx, "eager", keep=False)  # what runs
    final = backend_records[-1].gm
    symbols = size_symbols(final)
    seconds = timeline(final, binding.cost_model, prepared.crossing).total + transfer_seconds(final, device.type)
    comm = collective_totals(final, binding.cost_model, prepared.crossing)
    state = state_totals(state_pieces(final, captured, device.type), config)
    out = []
    for at in sizes:
        live = liveness(final, device.type, symbol_sizes(symbols, at))
        out.append(
            Estimate(
                world_size=prepared.group.world_size,
                stage=config.stage,
                params=sum(r.tensor.numel() for r in binding.params),
                model_state_bytes=state,
                peak_bytes=live.peak_bytes,
                peak_node=live.peak_node,
                alive_at_peak=live.alive_at_peak,
                comm_bytes=comm.sent,
                comm_count=comm.counts,
                comm_seconds=comm.seconds,
                cost_model_source=binding.cost_model.source,
                comm_ops=comm.ops,
                live_bytes=live.live_bytes,
                nodes=len(final.graph.nodes),
                device=device.type,
                step_seconds=seconds,
                link_bytes=comm.link_bytes,
                activation_bytes=live.activation_bytes,
                size_symbols=symbols,
                sizes=live.sizes,
                peak_formula=live.peak_formula,
                activation_formula=live.activation_formula,
            )
        )
    return out


def symbol_sizes(symbols: Mapping[str, tuple[str, int]], sizes: Mapping[str | tuple[str, int], int]) -> dict[str, int]:
    """``sizes`` by symbol name: a key is a symbol's name or ``(argument path, dim)`` (``Estimate.size_symbols``)."""
    by_place = {place: name for name, place in symbols.items()}
    out = {}
    for key, size in sizes.items():
        name = by_place.get(key) if isinstance(key, tuple) else key if key in symbols else None
        if name is None:
            known = ", ".join(f"{n} ({p} dim {d})" for n, (p, d) in symbols.items()) or "none: its sizes are static"
            raise ValueError(f"sizes: {key!r} is not a symbolic size of the step; its symbolic sizes: {known}")
        out[name] = size
    return out


def _planned_device(device: str | torch.device | None, found: torch.device) -> torch.device:
    """The device an estimate plans for: ``device`` (a device type of ``DEVICES``), else ``found``, the device of
    the model's parameters."""
    if device is None:
        return found
    try:
        planned = torch.device(device)
    except (RuntimeError, TypeError):
        planned = None
    if planned is None or planned.type not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)} (or a torch.device of them), got {device!r}")
    return planned


def _group(world_size: int | None, device: torch.device) -> ProcessGroupInfo:
    """The group an estimate plans for: the current one, or ``world_size`` ranks (rank 0; every rank's graph has
    the same shapes), with the backend that serves ``device`` as the real step would use it (the passes lower
    collectives for it): the current group's, else gloo for the CPU and NCCL for CUDA."""
    current = ensure_process_group()
    default = "nccl" if device.type == "cuda" else "gloo"
    backend = (served_backend(current.backend, device.type) or current.backend) if current.distributed else default
    if world_size is None or world_size == current.world_size:
        if not current.distributed:
            return SINGLE_PROCESS
        return ProcessGroupInfo(current.rank, current.world_size, ESTIMATE_GROUP, backend)
    return ProcessGroupInfo(0, world_size, ESTIMATE_GROUP, backend)


def _cost_model(config: Config, group: ProcessGroupInfo, device: torch.device) -> CostModel:
    """The cost model the real step would plan with: its cached measurement for this world size (when it measures
    collectives), else the analytical model of the backend it would use."""
    backend = group.backend
    if not group.distributed:
        return analytical_cost_model(None)
    if config.measure_collectives:
        return known_cost_model(backend, device.type, group.world_size)
    return analytical_cost_model(backend)
