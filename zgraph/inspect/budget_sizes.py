"""The argument sizes a step's memory plan is made for (``Config.memory_budget`` where sizes change).

A plan made at one call's sizes fits every call that is no larger, not a larger one. So the plan is made for the
largest size of every tensor argument's dims seen so far, and at least the ``max=`` a dim is marked with
(``zgraph.mark_dynamic``): ``planned_shapes``. A call larger than that in some dim (``grown``) is planned for again,
at the new largest shapes (``at_shapes``: the call with its tensor arguments enlarged where they are smaller).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import Tensor

from zgraph.binding.arguments import StepCall
from zgraph.binding.dynamic import marked_ranges
from zgraph.tree import iter_leaves, map_leaves

Shapes = dict[str, tuple[int, ...]]


def planned_shapes(call: StepCall, planned: Mapping[str, tuple[int, ...]]) -> Shapes:
    """Per tensor argument (by path): the largest of its shape in ``planned``, in this call and its marked
    ``max=``, dim by dim."""
    out: Shapes = dict(planned)
    for path, t in _tensors(call):
        shape = list(t.shape)
        for dim, (_, hi) in marked_ranges(t).items():
            if hi is not None and dim < len(shape):
                shape[dim] = max(shape[dim], hi)
        before = out.get(path)
        if before is not None and len(before) == len(shape):
            shape = [max(a, b) for a, b in zip(before, shape)]
        out[path] = tuple(shape)
    return out


def grown(call: StepCall, planned: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The dims in which this call is larger than ``planned``, described (``idx dim 1: 512 > 256``)."""
    out = []
    for path, t in _tensors(call):
        before = planned.get(path)
        if before is None or len(before) != t.dim():
            continue
        out += [f"`{path}` dim {d}: {n} > {b}" for d, (n, b) in enumerate(zip(t.shape, before)) if n > b]
    return out


def at_shapes(call: StepCall, shapes: Mapping[str, tuple[int, ...]]) -> StepCall:
    """``call`` with every tensor argument whose shape differs from ``shapes`` replaced by zeros of that shape
    (its dtype and device): the call a plan for those shapes estimates."""

    def enlarged(path: str, leaf: object) -> object:
        shape = shapes.get(path)
        if not isinstance(leaf, Tensor) or shape is None or tuple(leaf.shape) == shape:
            return leaf
        return torch.zeros(shape, dtype=leaf.dtype, device=leaf.device)

    try:
        bound = inspect.signature(call.fn).bind(*call.args, **call.kwargs)
    except (TypeError, ValueError):
        args = tuple(map_leaves(a, enlarged, f"args[{i}]") for i, a in enumerate(call.args))
        kwargs = {k: map_leaves(v, enlarged, k) for k, v in call.kwargs.items()}
        return StepCall.of(call.fn, args, kwargs)
    for name, value in bound.arguments.items():
        bound.arguments[name] = map_leaves(value, enlarged, name)
    return StepCall.of(call.fn, bound.args, bound.kwargs)


def _tensors(call: StepCall) -> list[tuple[str, Tensor]]:
    leaves = [(path, leaf) for name, value in call.arguments for path, leaf in iter_leaves(value, name)]
    return [(path, t) for path, t in leaves if isinstance(t, Tensor)]
