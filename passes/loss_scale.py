"""``loss_scale``: the fp16 overflow check sees every rank's gradients, at the cost of one tiny all-reduce.

Capture checks the gradients an optimizer step uses for inf/nan with ``zgraph::nonfinite([g, ...])`` and skips
the update when it is set (see ``zgraph.capture.precision``). Once gradients are sharded (stage ≥ 2), each rank holds
only its shard; this pass makes the check read the shards (zero padding is finite) and ``combine``s the
flag with a max over ranks, so every rank skips the same steps. Where all checked gradients are whole and
identical on every rank (stage ≤ 1), the flag already agrees and no collective is added.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zgraph.graph import PHASE, eliminate_dead_code, fake_mode, insert
from zgraph.ops import COMBINE, NONFINITE
from zgraph.passes.clip_grad import sharded_gradient
from zgraph.passes.pass_list import PassContext

aten = torch.ops.aten


def loss_scale(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Make the overflow flag global: check gradient shards, then one all-reduce (max) of the flag."""
    if not ctx.distributed:
        return gm
    mode = fake_mode(gm)
    for node in list(gm.graph.nodes):
        if node.target is not NONFINITE:
            continue
        grads = list(node.args[0])
        shards = [sharded_gradient(g) for g in grads]
        if all(s is None for s in shards):
            continue
        at = dict(before=node, phase=node.meta.get(PHASE), mode=mode)
        local = insert(gm, NONFINITE, ([s if s is not None else g for s, g in zip(shards, grads)],), **at)
        as_int = insert(gm, aten._to_copy.default, (local,), {"dtype": torch.int32}, **at)
        anywhere = insert(gm, COMBINE, (as_int, "max", ctx.world_size, ctx.group_name), **at)
        flag = insert(gm, aten._to_copy.default, (anywhere,), {"dtype": torch.bool}, **at)
        node.replace_all_uses_with(flag)
        gm.graph.erase_node(node)
    eliminate_dead_code(gm.graph)
    return gm
