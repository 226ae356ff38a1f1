"""Split mode, capture side: a step that returns tensors requiring grad it did not backpropagate through itself.

``needs_split`` decides from a finished trace; ``trace_joint`` traces the step again as a joint graph: the step,
then ``torch.autograd.backward(outputs, tangents)`` with one tangent graph input per such output. The joint graph
goes through the whole pass list like any step; ``zgraph.passes.partition`` then cuts the transformed graph
into a forward and a backward graph, and ``zgraph.compile.split_runner`` runs them (the backward from the outputs'
``grad_fn``). The joint graph computes fresh gradients (``.grad`` present on entry is left out of the trace):
the runtime adds them to whatever ``.grad`` holds when the backward runs, as eager accumulates.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

from zgraph.capture.captured import CaptureRequest, SplitInfo, Traced
from zgraph.capture.trace import trace_step
from zgraph.graph import BACKWARD, CUSTOM, PHASE
from zgraph.tree import iter_leaves

TANGENT_PREFIX = "tangent"


def needs_split(traced: Traced) -> bool:
    """Whether the traced step returns tensors that require grad and ran no backward itself."""
    if traced.captured is None or traced.gm is None or not traced.captured.grad_outputs:
        return False
    backward = lambda n: (n.meta.get(CUSTOM) or {}).get(PHASE) == BACKWARD
    return not any(backward(n) for n in traced.gm.graph.nodes)


@contextlib.contextmanager
def _without_grads(tensors: list[Tensor]) -> Iterator[None]:
    """``.grad`` of ``tensors`` set to None for the duration (restored after)."""
    saved = [(t, t.grad) for t in tensors if t.is_leaf and t.grad is not None]
    for t, _ in saved:
        t.grad = None
    try:
        yield
    finally:
        for t, grad in saved:
            t.grad = grad


def trace_joint(request: CaptureRequest, first: Traced) -> Traced:
    """Trace the request's step with the backward of its grad-requiring outputs (found by the ``first`` trace)
    against tangent inputs; the returned trace's ``captured.split`` is its ``SplitInfo``."""
    assert first.captured is not None
    specs = first.captured.grad_outputs
    positions = [position for position, *_ in specs]
    estimate = request.meta_as is not None  # estimates hold no memory
    tangents = [
        torch.zeros(_hints(shape), dtype=dtype, device="meta" if estimate else device)
        for _, shape, dtype, device in specs
    ]
    fn = request.fn

    def joint(step_args: tuple, step_kwargs: dict, traced_tangents: list[Tensor]) -> object:
        result = fn(*step_args, **step_kwargs)
        kinds = (Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
        returned = [leaf for _, leaf in iter_leaves(result, "") if isinstance(leaf, kinds)]
        outs = [returned[p] for p in positions]
        torch.autograd.backward(outs, list(traced_tangents))
        return result

    joint.__name__, joint.__qualname__ = getattr(fn, "__name__", "step"), getattr(fn, "__qualname__", "step")
    user_tensors = request.user_tensors
    n_user = len(user_tensors)
    all_user = [*user_tensors, *((f"{TANGENT_PREFIX}[{i}]", t) for i, t in enumerate(tangents))]
    grads_of = [r.tensor for r in request.binding.params] + [t for _, t in user_tensors]
    dynamic = dict(request.dynamic)  # a tangent's sizes are symbols where its output's are
    for i, (_, shape, _, _) in enumerate(specs):
        dims = frozenset(d for d, n in enumerate(shape) if isinstance(n, torch.SymInt))
        if dims:
            dynamic[f"{TANGENT_PREFIX}[{i}]"] = dims
    joint_request = dataclasses.replace(
        request,
        fn=joint,
        args=(request.args, request.kwargs, tangents),
        kwargs={},
        user_tensors=all_user,
        dynamic=dynamic,
    )
    with _without_grads(grads_of):
        traced = trace_step(joint_request)
    if traced.captured is not None:
        if traced.captured.size_guards is not None:
            traced.captured.size_guards = traced.captured.size_guards.of_step(n_user)
        grad_inputs = [i for i, (_, t) in enumerate(user_tensors) if t.requires_grad]
        traced.captured.split = SplitInfo(positions, list(range(n_user, n_user + len(tangents))), n_user, grad_inputs)
        traced.captured.grad_outputs = list(specs)
    return traced


def _hints(shape: tuple) -> list[int]:
    """A traced output's shape with each symbolic size at the value the capturing call has."""
    return [guarding_hint_or_throw(n) for n in shape]
