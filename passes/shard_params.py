"""``shard_params`` (ZeRO stage 3): parameters enter and leave the graph as this rank's shard.

Each sharded parameter is gathered whole (``zgraph::unshard``, an all-gather) once per *use region* — a maximal
run of its uses, in graph order, within one phase — right before the region's first use: once for the forward,
once again for the backward, once per region when a step runs several forward/backward rounds. The
optimizer reads the shard directly (its ``shard(param)`` becomes the input), and the updated shard is the
output.

A gathered parameter is freed after the last use of its region. To keep that true, views and casts of the
forward gather that backward reads (``t(weight)`` saved for the weight-gradient matmul, say) are recomputed
from the backward gather instead of being kept alive across the two.

Parameters that stay whole (``ParamInfo.persistent``, 0-d) are not touched.

``max_reuse_distance`` (DeepSpeed's ``stage3_max_reuse_distance``): a parameter's gather is kept for its next
region, instead of gathering it again, when at most this many elements of other parameters are gathered between
the last read of the one (through its views, too) and the other — the last layers' parameters from the end of the
forward into the start of the backward, or, with a distance as large as the model, every parameter (one
all-gather per step instead of two; each is then held from its forward use to its backward use, as FSDP2's
``reshard_after_forward=False``). 0 (the default): every region gathers its own.

Later passes may rely on: every ``zgraph::unshard`` of a parameter placeholder sits right before the first use
of its region and has no users outside that region (a kept gather's region runs on to its last reader).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from zgraph.graph import (
    BACKWARD,
    FORWARD,
    INPUT,
    PHASE,
    VAL,
    fake_mode,
    insert,
    placeholders,
    set_input_layout,
)
from zgraph.ops import SHARD, UNSHARD
from zgraph.passes.graph_utils import (
    CASTS,
    VIEWS,
    insert_per_region,
    outputs,
    push_shards,
    set_outputs,
    shard_output,
    shard_val,
    use_regions,
)
from zgraph.passes.pass_list import PassContext

aten = torch.ops.aten

# Single-input ops that only re-view or re-type a tensor: cheap to recompute from a fresh gather.
_RECOMPUTABLE = (
    VIEWS
    | CASTS
    | {
        aten._unsafe_view.default,
        aten.select.int,
        aten.squeeze.default,
        aten.detach.default,
        aten.alias.default,
        aten.split.Tensor,
    }
)


def shard_params_applies(gm: fx.GraphModule, ctx: PassContext, *, stage: int = 0, max_reuse_distance: int = 0) -> bool:
    """Whether ``shard_params`` changes the graph: at stage 3, with a process group (``Pass.applies``)."""
    return stage >= 3 and ctx.distributed


def shard_params(
    gm: fx.GraphModule, ctx: PassContext, *, stage: int = 0, max_reuse_distance: int = 0
) -> fx.GraphModule:
    """Stage 3: parameters enter sharded, are all-gathered per use region and freed after it.

    ``stage``: ``Config.stage`` (below 3 the pass does nothing). ``max_reuse_distance``:
    ``Config.max_reuse_distance``, in elements (see the module's docstring)."""
    if not shard_params_applies(gm, ctx, stage=stage):
        return gm
    mode = fake_mode(gm)
    world, rank, group = ctx.shard.size, ctx.shard.rank, ctx.shard.name  # hybrid: within the shard group
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    sharded = set()
    for node in placeholders(gm):
        spec = node.meta[INPUT]
        if spec.kind != "param":
            continue
        info = ctx.params[spec.index]
        if info.shard is None or info.persistent:
            continue
        sharded.add(spec.index)
        set_input_layout(node, "shard", shard_val(node.meta[VAL], world))
        regions = use_regions(node, order, skip=lambda u: u.target is SHARD)
        for user in list(node.users):
            if user.target is SHARD:  # the optimizer's read of this rank's shard: the input itself now
                user.replace_all_uses_with(node)
                gm.graph.erase_node(user)
        wholes = insert_per_region(gm, node, regions, UNSHARD, (node, info.shape[0], world, group))
        gathers = [(order[region[0]] - 0.5, whole) for region, whole in zip(regions, wholes)]
        _recompute_views_in_backward(gm, gathers, order, mode)
    if max_reuse_distance > 0:
        _keep_gathers_for_reuse(gm, max_reuse_distance)
    items = []
    for value, role in outputs(gm):
        if role.kind == "param" and role.index in sharded:
            value, role = shard_output(gm, value, role, world, rank, None, mode)
        items.append((value, role))
    set_outputs(gm, items)
    push_shards(gm)
    return gm


def _recompute_views_in_backward(
    gm: fx.GraphModule, gathers: list[tuple[float, fx.Node]], order: dict, mode: object
) -> None:
    """Backward uses of views of a forward gather read, instead, the same views of a backward gather (the
    latest backward gather before the use, or a new one placed right before it)."""
    backward_gathers = [(pos, g) for pos, g in gathers if g.meta.get(PHASE) == BACKWARD]
    for _, gather in gathers:
        if gather.meta.get(PHASE) != FORWARD:
            continue
        closure = [gather]
        for node in closure:
            for user in node.users:
                recomputable = user.target in _RECOMPUTABLE or user.target is operator.getitem
                if recomputable and user not in closure and user.all_input_nodes == [node]:
                    closure.append(user)
        late_uses = [
            (node, user)
            for node in closure
            for user in list(node.users)
            if user not in closure and user.meta.get(PHASE) == BACKWARD
        ]
        copies: dict[fx.Node, dict[fx.Node, fx.Node]] = {}
        for node, user in sorted(late_uses, key=lambda nu: order.get(nu[1], len(order))):
            earlier = [g for pos, g in backward_gathers if pos < order.get(user, len(order))]
            if earlier:
                base = earlier[-1]
            else:
                base = insert(gm, UNSHARD, tuple(gather.args), before=user, phase=BACKWARD, mode=mode)
                backward_gathers.append((order.get(user, len(order)) - 0.5, base))
                backward_gathers.sort(key=lambda pg: pg[0])
            memo = copies.setdefault(base, {gather: base})
            user.replace_input_with(node, _copy_view(gm, node, memo, mode))


def _copy_view(gm: fx.GraphModule, node: fx.Node, memo: dict[fx.Node, fx.Node], mode: object) -> fx.Node:
    """``node``, a chain of views on a gather, recomputed on the gather ``memo`` maps the original one to."""
    if node not in memo:
        source = node.all_input_nodes[0]
        source_copy = _copy_view(gm, source, memo, mode)
        args = tuple(source_copy if a is source else a for a in node.args)
        memo[node] = insert(gm, node.target, args, dict(node.kwargs), after=source_copy, phase=BACKWARD, mode=mode)
    return memo[node]


def _last_read(node: fx.Node, order: dict[fx.Node, int]) -> int:
    """Position of the last reader of ``node``, through the views and casts that read it (a view nothing reads,
    such as a backward view whose readers now read the backward gather's copy, reads nothing); -1 if none."""
    last = -1
    for user in node.users:
        last = max(last, _last_read(user, order) if user.target in _RECOMPUTABLE else order[user])
    return last


def _keep_gathers_for_reuse(gm: fx.GraphModule, distance: int) -> None:
    """Where at most ``distance`` elements of other parameters are gathered between the last read of one gather
    of a parameter and its next gather, the next one's readers read the earlier gather instead (it is erased)."""
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    gathers = [n for n in nodes if n.target is UNSHARD and n.args[0].op == "placeholder"]
    by_param: dict[fx.Node, list[fx.Node]] = {}
    for gather in gathers:
        by_param.setdefault(gather.args[0], []).append(gather)
    erased = set()
    for param, own in by_param.items():
        kept = own[0]
        for gather in own[1:]:
            start, end = max(order[kept], _last_read(kept, order)), order[gather]
            between = {
                g.args[0]: g.meta[VAL].numel()
                for g in gathers
                if start < order[g] < end and g.args[0] is not param and g not in erased
            }
            if sum(between.values()) <= distance:
                gather.replace_all_uses_with(kept)
                gm.graph.erase_node(gather)
                erased.add(gather)
            else:
                kept = gather
