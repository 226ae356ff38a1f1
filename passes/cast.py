"""``cast``: move dtype casts to where they save the most.

Capture already casts parameters to the compute dtype where the step reads them (``Config.param_dtype``, or a
``torch.autocast`` region): autograd needs the casts in the traced program to compute the right gradients.
This pass only moves casts across communication, which does not change any value:

- **Gather in the compute dtype.** ``to(unshard(p), bf16)`` becomes ``unshard(to(p, bf16))``: a stage-3
  parameter is cast on its shard and all-gathered in the compute dtype (half the bytes for bf16 from fp32).
- **Reduce in the reduce dtype.** A gradient reduction runs in ``Config.reduce_dtype`` (default: the compute
  dtype, as FSDP2 does), cast back to the gradient's own (master) dtype after the collective for the update.
- **Cross groups in ``Config.cross_group_dtype``** (off by default): hybrid sharding's all-reduce of gradient
  shards across groups, and with hpZ the forward's parameter gathers and the gradients' reduce-scatters over
  every rank, run in this narrower dtype (ZeRO++'s qgZ / qwZ in spirit, with bf16 rather than int8), cast back
  after the collective. It changes values: the rounding of what crosses.
- **Drop exact round trips.** ``to(to(a, wide), narrow)`` with ``a`` already ``narrow`` (bf16 → fp32 → bf16) is
  ``a``: a gradient backward produced in bf16 and cast to fp32 for the master parameter goes to the reduction
  in bf16 directly.

Later passes may rely on: every ``unshard`` of a parameter moves the dtype its readers use, and every
gradient reduction moves the reduce dtype.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zgraph.graph import eliminate_dead_code, fake_mode, insert
from zgraph.ops import REDUCE, REDUCE_SHARD, UNSHARD
from zgraph.passes.pass_list import PassContext

aten = torch.ops.aten
_WIDTH = {torch.float64: 64, torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}


def dtype_cast(node: fx.Node) -> torch.dtype | None:
    """The target dtype if ``node`` only changes its input's dtype (``_to_copy`` with just ``dtype``)."""
    if node.op != "call_function" or node.target is not aten._to_copy.default:
        return None
    if set(node.kwargs) != {"dtype"}:
        return None
    return node.kwargs["dtype"]


def _exact_round_trip(node: fx.Node) -> fx.Node | None:
    """For ``to(to(a, wide), narrow)`` with ``a`` of dtype ``narrow`` and ``wide`` able to hold it: ``a``."""
    narrow = dtype_cast(node)
    inner = node.args[0]
    if narrow is None or dtype_cast(inner) is None:
        return None
    source = inner.args[0]
    wide = dtype_cast(inner)
    source_dtype = source.meta["val"].dtype
    if source_dtype != narrow or _WIDTH.get(wide, 0) < _WIDTH.get(narrow, 99):
        return None
    if narrow in (torch.bfloat16, torch.float16) and wide in (torch.bfloat16, torch.float16) and wide != narrow:
        return None
    return source


def cast(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    reduce_dtype: torch.dtype | None = None,
    cross_group_dtype: torch.dtype | None = None,
) -> fx.GraphModule:
    """Gather parameters in the compute dtype, reduce gradients in the reduce dtype, drop round-trip casts.

    ``reduce_dtype``: ``Config.reduce_dtype``, else ``Config.param_dtype`` (None: as backward produces them).
    ``cross_group_dtype``: ``Config.cross_group_dtype`` (None: collectives between groups keep their dtype)."""
    if not ctx.distributed:
        return gm
    mode = fake_mode(gm)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not UNSHARD or not node.users:
            continue
        targets = {dtype_cast(u) for u in node.users}
        if len(targets) != 1 or None in targets:
            continue
        (dtype,) = targets
        source = node.args[0]
        narrowed = insert(gm, aten._to_copy.default, (source,), {"dtype": dtype}, before=node, mode=mode)
        gathered = insert(gm, UNSHARD, (narrowed, *node.args[1:]), before=node, mode=mode)
        for user in list(node.users):
            user.replace_all_uses_with(gathered)
            graph.erase_node(user)
        graph.erase_node(node)
    if reduce_dtype is not None:
        for node in [n for n in graph.nodes if n.target in (REDUCE, REDUCE_SHARD)]:
            _in_dtype(gm, node, reduce_dtype, mode)
    crossing = _crossing_group(ctx)
    if cross_group_dtype is not None and crossing is not None:
        for node in [n for n in graph.nodes if n.target in (REDUCE, REDUCE_SHARD, UNSHARD)]:
            if node.args[-1] == crossing and _WIDTH.get(node.meta["val"].dtype, 0) > _WIDTH[cross_group_dtype]:
                _in_dtype(gm, node, cross_group_dtype, mode)
    for node in list(graph.nodes):
        source = _exact_round_trip(node) if node.target is aten._to_copy.default else None
        if source is not None:
            node.replace_all_uses_with(source)
            graph.erase_node(node)
    eliminate_dead_code(graph)
    return gm


def _in_dtype(gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype, mode: object) -> None:
    """The collective ``node`` run on its input cast to ``dtype``, its result cast back to the input's dtype."""
    value = node.args[0]
    own = value.meta["val"].dtype
    if own == dtype or not value.meta["val"].is_floating_point():
        return
    narrowed = insert(gm, aten._to_copy.default, (value,), {"dtype": dtype}, before=node, mode=mode)
    moved = insert(gm, node.target, (narrowed, *node.args[1:]), before=node, mode=mode)
    widened = insert(gm, aten._to_copy.default, (moved,), {"dtype": own}, before=node, mode=mode)
    node.replace_all_uses_with(widened)
    gm.graph.erase_node(node)


def _crossing_group(ctx: PassContext) -> str | None:
    """The process group whose collectives run between groups: hybrid sharding's replicate group (the gradient
    shards' all-reduce); with hpZ every rank's group (the forward's gathers, the gradients' reduce-scatters)."""
    if ctx.replicate_group is not None:
        return ctx.replicate_group.name
    return ctx.group_name if ctx.secondary_group is not None else None
