"""``sequence_parallel`` (``Config.sequence_parallel=N``, DeepSpeed-Ulysses): attention over whole sequences that
the ranks of a sequence group hold a slice each of.

Each rank's step receives slice ``r`` of every sequence (``zgraph.shard_sequence``); everything but attention
works token by token and runs on the slice as it is. Around each ``scaled_dot_product_attention`` (the aten op
it becomes: flash, efficient, cuDNN or the CPU flash kernel) the pass puts an all-to-all
(``zgraph.sequence_ops``): query, key and value go from a sequence slice of all heads to the whole sequence of
``heads / N`` heads, attention runs there (a causal mask is then the whole sequence's), and its output goes back;
in the backward the gradient of the output takes the same way in and the gradients of query, key and value the
way back. Positions: the step saw only its slice, so a position it computes — ``arange`` of the slice's length, or
the first rows of a buffer (a position table: ``pos_ids[:seq]``) — is moved to the slice's place in the sequence.

The loss: gradients are averaged over every rank (data and sequence), so where every rank's loss is the mean over
as many tokens, their average is the mean over all the global batch's tokens. Where the counts differ (ignored
labels: the sequence's last position once labels are shifted, ``ignore_index`` padding), each ``nll_loss``
(``cross_entropy``) mean is taken instead as this rank's sum over the global count divided by the world size (one
all-reduce of the counts in the forward; its backward divides by the same), so the ranks' average is the global
mean, as eager computes it. ZeRO shards over every rank, as DeepSpeed does with Ulysses.

Refused (``PassError``, before anything runs): a step with no attention the pass recognises (an attention
written out as matmul and softmax: use ``F.scaled_dot_product_attention``), a head count ``N`` does not divide,
and an explicit attention mask (a mask of the slice's tokens cannot stand for the sequence's; use ``is_causal``).
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from zgraph.errors import PassError
from zgraph.graph import FORWARD, INPUT, PHASE, Axis, compute_val, eliminate_dead_code, fake_mode, insert
from zgraph.ops import COMBINE
from zgraph.passes.pass_list import PassContext
from zgraph.passes.token_mean import as_sum_over, token_means
from zgraph.sequence_ops import HEADS_TO_SEQ, SEQ_TO_HEADS
from zgraph.sizes import same_size

aten = torch.ops.aten
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    ),
    aten._scaled_dot_product_flash_attention.default: aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default: (
        aten._scaled_dot_product_efficient_attention_backward.default
    ),
    aten._scaled_dot_product_cudnn_attention.default: aten._scaled_dot_product_cudnn_attention_backward.default,
}
# where each backward op takes the output's gradient, q, k, v and the forward's output; and, for the CUDA kernels,
# the longest sequence of the batch (``max_q``, ``max_k``), which becomes the whole sequence's length
_BACKWARD_ARGS = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: {"out": 4},
    aten._scaled_dot_product_flash_attention_backward.default: {"out": 4, "max_q": 8, "max_k": 9},
    aten._scaled_dot_product_efficient_attention_backward.default: {"out": 5},
    aten._scaled_dot_product_cudnn_attention_backward.default: {"out": 4, "max_q": 11, "max_k": 12},
}
_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def sequence_parallel_applies(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Whether ``sequence_parallel`` changes the graph: only with a sequence group (``Pass.applies``)."""
    return ctx.sequence_group is not None and ctx.distributed


def sequence_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Ulysses: all-to-alls around attention so it sees whole sequences; positions moved to each slice's place."""
    axis = ctx.sequence_group
    if axis is None or not sequence_parallel_applies(gm, ctx):
        return gm
    mode = fake_mode(gm)
    forwards = [n for n in gm.graph.nodes if n.target in ATTENTION]
    if not forwards:
        raise PassError(
            f"Config.sequence_parallel={axis.size}: the step has no scaled_dot_product_attention to run over the "
            "whole sequence (attention written as matmul + softmax is not recognised; use "
            "torch.nn.functional.scaled_dot_product_attention, or a Hugging Face model with attn_implementation="
            '"sdpa")'
        )
    local = forwards[0].args[0].meta["val"].shape[2]
    for node in forwards:
        _check(node, axis)
        _around(gm, node, axis, mode)
    _move_positions(gm, local, axis.rank * local, mode)
    for node in token_means(gm):
        as_sum_over(gm, node, functools.partial(_global_share, gm, ctx=ctx, mode=mode), mode)
    eliminate_dead_code(gm.graph)
    return gm


def _global_share(gm: fx.GraphModule, count: fx.Node, *, ctx: PassContext, mode: object) -> fx.Node:
    """Every rank's counted tokens over the world size: each rank's share of the global token mean."""
    at = dict(after=count, phase=count.meta.get(PHASE), mode=mode)
    everyone = insert(gm, COMBINE, (count, "sum", ctx.world_size, ctx.group_name), **at)
    return insert(
        gm, aten.div.Tensor, (everyone, ctx.world_size), after=everyone, phase=count.meta.get(PHASE), mode=mode
    )


def _check(node: fx.Node, axis: Axis) -> None:
    heads = node.args[0].meta["val"].shape[1]
    if heads % axis.size or node.args[1].meta["val"].shape[1] % axis.size:
        raise PassError(
            f"Config.sequence_parallel={axis.size} must divide the attention's head count: {node.name} has "
            f"{heads} query heads and {node.args[1].meta['val'].shape[1]} key/value heads"
        )
    if any(isinstance(a, fx.Node) for a in (*node.args[3:], *node.kwargs.values())):  # attn_mask / attn_bias
        raise PassError(
            f"Config.sequence_parallel={axis.size}: attention {node.name} takes an explicit attn_mask, which covers "
            "only this rank's slice of the sequence; use is_causal=True (or no mask)"
        )


def _around(gm: fx.GraphModule, forward: fx.Node, axis: Axis, mode: object) -> None:
    """All-to-alls around one attention (its forward node and, where the step has one, its backward node)."""
    group = (axis.size, axis.name)
    at = dict(before=forward, phase=forward.meta.get(PHASE), mode=mode)
    q, k, v = (insert(gm, SEQ_TO_HEADS, (x, *group), **at) for x in forward.args[:3])
    forward.args = (q, k, v, *forward.args[3:])
    compute_val(forward, mode)
    items = {u.args[1]: u for u in forward.users if u.target is operator.getitem}
    out = items[0]
    strides = out.meta["val"].stride()
    for item in items.values():
        compute_val(item, mode)
    backward = _backward_of(forward, out)
    _back_to_sequence(gm, out, strides, group, mode)
    if backward is not None:
        _backward(gm, backward, (q, k, v, out), group, mode)


def _backward_of(forward: fx.Node, out: fx.Node) -> fx.Node | None:
    """The backward node of ``forward``'s attention: the one reading its output (maybe through detach)."""
    want = ATTENTION[forward.target]
    readers = list(out.users)
    for reader in list(readers):
        if reader.target is aten.detach.default:
            readers.extend(reader.users)
    found = [r for r in readers if r.target is want]
    return found[0] if found else None


def _backward(gm: fx.GraphModule, node: fx.Node, forward_values: tuple, group: tuple, mode: object) -> None:
    """The backward attention on the forward's head layout: its output's gradient in, q/k/v gradients back."""
    q, k, v, out = forward_values
    at = dict(before=node, phase=node.meta.get(PHASE), mode=mode)
    args = list(node.args)
    where = _BACKWARD_ARGS[node.target]
    args[:4] = [insert(gm, SEQ_TO_HEADS, (args[0], *group), **at), q, k, v]
    args[where["out"]] = out
    for key in ("max_q", "max_k"):
        if key in where:
            args[where[key]] = q.meta["val"].shape[2]
    node.args = tuple(args)
    compute_val(node, mode)
    for item in [u for u in node.users if u.target is operator.getitem and u.args[1] < 3]:
        strides = item.meta["val"].stride()
        compute_val(item, mode)
        _back_to_sequence(gm, item, strides, group, mode)


def _back_to_sequence(gm: fx.GraphModule, node: fx.Node, strides: tuple, group: tuple, mode: object) -> None:
    """What read ``node`` (now in the head layout) reads it back in the sequence layout, with the ``strides`` it
    had (its readers were traced with them: a ``view`` of a transposed attention output needs them)."""
    at = dict(phase=node.meta.get(PHASE), mode=mode)
    value = insert(gm, HEADS_TO_SEQ, (node, *group), after=node, **at)
    first = value
    order = sorted(range(len(strides)), key=lambda dim: -strides[dim])  # outermost dim first
    if list(order) != list(range(len(strides))):
        inverse = sorted(range(len(order)), key=order.__getitem__)
        moved = insert(gm, aten.permute.default, (value, order), after=value, **at)
        dense = insert(gm, aten.clone.default, (moved,), {"memory_format": torch.contiguous_format}, after=moved, **at)
        value = insert(gm, aten.permute.default, (dense, inverse), after=dense, **at)
    node.replace_all_uses_with(value, delete_user_cb=lambda user: user is not first)


def _move_positions(gm: fx.GraphModule, length: int | torch.SymInt, offset: int | torch.SymInt, mode: object) -> None:
    """Forward ``arange`` of ``length`` elements, and ``buffer[:length]`` of a graph input, now start at
    ``offset``: the positions of this rank's slice in the whole sequence. A symbolic ``length`` (a graph captured
    with symbolic sequence sizes) is matched for every size, never at its hint only; the new bounds are then
    symbolic too (the pass list makes the graph compute them: ``zgraph.graph.bind_sizes``)."""
    if same_size(offset, 0):
        return
    for node in list(gm.graph.nodes):
        if node.meta.get(PHASE) != FORWARD:
            continue
        val = node.meta["val"]
        if node.target in _ARANGES and val.dim() == 1 and same_size(val.numel(), length):
            start = node.args[0] if node.target is not aten.arange.default else 0
            step = node.args[2] if node.target is aten.arange.start_step else 1
            if step != 1 or not isinstance(start, int):
                continue
            node.target, node.args = aten.arange.start, (start + offset, start + offset + length)
            compute_val(node, mode)
        elif node.target is aten.slice.Tensor and _is_table_head(node, length):
            node.args = (node.args[0], node.args[1], offset, offset + length)
            compute_val(node, mode)


def _is_table_head(node: fx.Node, length: int | torch.SymInt) -> bool:
    """``x[:length]`` (dim 0) of a graph input ``x`` (a buffer such as a position table)."""
    source, dim, *bounds = (*node.args, 0, None)[:4]
    end = bounds[1].meta.get("val") if isinstance(bounds[1], fx.Node) else bounds[1]
    return (
        isinstance(source, fx.Node)
        and source.op == "placeholder"
        and source.meta[INPUT].kind in ("buffer", "input")
        and dim == 0
        and bounds[0] in (0, None)
        and isinstance(end, (int, torch.SymInt))
        and same_size(end, length)
    )
