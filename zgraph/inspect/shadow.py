"""The stand-ins an estimate traces (``zgraph.inspect.estimate``): copies of a step call's arguments whose modules
and optimizers hold meta tensors (no memory) in place of every parameter, buffer, ``.grad`` and optimizer state;
and the step captured on them (``capture_standins``)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zgraph.binding.arguments import StepCall
from zgraph.binding.dynamic import DynamicDims
from zgraph.binding.guards import discover
from zgraph.binding.session import user_tensors
from zgraph.capture.captured import CapturedGraph, CaptureRequest, Traced
from zgraph.capture.cuda_trace import cuda_trace
from zgraph.capture.protocol import capture
from zgraph.compile.build import collector_paused
from zgraph.config import Config
from zgraph.errors import CaptureError
from zgraph.runtime.state import Binding


class EstimateError(CaptureError):
    """The step cannot be estimated (what it reaches cannot be copied to stand-ins, or it cannot be traced)."""


def _meta(t: Tensor) -> Tensor:
    """A meta tensor with ``t``'s (logical) shape and dtype."""
    if isinstance(t, DTensor) or t.device.type != "meta":
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    return t.detach()


def shadow_call(call: StepCall) -> tuple[StepCall, torch.device]:
    """Copies of the arguments whose modules and optimizers hold meta stand-ins of every tensor (tied tensors
    stay tied, tensors outside modules and optimizers are shared, not copied), and the device the stand-ins
    stand for."""
    modules, optimizers = discover(call)
    memo: dict[int, object] = {}
    devices = []
    grads = []
    for _, root in modules:
        for p in root.parameters():
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(_meta(p), requires_grad=p.requires_grad)
                devices.append(p.device)
                if p.grad is not None:
                    grads.append((memo[id(p)], _meta(p.grad)))
        for b in root.buffers():  # a 0-d one keeps its value: a host counter the step may branch on
            memo.setdefault(id(b), _meta(b) if b.dim() else b.detach().clone())
    for _, opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and value.dim() > 0:
                    memo.setdefault(id(value), _meta(value))
    _share_other_tensors((call.args, call.kwargs), memo)
    shadow_args, shadow_kwargs = copy.deepcopy((call.args, call.kwargs), memo)
    shadow = StepCall.of(call.fn, shadow_args, shadow_kwargs)
    for p, grad in grads:
        p.grad = grad
    ids = {id(obj) for _, obj in [*modules, *optimizers]}
    copied_modules, copied_optimizers = discover(shadow)
    left = [name for name, obj in [*copied_modules, *copied_optimizers] if id(obj) in ids]
    if left:
        raise EstimateError(
            f"step.estimate needs the modules and optimizers the step uses among its arguments, to trace copies of "
            f"them; it reaches {', '.join(left)} through its closure or globals. Pass them as arguments."
        )
    real = [d for d in devices if d.type != "meta"]
    return shadow, real[0] if real else torch.device("cpu")


def _share_other_tensors(value: object, memo: dict[int, object]) -> None:
    """Map every tensor among the arguments that is not a module's or optimizer's to itself (shared, not copied)."""
    if isinstance(value, Tensor):
        memo.setdefault(id(value), value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _share_other_tensors(v, memo)
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            _share_other_tensors(v, memo)


def capture_standins(call: StepCall, binding: Binding, config: Config, device: torch.device) -> CapturedGraph:
    """The step captured on the stand-ins by the capture protocol (``zgraph.capture.protocol``), as a call would
    capture it; on ``"cuda"`` where this torch cannot trace CUDA tensors, as CPU fakes under CUDA's attention and
    autocast (``zgraph.capture.cuda_trace``)."""
    emulated = device.type == "cuda" and not torch.cuda.is_available()
    request = CaptureRequest(
        fn=call.fn,
        args=call.args,
        kwargs=call.kwargs,
        binding=binding,
        user_tensors=user_tensors(binding, call),
        config=dataclasses.replace(config, autocast_dtype=None) if emulated else config,
        meta_as=torch.device("cpu") if emulated else device,
        dynamic=marked_dims(call, binding, config.dynamic),
    )
    modules = [m for _, m in binding.modules]
    with cuda_trace(modules, config.autocast_dtype) if emulated else contextlib.nullcontext(), collector_paused():
        captured = capture(request, _refuse_unbound)
    assert isinstance(captured, CapturedGraph)  # _refuse_unbound never asks to bind more
    return captured


def marked_dims(call: StepCall, binding: Binding, mode: bool | None = None) -> dict[str, frozenset[int]]:
    """The argument dims marked with ``zgraph.mark_dynamic`` (with ``mode``, ``Config.dynamic``, True: every dim),
    by path: the estimate traces them as size symbols."""
    dims = DynamicDims(mode)
    dims.observe(call)
    return dims.of([path for path, _ in user_tensors(binding, call)])


def _refuse_unbound(traced: Traced) -> None:
    """An estimate binds once: a step that reaches modules or optimizers outside its arguments is refused."""
    if traced.unbound is not None:
        raise EstimateError(
            "step.estimate: the step reaches modules or optimizers that are not among its arguments; pass them as "
            "arguments"
        )
