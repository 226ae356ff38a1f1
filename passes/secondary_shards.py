"""``secondary_shards`` (stage 3 with hpZ, ``Config.secondary_shard_group_size``): the backward re-gathers each
parameter within a small group of ranks, from a secondary shard kept from the forward's gather.

ZeRO++'s hierarchical partitioning (hpZ, DeepSpeed's ``zero_hpz_partition_size``). Parameters stay sharded over
every rank (the least memory between steps). The forward's all-gather of a parameter runs over every rank, as in
ZeRO-3; right after it, each rank keeps a copy of its *secondary* shard of the gathered tensor, cut across the
``N`` consecutive ranks of its secondary group (``ctx.secondary_group``: ranks of one node, usually). Each
backward gather of the parameter then all-gathers those secondary shards within the group, so the backward's
parameter traffic stays on the fast links. The values are the forward's gather, bit for bit; the cost is
memory: a parameter's secondary shard (1/N of it, in the dtype it was gathered in) is held from its forward use
to its backward use.

Runs after ``cast`` (gathers already move the compute dtype, so the secondary shard is kept in it) and
``offload`` (a backward reload of an offloaded shard is no longer read and is dropped).

Later passes may rely on: every backward ``unshard`` of a parameter that the forward gathered reads a secondary
shard (``clone(shard(forward gather, N, rank in group))``) and spans the secondary group only.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zgraph.graph import BACKWARD, FORWARD, INPUT, PHASE, eliminate_dead_code, fake_mode, insert
from zgraph.ops import RELOAD, SHARD, UNSHARD
from zgraph.passes.graph_utils import CASTS
from zgraph.passes.pass_list import PassContext

aten = torch.ops.aten


def parameter_of(gather: fx.Node) -> fx.Node | None:
    """The parameter placeholder an ``unshard`` gathers (through casts and an offload reload), or None."""
    node = gather.args[0]
    while node.op != "placeholder":
        if node.target not in CASTS and node.target is not RELOAD:
            return None
        node = node.args[0]
    return node if node.meta[INPUT].kind == "param" else None


def secondary_shards_applies(gm: fx.GraphModule, ctx: PassContext, *, stage: int = 0) -> bool:
    """Whether ``secondary_shards`` changes the graph: at stage 3 with a secondary group (``Pass.applies``)."""
    return stage >= 3 and ctx.secondary_group is not None and ctx.distributed


def secondary_shards(gm: fx.GraphModule, ctx: PassContext, *, stage: int = 0) -> fx.GraphModule:
    """hpZ: backward gathers of stage-3 parameters run within the secondary group, from shards kept from the
    forward.

    ``stage``: ``Config.stage`` (below 3 the pass does nothing)."""
    secondary = ctx.secondary_group
    if secondary is None or not secondary_shards_applies(gm, ctx, stage=stage):
        return gm
    mode = fake_mode(gm)
    kept: dict[tuple, fx.Node] = {}  # (parameter, dtype) -> the secondary shard of its latest forward gather
    for node in list(gm.graph.nodes):
        if node.target is not UNSHARD or node.args[2] != ctx.world_size:
            continue
        param = parameter_of(node)
        if param is None:
            continue
        key = (param, node.meta["val"].dtype)
        if node.meta.get(PHASE) == FORWARD:
            at = dict(after=node, phase=FORWARD, mode=mode)
            piece = insert(gm, SHARD, (node, secondary.size, secondary.rank), **at)
            kept[key] = insert(gm, aten.clone.default, (piece,), after=piece, phase=FORWARD, mode=mode)
        elif node.meta.get(PHASE) == BACKWARD and key in kept:
            args = (kept[key], node.args[1], secondary.size, secondary.name)
            regathered = insert(gm, UNSHARD, args, before=node, phase=BACKWARD, mode=mode)
            node.replace_all_uses_with(regathered)
            gm.graph.erase_node(node)
    eliminate_dead_code(gm.graph)
    return gm
