"""Where the samples of the batch go in a step's forward: each value's batch dimension, and the ops that combine
samples (what micro-batches cannot reproduce).

The step's tensor arguments carry the batch along dim 0 (``Config.pipeline_parallel`` cuts them there). The
dimension is followed through every forward op: an elementwise op keeps it (aligned left, else right as
broadcasting does), a view or reshape moves it to the output dimension that starts at the same offset, a
permutation moves it, a matmul keeps a side's batch where the other side holds none.

An op *mixes* samples when it reads across the batch dimension: a reduction over it (a loss's mean or sum, batch
statistics), softmax or a cumulative op along it, a matmul that contracts it or multiplies two batches
(``a @ b.T``: an in-batch contrastive loss), batch norm in training, an elementwise op of two batches laid out
differently (``x[:, None] - x[None, :]``), a selection from it (``x[0]``). ``sample_flow`` returns those; which of
them are the loss's own reductions is for its caller (``zgraph.passes.micro_batch_loss``) to decide. Refused here
(``PassError``): a random op (dropout: each micro-batch would draw its own mask, not eager's slice of the whole
batch's), and an op the batch dimension cannot be followed through.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from zgraph.errors import PassError
from zgraph.graph import FORWARD, INPUT, PHASE, VAL

aten = torch.ops.aten
_MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2)}
_BATCHED = {aten.bmm.default: (0, 1), aten.baddbmm.default: (1, 2)}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
          aten.alias.default, aten.clone.default, aten.contiguous.default}  # fmt: skip


@dataclass(frozen=True)
class Batch:
    """A value's batch dimension: ``dim`` of a tensor of ``ndim`` dims (a tuple result's: of its first tensor),
    holding ``size`` samples (a multiple of them, where a reshape merged dims)."""

    dim: int
    ndim: int
    size: int


def sample_flow(gm: fx.GraphModule) -> tuple[dict[fx.Node, Batch], dict[fx.Node, str]]:
    """Each batch-dependent forward value's ``Batch``, and each op that mixes samples with why."""
    flow: dict[fx.Node, Batch] = {}
    mixing: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get(VAL)
            if node.meta[INPUT].kind == "input" and isinstance(val, torch.Tensor) and val.dim():
                flow[node] = Batch(0, val.dim(), val.shape[0])
        elif node.op == "call_function" and node.meta.get(PHASE) == FORWARD:
            _refuse_random(node)
            batch = [a for a in node.all_input_nodes if a in flow]
            if batch:
                placed = _follow(node, batch, flow, mixing)
                if placed is not None:
                    flow[node] = placed
    return flow, mixing


def _refuse_random(node: fx.Node) -> None:
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return
    named = named_arguments(node)
    if named.get("dropout_p", named.get("p")) == 0 or named.get("train") is False:  # attention without dropout
        return
    raise PassError(
        f"the forward draws random numbers ({node.name}: {node.target}; dropout in training?): under pipeline "
        "parallelism each micro-batch would draw its own, not eager's share of the whole batch's. Put dropout "
        "in eval mode (model.eval() or p=0) or train without Config.pipeline_parallel"
    )


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get(VAL)
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _follow(node: fx.Node, batch: list[fx.Node], flow: dict, mixing: dict) -> Batch | None:
    """``node``'s batch dimension (None: its value holds none, a sample count) or its entry in ``mixing``."""
    shape, target = _shape(node), node.target
    if shape is None:
        return None
    first = flow[batch[0]]
    if target is operator.getitem:
        if not shape and _attention(node.args[0]):  # its seed and offset (CUDA's kernels): not per sample
            return None
        return _aligned(shape, [first], node, mixing)
    named = named_arguments(node)
    if "batch_norm" in str(target) and named.get("training"):
        mixing[node] = "batch norm in training mode: statistics over the batch"
        return None
    if target in _MATMULS or target in _BATCHED:
        return _matmul(node, shape, flow, mixing)
    if target in (aten.t.default, aten.transpose.int, aten.permute.default):
        return _permuted(node, shape, first)
    if target in _VIEWS:
        return _viewed(node, shape, first, mixing)
    if named.get("reduction"):  # a loss op's mean or sum
        mixing[node] = f"{target} reduces over the batch"
        return None
    own = flow.get(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    dims = _dims(named, own.ndim) if own is not None else None  # an op along dims of its batch input
    if target is aten.slice.Tensor and own is not None and _whole(named, node.args[0], own):
        dims = None
    if own is not None and dims is not None and (own.dim in dims or not dims):
        mixing[node] = f"{target} across dim {own.dim}, the batch"
        return None
    if own is not None and dims is not None and "keepdim" in named and not named["keepdim"]:
        return Batch(own.dim - sum(d < own.dim for d in dims), len(shape), own.size)
    return _aligned(shape, [flow[a] for a in batch], node, mixing)


def _attention(node: fx.Node) -> bool:
    """A fused attention op (``aten._scaled_dot_product_*_attention``, ``_flash_attention_forward``...): its 0-d
    results are the random generator's seed and offset, the same for every sample."""
    return isinstance(node.target, torch._ops.OpOverload) and "attention" in node.target.name()


def _whole(named: dict, source: fx.Node, batch: Batch) -> bool:
    """A slice that keeps every sample."""
    end, size = named.get("end"), source.meta[VAL].shape[batch.dim]
    return named.get("start") in (None, 0) and (end is None or end >= size) and named.get("step", 1) == 1


def named_arguments(node: fx.Node) -> dict:
    """An aten op's arguments by name, defaults included (empty for another target)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return {}
    found = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    return dict(found.kwargs) if found is not None else {}


def _dims(named: dict, ndim: int) -> set[int] | None:
    """The dimensions an op works along (its ``dim`` or ``dims`` argument), normalized; None for an op without
    one; empty for every dimension."""
    if "dim" not in named and "dims" not in named:
        return None
    dim = named.get("dim", named.get("dims"))
    if dim is None:
        return set()
    dims = [dim] if isinstance(dim, int) else list(dim)
    return {d % max(ndim, 1) for d in dims}


def _aligned(shape: tuple, sources: list[Batch], node: fx.Node, mixing: dict) -> Batch | None:
    """An elementwise-like op: the batch dimension at the same place (from the left, else from the right)."""
    places = set()
    for b in sources:
        left, right = b.dim, len(shape) - b.ndim + b.dim
        if left < len(shape) and shape[left] % b.size == 0:
            places.add(left)
        elif 0 <= right < len(shape) and shape[right] % b.size == 0:
            places.add(right)
        else:
            places.add(None)
    if len(places) > 1 or None in places:
        mixing.setdefault(node, f"{node.target} combines values whose batches are laid out differently (pairs?)")
        return None
    return Batch(places.pop(), len(shape), sources[0].size)


def _matmul(node: fx.Node, shape: tuple, flow: dict, mixing: dict) -> Batch | None:
    batched = node.target in _BATCHED
    left, right = (flow.get(node.args[i]) for i in (_BATCHED if batched else _MATMULS)[node.target])
    size = (left or right).size
    if batched and (left is None or left.dim == 0) and (right is None or right.dim == 0):
        return Batch(0, len(shape), size)
    if not batched and right is None and left.dim == 0:
        return Batch(0, len(shape), size)
    if not batched and left is None and right.dim == 1:
        return Batch(1, len(shape), size)
    mixing[node] = f"{node.target} contracts the batch or multiplies two batches (an in-batch contrastive loss?)"
    return None


def _permuted(node: fx.Node, shape: tuple, first: Batch) -> Batch:
    if node.target is aten.permute.default:
        order = [d % len(shape) for d in node.args[1]]
    else:
        a, b = (0, 1) if node.target is aten.t.default else (node.args[1] % len(shape), node.args[2] % len(shape))
        order = list(range(len(shape)))
        order[a], order[b] = order[b], order[a]
    return Batch(order.index(first.dim), len(shape), first.size)


def _viewed(node: fx.Node, shape: tuple, first: Batch, mixing: dict) -> Batch | None:
    """A view: the output dimension that starts at the batch dimension's offset and holds whole samples."""
    before = math.prod(node.args[0].meta[VAL].shape[: first.dim])
    for j in range(len(shape) + 1):
        if math.prod(shape[:j]) == before and j < len(shape) and shape[j] % first.size == 0 and shape[j]:
            return Batch(j, len(shape), first.size)
    mixing[node] = f"{node.target} reshapes the batch dimension apart"
    return None
