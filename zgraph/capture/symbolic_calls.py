"""Python calls that would fix a host-known symbol (``zgraph.capture.host_scalars``) to this call's value, made to
keep it a symbol while the step is traced (``symbolic_calls``):

- ``torch.tensor(x)`` / ``torch.as_tensor(x)`` of a Python number that is a symbol (ASGD's
  ``torch.as_tensor(lr / ...)``) is ``torch.scalar_tensor(x)``: the same tensor, traced;
- ``F.batch_norm`` with a momentum that is a symbol: aten's batch norm takes it as a float, so the normalization runs
  on copies of the running statistics and ``zgraph::batch_norm_stats`` (the same batch norm, its momentum a Scalar
  the graph computes) updates them;
- ``float(t)`` in torch's BatchNorm (``1.0 / float(num_batches_tracked)`` with ``momentum=None``) is the symbol of
  ``t.item()`` made a float: Python's ``float()`` must return a plain float, the value of one call.

A step's own ``int(t)`` / ``float(t)`` stay Python's: a plain number, fixed where the step was captured (a guard
captures it again when the value changes); ``t.item()`` is the symbol, on which arithmetic stays symbolic.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules import batchnorm
from torch.overrides import TorchFunctionMode

_BATCH_NORM = inspect.signature(F.batch_norm)


@torch.library.custom_op("zgraph::batch_norm_stats", mutates_args=())
def batch_norm_stats(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor,
    running_var: Tensor,
    momentum: int | float | bool,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """The running mean and variance a training batch norm of ``input`` leaves, updated with ``momentum`` (a
    Scalar: a number the graph computes): the batch norm call eager makes, on copies of them (cuDNN's where eager
    would use cuDNN)."""
    mean, var = running_mean.clone(), running_var.clone()
    torch.batch_norm(input, weight, bias, mean, var, True, float(momentum), eps, torch.backends.cudnn.enabled)
    return mean, var


@batch_norm_stats.register_fake
def _batch_norm_stats_fake(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor,
    running_var: Tensor,
    momentum: int | float | bool,
    eps: float,
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(running_mean), torch.empty_like(running_var)


class _SymbolicCalls(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and len(args) == 1 and _symbolic(args[0]):
            if set(kwargs) <= {"dtype", "device"}:
                default = torch.get_default_dtype() if isinstance(args[0], torch.SymFloat) else torch.int64
                return torch.scalar_tensor(args[0], dtype=kwargs.get("dtype") or default, device=kwargs.get("device"))
        if func is F.batch_norm:
            bound = _BATCH_NORM.bind(*args, **kwargs)
            bound.apply_defaults()
            if _symbolic(bound.arguments["momentum"]):
                return _batch_norm(**bound.arguments)
        return func(*args, **kwargs)


@contextlib.contextmanager
def symbolic_calls() -> Iterator[None]:
    """While the step is traced: the calls of the module docstring keep their symbols."""
    shadowed = "float" not in vars(batchnorm)
    if shadowed:
        batchnorm.float = _host_float  # a module global shadows the builtin for the module's code
    try:
        with _SymbolicCalls():
            yield
    finally:
        if shadowed:
            vars(batchnorm).pop("float", None)


def _symbolic(value: object) -> bool:
    return isinstance(value, (torch.SymFloat, torch.SymInt))


def _host_float(x: object = 0.0) -> float | torch.SymFloat:
    """``float(x)``; the symbol of ``x.item()`` made a float where that is one the host knows."""
    if isinstance(x, Tensor) and x.numel() == 1 and not x.is_complex() and x.dtype is not torch.bool:
        value = x.item()
        if _symbolic(value) and value.node.hint is not None:  # backed: host-known (else only the run knows it)
            return torch.sym_float(value)
    return float(x)


def _batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    momentum: torch.SymFloat | torch.SymInt,
    eps: float,
) -> Tensor:
    """``F.batch_norm`` whose momentum is a symbol. Where the running statistics are not updated (evaluation, or
    none kept) the momentum is unused."""
    if not training or running_mean is None or running_var is None:
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, 0.0, eps)
    out = F.batch_norm(input, running_mean.clone(), running_var.clone(), weight, bias, training, 0.0, eps)
    with torch.no_grad():
        affine = [None if t is None else t.detach() for t in (weight, bias)]
        mean, var = batch_norm_stats(input.detach(), *affine, running_mean, running_var, momentum, eps)
        running_mean.copy_(mean)
        running_var.copy_(var)
    return out
