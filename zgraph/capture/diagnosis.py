"""How a failed trace is explained: the line of the user's own code it failed at (not torch's, not zgraph's),
which data-dependent Python operation (a branch on a tensor's value, a shape that depends on data) made it fail,
and whether it failed inside ``torch.amp.GradScaler``."""

from __future__ import annotations

import os
import traceback

import torch

from zgraph.passes import pass_list
from zgraph.runtime import state

_TORCH_DIR = os.path.dirname(torch.__file__)
_ZGRAPH_DIRS = (  # zgraph/, and passes/ and runtime/ (installed as zgraph.passes and zgraph.runtime)
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    *(os.path.dirname(os.path.abspath(m.__file__)) for m in (pass_list, state)),
)


def _user_frame(tb: traceback.StackSummary | list) -> traceback.FrameSummary | None:
    """The innermost frame of the user's own code (not torch, not zgraph) in a traceback."""
    found = None
    for frame in tb:
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or path.startswith(_ZGRAPH_DIRS) or frame.filename.startswith("<"):
            continue
        found = frame
    return found


def where(exc: BaseException) -> str:
    """Where in the user's code ``exc`` was raised, as a suffix for a message (file, line, function, code); ""
    when no frame of the traceback is the user's."""
    frame = _user_frame(traceback.extract_tb(exc.__traceback__))
    if frame is None:
        return ""
    return f" at {frame.filename}:{frame.lineno} ({frame.name}): `{(frame.line or '').strip()}`"


def raised_in_grad_scaler(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside ``torch.amp.GradScaler``."""
    return any(
        frame.filename.replace(os.sep, "/").endswith("amp/grad_scaler.py")
        for frame in traceback.extract_tb(exc.__traceback__)
    )


def data_dependent(exc: BaseException) -> str | None:
    """A description of the data-dependent Python operation behind a tracing failure, or None."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if isinstance(exc, GuardOnDataDependentSymNode):
        return (
            "Python control flow depends on the value of a tensor (a branch or conversion on `.item()`, "
            "`bool(tensor)`, `float(tensor)`, `.tolist()`...)"
        )
    if isinstance(exc, DataDependentOutputException):
        return f"`{exc.func}` returns a Python value computed from tensor data"
    if isinstance(exc, DynamicOutputShapeException):
        return f"`{exc.func}` returns a tensor whose shape depends on tensor data"
    return None
