"""The one capture protocol, used by a step's call and by its estimate alike.

A first optimizer step creates state (Adam's moments) that the graph must read as inputs. It is guessed first —
every parameter that requires grad gets a gradient — and created, as torch.optim creates it, before the trace:
when the trace updates all of it, that one trace is the step's. Otherwise the state of the parameters that got no
gradient is removed again and the step traced once more. State the guess does not cover (an optimizer zgraph
traces as written) is created from what a trace created, and the step traced again with it. A trace that fails,
or finds more to bind, leaves no guessed state behind.

After each trace the caller says whether the trace found something to bind first (``more_to_bind``: modules or
optimizers reached outside the arguments, tensors frozen as constants that zgraph can locate); the capture then
leaves the state as it was and returns ``Rebind``: the caller binds it and captures again. A step whose returned
tensors still require grad is traced once more, with their backward (``zgraph.capture.joint``); the result is
finished (``finish``). A trace that stops at a ``torch.compile`` wrapper is done again through it
(``zgraph.capture.compiled``), as are the capture's later traces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from zgraph.capture.captured import CapturedGraph, CaptureRequest, Traced
from zgraph.capture.collectives import untraceable_collective
from zgraph.capture.compiled import CompileWrapperReached
from zgraph.capture.functionalize import functional_step
from zgraph.capture.joint import needs_split, trace_joint
from zgraph.capture.optimizers import create_first_state, drop_state, first_state_candidates
from zgraph.capture.trace import trace_step
from zgraph.errors import CaptureError


@dataclass(frozen=True)
class Rebind:
    """The trace found state zgraph must bind before the step can be captured: bind it, capture again."""

    reason: str
    """What was found (for the error when binding never settles)."""


def capture(request: CaptureRequest, more_to_bind: Callable[[Traced], str | None]) -> CapturedGraph | Rebind:
    """Capture the request's step (module docstring). ``more_to_bind(traced)``: what a complete trace found to
    bind first, or None; it may raise (the guessed state is removed first)."""
    binding, dtype = request.binding, request.config.optimizer_state_dtype
    guessed = first_state_candidates(binding)
    if guessed:
        create_first_state(binding, guessed, dtype, request.settle)
    created = False
    while True:
        try:
            traced = trace_step(request)
            found = more_to_bind(traced)
        except BaseException as error:
            if isinstance(error, CompileWrapperReached) and not request.through_compile:
                request = dataclasses.replace(request, through_compile=True)
                continue
            drop_state(binding, guessed)
            raise
        if found is not None:
            drop_state(binding, guessed)
            return Rebind(found)
        assert traced.captured is not None
        missed = [pair for pair in guessed if pair not in set(traced.captured.updated_state)]
        if missed:  # parameters that got no gradient get no state, as in eager: trace again without theirs
            drop_state(binding, missed)
            guessed = [pair for pair in guessed if pair not in missed]
            continue
        guessed = []
        if not created and traced.captured.created_state:
            created = True
            if create_first_state(binding, traced.captured.created_state, dtype, request.settle):
                continue
        if needs_split(traced):  # outputs with a grad_fn: trace forward + backward from tangents
            traced = trace_joint(request, traced)
        captured = finish(traced)
        captured.through_compile = request.through_compile
        return captured


def finish(traced: Traced) -> CapturedGraph:
    """The captured step graph from a complete trace: refuses collectives zgraph cannot trace, then names and
    tags the functional graph (``zgraph.capture.functionalize``)."""
    assert traced.gm is not None and traced.captured is not None
    collective = untraceable_collective(traced.gm)
    if collective is not None:
        raise CaptureError(
            f"the step calls a torch.distributed collective zgraph cannot trace ({collective}); inside a step "
            "use torch.distributed.all_reduce, broadcast, all_gather_into_tensor or reduce_scatter_tensor on "
            "tensors (traced as functional collectives), or torch.distributed._functional_collectives"
        )
    captured = traced.captured
    captured.gm = functional_step(traced.gm, traced.specs, traced.roles)
    return captured
