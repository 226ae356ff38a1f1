"""Traceable update rules for the ``torch.optim`` classes zgraph lifts hyper-parameters for.

``torch.optim`` reads its hyper-parameters as Python floats, so tracing ``opt.step()`` as written would bake
``lr``, ``betas``, ``weight_decay``... into the graph as constants. For the classes registered here zgraph
runs a kernel that follows ``torch.optim``'s single-tensor algorithm op for op, but reads every numeric
hyper-parameter from a 0-d float64 tensor that is a graph input. Scalar arithmetic on hyper-parameters is done
in float64 (what Python floats are) and handed to the same aten ops eager uses, so on one process the result
matches eager bit for bit where the kernels agree, and an LR scheduler or a changed ``param_groups`` value
takes effect without a retrace. Python branches on hyper-parameters (``weight_decay != 0``, ``amsgrad``...)
become part of the guard key: flipping one retraces.

Other ``torch.optim`` classes are traced as written, their numeric hyper-parameters graph inputs too
(``zgraph.capture.as_written``); classes torch.optim does not define run their own ``step()`` with their
hyper-parameters as constants of the graph, guarded by value (a change retraces).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.fx import traceback as fx_traceback
from torch.optim.optimizer import _get_scalar_dtype

from zgraph.host_ops import EXACT

# A group's numeric hyper-parameters, lifted to graph inputs: name -> 0-d float64 tensor.
HyperParams = dict[str, Tensor]


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _update_each(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    state_dtype: torch.dtype | None,
    opmath: bool,
    update_one: Callable[[Tensor, Tensor, dict], None],
) -> None:
    """``update_one(param, grad, state)`` for every parameter. With ``opmath`` (see ``OptimizerKernel.update``),
    where the parameter, its gradient or a state tensor is 16-bit, the update runs on float32 copies and is
    rounded once into the stored tensors (the "opmath" of PyTorch's fused optimizers). Otherwise it runs in
    place on the stored tensors, op for op as ``torch.optim``'s single-tensor algorithm (a bf16 model's update
    in bf16, as eager PyTorch computes it). State the update creates is stored in ``state_dtype`` (None: the
    parameter's dtype)."""
    for param, grad, state in zip(params, grads, states):
        stored = [param, grad, *(v for v in state.values() if isinstance(v, Tensor) and v.dim() > 0)]
        if not opmath or (state_dtype not in _LOW_PRECISION and not any(t.dtype in _LOW_PRECISION for t in stored)):
            update_one(param, grad, state)
            continue
        work_param = param.float()
        work = {k: v.float() if isinstance(v, Tensor) and v.dtype in _LOW_PRECISION else v for k, v in state.items()}
        update_one(work_param, grad.float(), work)
        if work_param is not param:
            param.copy_(work_param)
        for key, value in work.items():
            if key not in state:
                state[key] = value.to(state_dtype or param.dtype) if isinstance(value, Tensor) else value
            elif value is not state[key]:
                state[key].copy_(value)


def _scalar(t: Tensor) -> float:
    """A 0-d tensor as a Python scalar argument (``alpha=``, ``value=``); traced as a graph scalar."""
    return t.item()


class _GroupScalars:
    """The graph scalars of one parameter group's hyper-parameters, each read (``item()``) once for the whole
    group, on first use: every ``item()`` is a node and a symbol of its own in the traced graph. ``tensor``: a
    0-d tensor computed from hyper-parameters alone, traced once for the group (the same ops, on the same
    values, for every parameter: what ``cse`` would merge, at a trace's cost per op)."""

    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self._tensors: dict[str, Tensor] = {}

    def get(self, name: str, make: Callable[[], Tensor]) -> float:
        if name not in self._values:
            self._values[name] = _scalar(make())
        return self._values[name]

    def tensor(self, name: str, make: Callable[[], Tensor]) -> Tensor:
        if name not in self._tensors:
            self._tensors[name] = make()
        return self._tensors[name]


def _lerp_(t: Tensor, end: Tensor, weight: Tensor) -> None:
    """``t.lerp_(end, weight)`` with ``weight`` a 0-d float64 graph input, as eager's ``lerp_`` with a Python
    float: a tensor weight (a scalar one from ``item()`` makes inductor branch on its value), and for a 16-bit
    ``t`` the arithmetic in float32 rounded once, which is what eager's kernel does with a scalar weight."""
    if t.dtype not in _LOW_PRECISION:
        t.lerp_(end, weight.to(t.dtype))
    else:
        t.copy_(t.float().lerp_(end.float(), weight.to(torch.float32)))


@dataclass(frozen=True)
class OptimizerKernel:
    """How zgraph traces one ``torch.optim`` class.

    Attributes:
        name: the optimizer's class name, for messages.
        hyperparameters: ``fn(group) -> {name: float}``, the numeric values lifted to graph inputs.
        structure: ``fn(group) -> tuple``, the Python branches the update takes; part of the guard key.
        initial_state: ``fn(param, group, state_dtype) -> dict``, the state ``torch.optim`` creates on a
            parameter's first step (tensors of the parameter's shape in ``state_dtype``, None: the parameter's
            dtype); None where that state depends on the gradient (it is then created inside the graph).
        update: ``fn(params, grads, states, hp, group, state_dtype, opmath)``: the in-place update of params
            with grads; state it creates is stored in ``state_dtype`` (None: the parameter's dtype). ``opmath``:
            16-bit tensors are updated through float32 copies, rounded once (a configured low-precision recipe,
            or a ``fused=True`` optimizer, whose kernels do the same); without it the arithmetic is eager's.
    """

    name: str
    hyperparameters: Callable[[dict], dict[str, float]]
    structure: Callable[[dict], tuple]
    initial_state: Callable[[Tensor, dict, torch.dtype | None], dict[str, Tensor]] | None
    update: Callable[[list[Tensor], list[Tensor], list[dict], HyperParams, dict, torch.dtype | None, bool], None]


# ----------------------------------------------------------------------------------------------------- SGD
def _sgd_hp(group: dict) -> dict[str, float]:
    return {k: float(group[k]) for k in ("lr", "momentum", "dampening", "weight_decay")}


def _sgd_structure(group: dict) -> tuple:
    return (
        float(group["momentum"]) != 0,
        float(group["weight_decay"]) != 0,
        bool(group["nesterov"]),
        bool(group["maximize"]),
        bool(group.get("fused")),
    )


def _sgd_update(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    hp: HyperParams,
    group: dict,
    state_dtype: torch.dtype | None = None,
    opmath: bool = False,
) -> None:
    momentum_on, decay_on, nesterov, maximize, _ = _sgd_structure(group)
    scalars = _GroupScalars()

    def update(param: Tensor, grad: Tensor, state: dict) -> None:
        grad = grad if not maximize else -grad
        if decay_on:
            grad = grad.add(param, alpha=scalars.get("weight_decay", lambda: hp["weight_decay"]))
        if momentum_on:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = torch.clone(grad).detach()
                state["momentum_buffer"] = buf
            else:
                buf.mul_(hp["momentum"]).add_(grad, alpha=scalars.get("1-dampening", lambda: 1 - hp["dampening"]))
            grad = grad.add(buf, alpha=scalars.get("momentum", lambda: hp["momentum"])) if nesterov else buf
        param.add_(grad, alpha=scalars.get("-lr", lambda: -hp["lr"]))

    _update_each(params, grads, states, state_dtype, opmath, update)


SGD = OptimizerKernel("SGD", _sgd_hp, _sgd_structure, None, _sgd_update)


# ---------------------------------------------------------------------------------------------- Adam / AdamW
def _adam_hp(group: dict) -> dict[str, float]:
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
    }


def _adam_structure(group: dict) -> tuple:
    return (
        float(group["weight_decay"]) != 0,
        bool(group.get("decoupled_weight_decay", False)),
        bool(group["amsgrad"]),
        bool(group["maximize"]),
        bool(group.get("fused")),
    )


def _adam_initial_state(param: Tensor, group: dict, state_dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    dtype = state_dtype or param.dtype
    state = {
        "step": torch.tensor(0.0, dtype=_get_scalar_dtype()),
        "exp_avg": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
    }
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
    return state


def _adam_update(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    hp: HyperParams,
    group: dict,
    state_dtype: torch.dtype | None = None,
    opmath: bool = False,
) -> None:
    decay_on, decoupled, amsgrad, maximize, _ = _adam_structure(group)
    if group.get("fused") is False:  # the for-loop step asked for: never replaced by the fused kernel on the host
        with fx_traceback.annotate({EXACT: True}):
            return _adam_update(params, grads, states, hp, {**group, "fused": None}, state_dtype, opmath)
    lr, beta1, beta2, eps, weight_decay = hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"]
    scalars = _GroupScalars()

    def update(param: Tensor, grad: Tensor, state: dict) -> None:
        grad = grad if not maximize else -grad
        exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
        step_t += 1
        if decay_on:
            if decoupled:
                param.mul_(scalars.tensor("1-lr*weight_decay", lambda: 1 - lr * weight_decay))
            else:
                grad = grad.add(param, alpha=scalars.get("weight_decay", lambda: weight_decay))
        _lerp_(exp_avg, grad, scalars.tensor("1-beta1", lambda: 1 - beta1))
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=scalars.get("1-beta2", lambda: 1 - beta2))
        step = step_t.to(torch.float64)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        if amsgrad:
            max_exp_avg_sq = state["max_exp_avg_sq"]
            max_exp_avg_sq.copy_(torch.maximum(max_exp_avg_sq, exp_avg_sq))
            denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=_scalar(-step_size))

    _update_each(params, grads, states, state_dtype, opmath, update)


def _adam_kernel(name: str) -> OptimizerKernel:
    return OptimizerKernel(name, _adam_hp, _adam_structure, _adam_initial_state, _adam_update)


ADAM = _adam_kernel("Adam")
ADAMW = _adam_kernel("AdamW")

KERNELS: dict[type, OptimizerKernel] = {
    torch.optim.SGD: SGD,
    torch.optim.Adam: ADAM,
    torch.optim.AdamW: ADAMW,
}


def kernel_for(optimizer: torch.optim.Optimizer) -> OptimizerKernel | None:
    """The registered kernel for ``optimizer``'s exact class (subclasses may change ``step``: not matched)."""
    return KERNELS.get(type(optimizer))
