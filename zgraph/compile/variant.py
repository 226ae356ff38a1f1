"""A compiled variant of the step (one guard key): its graphs, as captured, after each pass and as they run."""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import Tensor

from zgraph.capture.captured import CapturedGraph, SplitInfo
from zgraph.graph import CostModel, GraphInput, GraphOutput, ParamInfo
from zgraph.ops import RELOAD
from zgraph.passes import PassRecord
from zgraph.passes.micro_batch_loss import LossCombine
from zgraph.runtime.executor import Executable
from zgraph.runtime.host_update import HostRunner
from zgraph.runtime.offload_store import TierStore
from zgraph.runtime.pipeline_run import Part, Peers, StageRun
from zgraph.runtime.pipeline_schedule import Schedule


@dataclass
class SplitCompiled:
    """The compiled forward and backward graphs of a split step (``zgraph.compile.split_runner``)."""

    info: SplitInfo
    forward: Executable
    backward: Executable
    forward_records: list[PassRecord]
    backward_records: list[PassRecord]
    forward_specs: list[GraphInput]
    forward_roles: list[GraphOutput]
    backward_roles: list[GraphOutput]
    n_saved: int
    partitioned: dict[str, fx.GraphModule] = field(default_factory=dict)
    forward_reloads: tuple[int, ...] = ()  # the input slots (of the joint graph) each graph's reloads read
    backward_reloads: tuple[int, ...] = ()
    backward_digest: int | None = None  # the fingerprint the ranks compare before a backward (set on first use)


@dataclass
class PipelineCompiled:
    """This rank's part of a pipelined variant: the schedule, its stages, where each of the step's results is made
    (``results[index] = (stage, one micro-batch's example value)``) and the stage graphs, for inspection."""

    schedule: Schedule
    rank: int
    stages: dict[int, StageRun]
    results: dict[int, tuple[int, Tensor]]
    graphs: OrderedDict[str, fx.GraphModule]
    combine: LossCombine = field(default_factory=LossCombine)
    count_stage: int = -1  # the stage whose forward counts a token mean's tokens (``LossCombine.kind == "token"``)
    # each whole batch's count the stage graphs read (``batch_count``), with the graph counting it on a micro-batch
    counts: list[tuple[GraphInput, Part]] = field(default_factory=list)
    peers: Peers | None = None  # this rank's pipeline and data-parallel groups
    update_reduces: bool = False  # the update graphs reduce the gradients over the pipelines (ZeRO >= 1)
    shard_ranks: tuple[int, ...] = ()  # hybrid sharding within stages: this rank's shard group's global ranks
    totals: list[tuple[GraphInput, Tensor]] = field(default_factory=list)  # values across stages, with examples
    regather: bool = False  # ZeRO 3: a stage's parameters gathered for each action (``Config.pipeline_regather``)
    # the ``.grad`` and optimizer state other ranks' stages' updates write (``zero_grad(set_to_none=False)``, state
    # an optimizer makes in its first step, as SGD's momentum buffers), with their shapes and dtypes
    state_elsewhere: tuple[tuple[GraphOutput, torch.Size, torch.dtype], ...] = ()
    # captured with symbolic sizes: each size symbol's argument (index among the step's tensors) and dimension, from
    # which a call's sizes give the shapes of what is received (``zgraph.sizes.concrete_shape``)
    sizes: dict = field(default_factory=dict)


@dataclass
class CompiledStep:
    """One captured, transformed and compiled variant of the step (one guard key)."""

    captured: CapturedGraph
    records: list[PassRecord]
    executable: Executable
    capture_seconds: float
    input_specs: list[GraphInput] = field(default_factory=list)
    output_roles: list[GraphOutput] = field(default_factory=list)
    description: list[str] = field(default_factory=list)
    digest: int = 0
    cost_model: CostModel | None = None
    backend_records: list[PassRecord] = field(default_factory=list)  # the backend's rewrites, after the passes
    params: tuple[ParamInfo, ...] = ()  # the parameters as the passes saw them (layouts), for explain()
    split: SplitCompiled | None = None  # a split step's forward and backward
    offload: TierStore | None = None  # the binding's offload store, for explain()
    host: HostRunner | None = None  # the binding's runner of the update on the host, for explain()
    host_fallback: str | None = None  # why the update does not run on the host where it was to, for explain()
    crossing: Mapping[str, bool] = field(default_factory=dict)  # whether each group crosses nodes, for explain()
    pipeline: PipelineCompiled | None = None  # a pipelined step's schedule and this rank's stages

    @functools.cached_property
    def offloaded_inputs(self) -> tuple[int, ...]:
        """Input positions the graph reads from the offload tier (its ``zgraph::reload`` nodes), in graph order."""
        return reload_slots(self.final)

    @property
    def transformed(self) -> fx.GraphModule:
        """The pass list's last graph: its input positions are the ones reload nodes name."""
        return self.records[-1].gm if self.records else self.captured.gm

    @property
    def final(self) -> fx.GraphModule:
        """The graph that runs: the last pass's graph as the backend rewrote it."""
        for records in (self.backend_records, self.records):
            if records:
                return records[-1].gm
        return self.captured.gm

    def graphs(self) -> OrderedDict[str, fx.GraphModule]:
        out: OrderedDict[str, fx.GraphModule] = OrderedDict(captured=self.captured.gm)
        for record in self.records:
            out[record.name] = record.gm
        out["final"] = self.final
        if self.split is not None:
            for part, records in (("forward", self.split.forward_records), ("backward", self.split.backward_records)):
                out[part] = records[-1].gm
        if self.pipeline is not None:
            out.update(self.pipeline.graphs)
        return out


def reload_slots(gm: fx.GraphModule) -> tuple[int, ...]:
    """The input positions (of the pass list's graph) ``gm``'s ``zgraph::reload`` nodes read, in graph order."""
    return tuple(n.args[1] for n in gm.graph.nodes if n.target is RELOAD)
