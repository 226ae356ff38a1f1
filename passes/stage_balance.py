"""The balance of ``stage_cut``: each repeated block's forward cost, and the consecutive groups of blocks whose
costliest group is the cheapest (the linear partition problem)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from zgraph.graph import FORWARD, PHASE, VAL
from zgraph.passes.remat import block_of

aten = torch.ops.aten
_MATMULS = {aten.mm: 1, aten.addmm: 2, aten.bmm: 1, aten.baddbmm: 2}  # packet -> position of the left operand


def balance(costs: list[float], parts: int) -> list[int]:
    """The first index of each of ``parts`` consecutive non-empty groups of ``costs`` whose largest sum is the
    smallest possible (the linear partition problem; dynamic programming, earliest cut on ties)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = {(0, 0): (0.0, [])}  # (groups, items) -> (largest sum, starts)
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            options = [
                (max(best[k - 1, j][0], prefix[i] - prefix[j]), best[k - 1, j][1] + [j])
                for j in range(k - 1, i)
                if (k - 1, j) in best
            ]
            best[k, i] = min(options, key=lambda o: o[0])
    return best[parts, n][1]


def block_flops(gm: fx.GraphModule, blocks: list[str]) -> list[float]:
    """Each block's forward flops; nodes outside every block count for the block before them (the first block's
    for what precedes it)."""
    cost = dict.fromkeys(blocks, 0.0)
    current = blocks[0]
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.meta.get(PHASE) == FORWARD:
            current = block_of(node) or current
            cost[current] += node_flops(node)
    return list(cost.values())


def node_flops(node: fx.Node) -> float:
    """Two per multiply-add of a matmul or attention; the output's elements for another op."""
    target, val = node.target, node.meta.get(VAL)
    if not isinstance(val, torch.Tensor):
        return 0.0
    packet = getattr(target, "overloadpacket", None)
    if packet in _MATMULS:
        left = node.args[_MATMULS[packet] - 1].meta[VAL]
        return 2.0 * _hint(val.numel()) * _hint(left.shape[-1])
    if packet is aten.convolution:
        weight = node.args[1].meta[VAL]
        return 2.0 * _hint(val.numel()) * _hint(weight.numel()) / max(1, _hint(weight.shape[0]))
    return float(_hint(val.numel()))


def _hint(size: int | torch.SymInt) -> int:
    return optimization_hint(size) if isinstance(size, torch.SymInt) else int(size)
