"""``shard_optimizer`` (ZeRO stage ≥ 1): every rank updates only its shard of each parameter.

Optimizer state tensors of a parameter's shape enter the graph as this rank's padded dim-0 shard and leave it
as the updated shard. The new value of each parameter is computed on its shard and made whole again with
``zgraph::unshard`` (an all-gather) where the parameter is stored whole (stage < 3). ``zgraph::shard`` is
pushed up through the element-wise update (``push_shards``), so the optimizer's arithmetic touches 1/N of the
elements; what it reads whole — the parameter, the gradient — is sliced (``shard(x)``, no communication).

Later passes may rely on: every ``zgraph::shard`` left in the graph reads a whole tensor that every rank
holds identically once gradients are reduced (a parameter, a gradient, or a value derived from them), and
``shard(grad_contribution(...))`` is how the optimizer reads a gradient (``reduce_scatter_grads`` turns it into
a reduce-scatter in stage ≥ 2).
"""

from __future__ import annotations

import torch.fx as fx

from zgraph.graph import INPUT, OPTIMIZER, VAL, fake_mode, insert, output_node, placeholders
from zgraph.ops import SHARD, UNSHARD
from zgraph.passes.graph_utils import outputs, push_shards, set_outputs, shard_input, shard_output
from zgraph.passes.pass_list import PassContext


def shard_optimizer_applies(gm: fx.GraphModule, ctx: PassContext, *, stage: int = 0) -> bool:
    """Whether ``shard_optimizer`` changes the graph: from stage 1, with a process group (``Pass.applies``)."""
    return stage >= 1 and ctx.distributed


def shard_optimizer(gm: fx.GraphModule, ctx: PassContext, *, stage: int = 0) -> fx.GraphModule:
    """Stage >= 1: optimizer state enters and leaves as shards; the update runs on shards.

    ``stage``: ``Config.stage`` (below 1 the pass does nothing)."""
    if not shard_optimizer_applies(gm, ctx, stage=stage):
        return gm
    mode = fake_mode(gm)
    world, rank, group = ctx.shard.size, ctx.shard.rank, ctx.shard.name  # hybrid: within the shard group
    for node in placeholders(gm):
        spec = node.meta[INPUT]
        info = ctx.params[spec.index] if spec.kind == "opt_state" else None
        if info is None or info.shard is None or tuple(node.meta[VAL].shape) != info.shape:
            continue
        shard_input(gm, node, info, world, group, OPTIMIZER, mode)
    out = output_node(gm)
    items = []
    for value, role in outputs(gm):
        info = ctx.params[role.index] if role.kind in ("opt_state", "param") else None
        sharded = (
            info is not None
            and info.shard is not None
            and isinstance(value, fx.Node)
            and value.op != "placeholder"
            and tuple(value.meta["val"].shape) == info.shape
        )
        if sharded and role.kind == "opt_state":
            value, role = shard_output(gm, value, role, world, rank, OPTIMIZER, mode)
        elif sharded and role.kind == "param":
            piece = insert(gm, SHARD, (value, world, rank), before=out, phase=OPTIMIZER, mode=mode)
            value = insert(gm, UNSHARD, (piece, info.shape[0], world, group), before=out, phase=OPTIMIZER, mode=mode)
        items.append((value, role))
    set_outputs(gm, items)
    push_shards(gm)
    return gm
