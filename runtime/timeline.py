"""Estimate how a lowered step graph runs: one compute stream, one communication stream, in graph order.

Compute nodes cost ``flops / flops_per_second + bytes / bytes_per_second`` (FLOPs of matmuls and attention from
``torch.utils.flop_counter``; bytes read and written; views are free). A collective starts when it is issued
and the previous collective has finished, and takes ``latency + bytes / bandwidth`` from the cost model (on the
across-node link class where its group crosses nodes: ``crossing``, ``cost_model.crossing_groups``); its
``wait_tensor`` stalls compute until it has finished. What is left of a collective's time after the stalls
is hidden behind compute. Used by ``explain()`` to show what the ``schedule`` pass is expected to gain, and by
``step.estimate`` (``Estimate.step_seconds``) and the memory planner to compare configs.

Offload transfers (``zgraph::reload`` / ``write_back``, ``stash`` / ``unstash``) are priced apart by
``transfer_seconds``: their bytes over the tier's bandwidth, none of it hidden (a bound, where the runtime reads
ahead and writes behind).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from zgraph.graph import VAL, CostModel, collective_bytes, collective_kind, tensor_bytes
from zgraph.ops import RELOAD, STASH, UNSTASH, WRITE_BACK
from zgraph.runtime.cost_model import LINK_CLASSES, crosses, link_seconds
from zgraph.sizes import size_hint

WAIT = torch.ops._c10d_functional.wait_tensor.default
# Bytes per second an offload tier moves, by the device whose state it holds: a GPU's state goes to pinned host
# memory over PCIe (gen4 x16, as copies measure it); a CPU's to NVMe files (one data-centre drive).
TIER_BYTES_PER_SECOND = {"cuda": 20e9, "cpu": 2e9}


@dataclass(frozen=True)
class Timeline:
    """Estimated seconds: compute, communication, and the part of communication compute waited for."""

    compute: float
    communication: float
    exposed: float

    @property
    def hidden(self) -> float:
        return self.communication - self.exposed

    @property
    def total(self) -> float:
        return self.compute + self.exposed


def _is_view(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return True  # getitem, Python scalar ops
    return any(r.alias_info is not None for r in target._schema.returns)


def _flops(node: fx.Node) -> int:
    target = node.target
    fn = flop_registry.get(getattr(target, "overloadpacket", None))
    if fn is None:
        return 0

    def val(a: object) -> object:
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args = [val(a) for a in node.args]
    kwargs = {k: val(v) for k, v in node.kwargs.items()}
    try:
        return size_hint(fn(*args, out_val=node.meta.get("val"), **kwargs))  # symbolic sizes: at their hints
    except Exception:  # a signature the registry does not cover: count it as memory traffic only
        return 0


def compute_seconds(node: fx.Node, cost_model: CostModel) -> float:
    if node.op != "call_function" or _is_view(node):
        return 0.0
    moved = tensor_bytes(node.meta.get("val")) + sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    return _flops(node) / cost_model.flops_per_second + moved / cost_model.bytes_per_second


def _collective_of(node: fx.Node) -> fx.Node:
    """The collective a wait reads (through ``getitem`` for coalesced collectives)."""
    return node.args[0] if node.target is operator.getitem else node


def estimate(gm: fx.GraphModule, cost_model: CostModel, crossing: Mapping[str, bool] | None = None) -> Timeline:
    """Simulate the graph's order on one compute and one communication stream; ``crossing``: whether each group
    (by name) crosses nodes (None: none does)."""
    now = comm_free = compute = communication = exposed = 0.0
    finish: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is not None and node.target.namespace == "_c10d_functional":
            seconds = link_seconds(cost_model, kind, collective_bytes(node), crosses(node, crossing))
            begin = max(now, comm_free)
            finish[node] = comm_free = begin + seconds
            communication += seconds
        elif node.target is WAIT and _collective_of(node.args[0]) in finish:
            stall = max(0.0, finish[_collective_of(node.args[0])] - now)
            exposed += stall
            now += stall
        else:
            seconds = compute_seconds(node, cost_model)
            compute += seconds
            now += seconds
    return Timeline(compute, communication, exposed)


def transfer_seconds(gm: fx.GraphModule, device_type: str) -> float:
    """Seconds the offload tier of a ``device_type`` step moves bytes for: every ``zgraph::reload`` and ``unstash``
    (the value read back) and ``write_back`` and ``stash`` (the value written) at ``TIER_BYTES_PER_SECOND``."""
    moved = sum(
        tensor_bytes(n.meta.get(VAL) if n.target in (RELOAD, UNSTASH) else n.args[0].meta.get(VAL))
        for n in gm.graph.nodes
        if n.target in (RELOAD, UNSTASH, WRITE_BACK, STASH)
    )
    return moved / TIER_BYTES_PER_SECOND.get(device_type, TIER_BYTES_PER_SECOND["cpu"])


@dataclass(frozen=True)
class CollectiveTotals:
    """Per step: per collective kind, count, bytes (the whole tensor) and seconds (on each one's link class); per
    op name, count; per link class (``LINK_CLASSES``), bytes."""

    counts: dict[str, int]
    sent: dict[str, int]
    seconds: dict[str, float]
    ops: dict[str, int]
    link_bytes: dict[str, int]


def collective_totals(
    gm: fx.GraphModule, cost_model: CostModel, crossing: Mapping[str, bool] | None = None
) -> CollectiveTotals:
    """The collectives of ``gm`` summed (``crossing`` as ``estimate``'s)."""
    totals = CollectiveTotals({}, {}, {}, {}, dict.fromkeys(LINK_CLASSES, 0))
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        nbytes, across = collective_bytes(node), crosses(node, crossing)
        totals.counts[kind] = totals.counts.get(kind, 0) + 1
        totals.sent[kind] = totals.sent.get(kind, 0) + nbytes
        seconds = link_seconds(cost_model, kind, nbytes, across)
        totals.seconds[kind] = totals.seconds.get(kind, 0.0) + seconds
        totals.ops[node.target._opname] = totals.ops.get(node.target._opname, 0) + 1
        totals.link_bytes[LINK_CLASSES[across]] += nbytes
    return totals
