"""``reduce_scatter_grads``: turn each rank's local gradients into the gradient of the global batch.

Every ``zgraph::grad_contribution(g, i)`` marker (a gradient autograd produced for parameter ``i`` on this rank)
is replaced by the average over ranks — what DDP gives, and, since every rank's loss is a mean over its
micro-batch, the gradient of the global-batch mean loss:

- stage ≤ 1: gradients stay whole on every rank: ``zgraph::reduce`` (an all-reduce) wherever something reads
  the whole averaged gradient (the ``.grad`` the step leaves, the step's own code). When only the sharded
  optimizer reads it (the step ends with ``zero_grad()``), each rank needs just its shard and the reduction is
  a ``zgraph::reduce_shard`` (a reduce-scatter, half an all-reduce's traffic) — DeepSpeed's ZeRO-1 reduces the
  same way (``reduce_scatter: true``). Nothing observable changes.
- stage ≥ 2: ``zgraph::reduce_shard`` (a reduce-scatter) wherever the gradient is read as a shard; the
  ``.grad`` a step leaves on a parameter, and one it finds there on entry, are shards. A reader that needs
  the whole gradient gets ``unshard`` of the reduced shard.

Hybrid sharding (``Config.shard_group_size``): the reduce-scatter runs within the shard group and its shard is
then all-reduced across the groups (``ctx.replicate_group``): cross-group traffic is one shard per rank. The
other order (all-reduce the whole gradient across groups, then reduce-scatter) moves the whole gradient over the
slower links, so it is never the cheaper one. Whole gradients (stage <= 1) are all-reduced over every rank.

Without a process group (one process) every marker is removed (the average over one rank is the identity).

Provides ``grads_reduced``: no marker is left; later passes may rely on every gradient in the graph being the
global-batch gradient.
"""

from __future__ import annotations

import torch.fx as fx

from zgraph.graph import BACKWARD, INPUT, Axis, fake_mode, insert, placeholders
from zgraph.ops import GRAD_CONTRIBUTION, REDUCE, REDUCE_SHARD, SHARD, UNSHARD
from zgraph.passes.graph_utils import outputs, push_shards, set_outputs, shard_input, shard_output
from zgraph.passes.pass_list import PassContext


def reduce_scatter_grads(gm: fx.GraphModule, ctx: PassContext, *, stage: int = 0) -> fx.GraphModule:
    """Average gradients across ranks: reduce-scatter where only shards are read, else all-reduce (stage <= 1).

    ``stage``: ``Config.stage`` (from 2 on, gradients enter and leave the step as shards)."""
    graph = gm.graph
    markers = [n for n in graph.nodes if n.target is GRAD_CONTRIBUTION]
    if not ctx.distributed:
        for node in markers:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        return gm
    mode = fake_mode(gm)
    world, rank, group = ctx.shard.size, ctx.shard.rank, ctx.shard.name
    sharded_grads = stage >= 2
    if sharded_grads:
        _shard_grad_boundaries(gm, ctx, mode)
    for node in markers:
        local, index = node.args
        info = ctx.params[index]
        readers_of_shard = [u for u in node.users if u.target is SHARD]
        only_shards_read = len(readers_of_shard) == len(node.users)
        if info.shard is not None and (sharded_grads or only_shards_read):
            reduced = insert(gm, REDUCE_SHARD, (local, world, rank, group), after=node, phase=BACKWARD, mode=mode)
            reduced = _across_groups(gm, reduced, ctx.replicate_group, mode)
            for user in readers_of_shard:
                user.replace_all_uses_with(reduced)
                graph.erase_node(user)
            if node.users:
                whole = insert(gm, UNSHARD, (reduced, info.shape[0], world, group), after=reduced, mode=mode)
                node.replace_all_uses_with(whole)
        else:
            reduced = insert(gm, REDUCE, (local, ctx.world_size, ctx.group_name), after=node, phase=BACKWARD, mode=mode)
            node.replace_all_uses_with(reduced)
        graph.erase_node(node)
    return gm


def _across_groups(gm: fx.GraphModule, reduced: fx.Node, replicate: Axis | None, mode: object) -> fx.Node:
    """Hybrid sharding: the shard averaged within the shard group, averaged again across the groups (an
    all-reduce among the ranks holding the same shard; equal groups make it the average over every rank)."""
    if replicate is None:
        return reduced
    return insert(gm, REDUCE, (reduced, replicate.size, replicate.name), after=reduced, phase=BACKWARD, mode=mode)


def _shard_grad_boundaries(gm: fx.GraphModule, ctx: PassContext, mode: object) -> None:
    """Stage >= 2: the ``.grad`` a parameter has on entry and the one the step leaves are shards."""
    world, rank, group = ctx.shard.size, ctx.shard.rank, ctx.shard.name
    for node in placeholders(gm):
        spec = node.meta[INPUT]
        info = ctx.params[spec.index] if spec.kind == "grad" else None
        if info is not None and info.shard is not None:
            shard_input(gm, node, info, world, group, BACKWARD, mode)
    items = []
    for value, role in outputs(gm):
        info = ctx.params[role.index] if role.kind == "grad" else None
        if info is not None and info.shard is not None:
            value, role = shard_output(gm, value, role, world, rank, BACKWARD, mode)
        items.append((value, role))
    set_outputs(gm, items)
    push_shards(gm)
