"""Random ops of the functional graph draw their numbers into the elements eager PyTorch gives them.

Why: eager in-place random ops fill the tensor they are called on in its *memory order*. Dropout on CPU is
``input * empty_like(input).bernoulli_(1 - p) / (1 - p)``, and ``empty_like`` keeps the input's strides, so on a
transposed activation (``nn.TransformerEncoderLayer(batch_first=True)``'s attention output) the mask is filled
column by column. Functionalization turns ``x.bernoulli_(p)`` into ``bernoulli.p(x, p)``, whose kernel returns
a fresh *contiguous* tensor filled row by row: the same random stream lands on other elements.

The rule (``match_random_layout``): while the step is traced (functionalized as it runs), each in-place random
fill marks the functional op it becomes with the tensor it filled (``RecordingFills``: ``node.meta[FILLED]``, where
eager semantics are still explicit). A functional random op of ``_RANDOM_FILLS`` whose filled tensor had a different
order of strides than the functional op produces is rewritten to draw on its inputs permuted into that memory order
(dims sorted by decreasing stride: the order the CPU kernels fill in) and to permute the result back::

    bernoulli.p(x, p)  ->  permute(bernoulli.p(permute(x, order), p), inverse(order))

so element ``(i, j, k)`` gets exactly the number eager gives it, and the result has eager's strides (where
eager's tensor was dense). Only tensors whose strides do not overlap are rewritten. Values downstream of a
rewritten op get fake values with the new strides.

Which ops (``_RANDOM_FILLS``): ``bernoulli.p`` returns a contiguous tensor whatever the strides of its input,
so every functionalized ``x.bernoulli_(p)`` (dropout) on a non-contiguous ``x`` is rewritten; a direct
``torch.bernoulli(x, p)`` is contiguous in eager too and is left alone. ``bernoulli.Tensor`` and
``bernoulli.default`` fall under the same rule (their layouts agree with eager's today). The other functional
fills (``normal_functional``, ``uniform``, ``exponential``, ``random``, ``cauchy``, ``log_normal``,
``geometric``, and ``rand_like``/``randn_like``) keep their input's strides when it is dense, so they already
match, and are not rewritten: their CPU kernels choose their algorithm by contiguity (``normal_`` of 16 or more
contiguous floats draws in vectorized batches), which a permutation would change. Known gap: ``normal_`` in
place on a non-dense view (``x[:, 2:9]``) of 16 or more elements draws with another algorithm than eager.

What later code may rely on: the graph's random ops consume the generator in the order eager does and give
every element eager's number (for dense tensors and in-place fills of dense tensors); node ``meta["val"]``
strides agree with what the eager backend computes.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from zgraph.graph import compute_val, fake_mode

aten = torch.ops.aten

# Functional random ops that fill a fresh tensor element by element, in its memory order; every tensor argument is
# element-wise (of the output's shape, or broadcast to it), so permuting them all permutes the result.
_RANDOM_FILLS = {
    aten.bernoulli.p,
    aten.bernoulli.Tensor,
    aten.bernoulli.default,
}
_IN_PLACE_FILLS = {aten.bernoulli_.float, aten.bernoulli_.Tensor}  # what functionalization makes of them: above
FILLED = "zgraph_filled"
"""``node.meta`` key of a functional random op made from an in-place fill: the fake tensor it filled, as it was."""


class RecordingFills(FunctionalTensorMode):
    """Torch's functionalization (the trace's), each in-place random fill of ``_IN_PLACE_FILLS`` marking the
    functional op it becomes with the tensor it filled (``FILLED``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        if func not in _IN_PLACE_FILLS or not isinstance(args[0], FunctionalTensor):
            return super().__torch_dispatch__(func, types, args, kwargs)
        torch._sync(args[0])
        filled = torch._from_functional_tensor(args[0].elem)
        graph = get_proxy_mode().tracer.graph
        last = next(iter(reversed(graph.nodes)))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        node = last.next  # the ops functionalization traced for it: the functional fill (then a view's write-back)
        while node.op != "root" and node.target not in _RANDOM_FILLS:
            node = node.next
        if node.op != "root":
            node.meta[FILLED] = filled
        return out


def _fill_order(t: torch.Tensor) -> list[int] | None:
    """The dims of ``t`` from largest to smallest stride (the order CPU kernels walk its memory in), or None
    where its elements overlap (zero or crossing strides): then no single order exists."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    sized = [d for d in order if t.shape[d] > 1]
    for outer, inner in zip(sized, sized[1:]):
        if t.stride(outer) < t.stride(inner) * t.shape[inner]:
            return None
    if sized and t.stride(sized[-1]) == 0:
        return None
    return order


def _sized(order: list[int], t: torch.Tensor) -> list[int]:
    """``order`` without dims of size 1 (they do not change the order elements are filled in)."""
    return [d for d in order if t.shape[d] > 1]


def _insert(gm: fx.GraphModule, target: Any, args: tuple, like: fx.Node, mode: Any, after: bool = False) -> fx.Node:
    """``target(*args)`` next to ``like`` (before it, or after it), with ``like``'s provenance and phase tags and
    a fake value."""
    with gm.graph.inserting_after(like) if after else gm.graph.inserting_before(like):
        node = gm.graph.call_function(target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k not in _PER_VALUE_META})
    compute_val(node, mode)
    return node


_PER_VALUE_META = ("val", "tensor_meta", "original_aten")


def _permuted_arg(gm: fx.GraphModule, arg: Any, random_op: fx.Node, order: list[int], mode: Any) -> Any:
    """A tensor argument of ``random_op`` permuted into ``order`` (broadcast to the output's shape first where
    needed); 0-d tensors and scalars as they are."""
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return arg
    shape = random_op.meta["val"].shape
    if val.shape != shape:
        arg = _insert(gm, aten.expand.default, (arg, list(shape)), random_op, mode)
    return _insert(gm, aten.permute.default, (arg, order), random_op, mode)


def match_random_layout(gm: fx.GraphModule) -> list[fx.Node]:
    """Rewrite the random ops of the functional graph ``gm`` so each fills its elements in the memory order
    eager uses (the rule: module docstring). Returns the rewritten random nodes."""
    rewritten: list[fx.Node] = []
    changed: set[fx.Node] = set()
    mode = None
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _RANDOM_FILLS:
            continue
        expected = node.meta.get(FILLED)
        actual = node.meta.get("val")
        if not isinstance(expected, torch.Tensor) or not isinstance(actual, torch.Tensor):
            continue
        if expected.shape != actual.shape or expected.dim() < 2:
            continue
        order = _fill_order(expected)
        if order is None or _sized(order, expected) == _sized(_fill_order(actual) or [], actual):
            continue
        mode = mode or fake_mode(gm)
        node.args = tuple(_permuted_arg(gm, a, node, order, mode) for a in node.args)
        node.kwargs = {k: _permuted_arg(gm, v, node, order, mode) for k, v in node.kwargs.items()}
        compute_val(node, mode)
        inverse = sorted(range(len(order)), key=order.__getitem__)
        back = _insert(gm, aten.permute.default, (node, inverse), node, mode, after=True)
        node.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
        rewritten.append(node)
        changed.add(back)
    if changed:
        _refresh_downstream(gm, changed, mode)
    return rewritten


def _layout(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), tuple(val.stride()), val.dtype)
    if isinstance(val, (list, tuple)):
        return tuple(_layout(v) for v in val)
    return None


def _refresh_downstream(gm: fx.GraphModule, changed: set[fx.Node], mode: Any) -> None:
    """Recompute the fake values of the tensor ops downstream of ``changed`` whose inputs' strides changed, so
    meta strides stay those the eager backend computes (later passes decide copies by them). Ops whose outputs
    are not tensors (``.item()``) or depend on data keep their values: recomputing would mint new symbols."""
    for node in gm.graph.nodes:
        if node in changed or node.op != "call_function" or not any(a in changed for a in node.all_input_nodes):
            continue
        old = node.meta.get("val")
        if _layout(old) is None:
            continue
        target = node.target
        if target is operator.getitem:
            parent, index = node.args
            node.meta["val"] = parent.meta["val"][index]
        elif not isinstance(target, torch._ops.OpOverload) or (
            torch.Tag.data_dependent_output in target.tags or torch.Tag.dynamic_output_shape in target.tags
        ):
            continue
        else:
            try:
                compute_val(node, mode)
            except Exception:  # an op fake mode cannot rerun: its traced value stays
                node.meta["val"] = old
        if _layout(node.meta["val"]) == _layout(old):
            node.meta["val"] = old  # same layout: keep the traced value, stop here
        else:
            changed.add(node)
