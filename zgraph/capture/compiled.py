"""``torch.compile`` wrappers a step reaches — ``torch.compile(model)`` (an ``OptimizedModule``), ``module.compile()``,
``module.forward = torch.compile(module.forward)``, a ``@torch.compile`` function — traced through to the module or
function they wrap. zgraph compiles the whole step, so the wrapper itself is not used.

Under ``make_fx`` a ``torch.compile`` wrapper refuses to run (torch's "Detected that you are using FX to symbolically
trace a dynamo-optimized function"). A trace that stops there raises ``CompileWrapperReached``; the capture traces
again under ``through_compile_wrappers``: torch's own switch for a wrapper reached by an FX trace
(``torch._dynamo.config.error_on_nested_fx_trace = False``: the wrapper calls what it wraps), set for the trace
only. The user's modules and functions are not changed.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator

import torch
from torch import nn
from torch._dynamo import eval_frame

WRAPPER_WARNING = (
    "zgraph: `{name}` reaches a torch.compile wrapper (torch.compile(model), module.compile() or a @torch.compile "
    "function): zgraph compiles the whole step, so the torch.compile wrapper is not used; the step was traced "
    "through the module or function it wraps."
)
"""The warning of a capture that traced through a ``torch.compile`` wrapper (``{name}``: the step)."""


class CompileWrapperReached(Exception):  # noqa: N818 - a signal to the capture, not an error the user sees
    """Raised when a trace stopped at a ``torch.compile`` wrapper: the capture traces again through it."""


def reached_compile_wrapper(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``torch.compile`` wrapper refusing to run under an FX trace: a ``RuntimeError`` raised
    in ``torch._dynamo.eval_frame`` itself (the innermost frame of its traceback) while wrappers refuse FX traces
    (not already under ``through_compile_wrappers``)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not isinstance(exc, RuntimeError) or not frames or not torch._dynamo.config.error_on_nested_fx_trace:
        return False
    return os.path.abspath(frames[-1].filename) == os.path.abspath(eval_frame.__file__)


@contextlib.contextmanager
def through_compile_wrappers() -> Iterator[None]:
    """``torch.compile`` wrappers reached while tracing call what they wrap."""
    with torch._dynamo.config.patch(error_on_nested_fx_trace=False):
        yield


@contextlib.contextmanager
def optimized_modules_as_modules() -> Iterator[None]:
    """An ``OptimizedModule`` reached while tracing is called as the ``nn.Module`` it is (its ``forward`` is the
    wrapper): its own ``__call__`` adds only a warning about global module hooks, and the hooks it would see are
    zgraph's own (``zgraph.capture.environment.watch_unbound_state``)."""
    optimized_call = eval_frame.OptimizedModule.__call__
    eval_frame.OptimizedModule.__call__ = nn.Module.__call__
    try:
        yield
    finally:
        eval_frame.OptimizedModule.__call__ = optimized_call
