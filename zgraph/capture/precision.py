"""What capture does for mixed precision, loss scaling and clipping while it traces the step.

- **Compute dtype** (``Config.param_dtype``): while the step runs (not inside the optimizer), every torch call
  that reads a parameter (but those ``Config.keep_fp32_modules`` keeps) reads it cast to the compute dtype,
  through one differentiable cast per parameter and forward/backward round. Autograd then differentiates
  through the cast, so gradients arrive at the (master) parameters in their dtype — what FSDP2's
  ``MixedPrecisionPolicy`` gives. ``model.parameters()``, ``.grad`` and the optimizer see the master
  parameters. The backward runs under the same rule (``active_in_engine``): activation checkpointing's
  recomputation reads parameters as the forward did.
- **Loss scaling** (``Config.loss_scale``): every backward call (``backward()``, ``autograd.backward``,
  ``autograd.grad``) seeds autograd with the scaled gradient (computed in float32, as DeepSpeed scales
  ``loss.float()``); each parameter's gradient contribution is unscaled as it arrives (kept scaled when it is
  fp16: it is unscaled in float32 inside the optimizer), and gradients ``autograd.grad`` returns for other
  tensors are unscaled, so the step's own code sees true gradients. Each optimizer step checks its gradients
  for inf/nan (``zgraph::nonfinite``, made global over ranks by the ``loss_scale`` pass) and, when one is found,
  leaves parameters and optimizer state as they were. The scale is updated once per step.
- **Gradient norms**: ``torch.linalg.vector_norm`` of a parameter's gradient (what ``clip_grad_norm_`` computes)
  is recorded as ``zgraph::grad_norm``, which the ``clip_grad`` pass computes from gradient shards.
  ``Config.max_grad_norm`` clips each optimizer's gradients before its update, as ``clip_grad_norm_`` would.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import traceback as fx_traceback
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from zgraph.config import Config, DynamicLossScale
from zgraph.graph import BACKWARD, PHASE
from zgraph.ops import flag_to_host, grad_norm, nonfinite
from zgraph.runtime.state import Binding

BACKWARD_CALLS = (Tensor.backward, torch.autograd.backward, torch.autograd.grad)


def initial_loss_scale_state(config: Config, device: torch.device | None = None) -> dict[str, Tensor]:
    """The loss-scale state a step starts from, on ``device`` (the training state's: the graph computes the
    state's next value there and returns it there)."""
    policy = config.loss_scale
    if policy is None:
        return {}
    if isinstance(policy, DynamicLossScale):
        return {
            "scale": torch.tensor(policy.init_scale, dtype=torch.float32, device=device),
            "good_steps": torch.tensor(0, dtype=torch.int64, device=device),
            "hysteresis": torch.tensor(policy.hysteresis, dtype=torch.int64, device=device),
        }
    return {"scale": torch.tensor(float(policy), dtype=torch.float32, device=device)}


@dataclass
class TracePrecision:
    """Per-trace precision state (see the module docstring).

    Attributes:
        config: the step's config.
        params: traced parameter leaves by ``id`` (those cast to the compute dtype, and whose gradients are
            unscaled on arrival).
        loss_state: the traced loss-scale state (``scale``, and for dynamic scaling ``good_steps``,
            ``hysteresis``), empty without loss scaling.
        own_dtype: ``id`` of the traced parameters read in their own dtype (``Config.keep_fp32_modules``).
    """

    config: Config
    params: dict[int, Tensor]
    loss_state: dict[str, Tensor] = field(default_factory=dict)
    own_dtype: set[int] = field(default_factory=set)
    in_optimizer: bool = False
    overflow_flags: list[Tensor] = field(default_factory=list)
    _casts: dict[int, Tensor] = field(default_factory=dict)

    # ------------------------------------------------------------------------------------- compute dtype
    def compute_view(self, value: Any) -> Any:
        """A parameter as the step's code should see it: cast to the compute dtype (cached per round)."""
        dtype = self.config.param_dtype
        if dtype is None or self.in_optimizer or not isinstance(value, Tensor):
            return value
        param = self.params.get(id(value))
        if param is None or not param.is_floating_point() or param.dtype == dtype or id(param) in self.own_dtype:
            return value
        cast = self._casts.get(id(param))
        if cast is None or (torch.is_grad_enabled() and param.requires_grad and not cast.requires_grad):
            # a cast made under no_grad (a reentrant checkpoint's first forward) carries no gradient: make one that
            # does where the parameter is read with grad enabled (the checkpoint's recomputation)
            cast = self._casts[id(param)] = param.to(dtype)
        return cast

    def end_round(self) -> None:
        """A backward call finished: the next forward casts afresh (so a gathered parameter is not kept
        alive from one forward/backward round to the next)."""
        self._casts.clear()

    # ---------------------------------------------------------------------------------------- loss scale
    @property
    def scaling(self) -> bool:
        return bool(self.loss_state)

    @property
    def grads_stay_scaled(self) -> bool:
        """fp16 gradients are stored scaled (unscaling them in fp16 would flush small ones to zero)."""
        return self.config.master_dtype == torch.float16

    def scale_seed(self, output: Tensor, gradient: Tensor | None) -> tuple[Tensor, Tensor]:
        """``(output, gradient)`` for autograd with the loss scale applied, in float32."""
        scale = self.loss_state["scale"]
        if gradient is None:  # ones times the scale: the seed of a loss (``zgraph.passes.micro_batch_loss``)
            return output.float(), torch.ones_like(output, dtype=torch.float32) * scale
        return output.float(), gradient.float() * scale

    def unscale_contribution(self, grad: Tensor) -> Tensor:
        if not self.scaling or (self.grads_stay_scaled and grad.dtype == torch.float16):
            return grad
        return grad * (1.0 / self.loss_state["scale"]).to(grad.dtype)

    def unscale_returned(self, grad: Tensor | None) -> Tensor | None:
        if grad is None or not self.scaling:
            return grad
        return grad * (1.0 / self.loss_state["scale"]).to(grad.dtype)

    # ------------------------------------------------------------------------------------------ optimizer
    def prepare_update(self, params: list[Tensor]) -> tuple[list[Tensor], Tensor | None]:
        """The gradients the update should use (unscaled, clipped) and the overflow flag (None: no scaling)."""
        grads = [p.grad for p in params]
        if self.scaling and self.grads_stay_scaled:
            inverse = 1.0 / self.loss_state["scale"]
            grads = [g.float() * inverse for g in grads]
        flag = None
        if self.scaling:
            flag = nonfinite(grads)
            self.overflow_flags.append(flag)
        if self.config.max_grad_norm is not None and grads:
            if grads[0] is params[0].grad:
                torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
                grads = [p.grad for p in params]
            else:
                total = torch.nn.utils.get_total_norm(grads, 2.0)
                coefficient = torch.clamp(self.config.max_grad_norm / (total + 1e-6), max=1.0)
                grads = [g * coefficient.to(g.dtype) for g in grads]
        return grads, flag

    def finish_step(self, all_grads: list[Tensor]) -> dict[str, Tensor]:
        """The loss-scale state after this step (updated once, from every optimizer step's overflow flag)."""
        if not self.scaling:
            return {}
        flags = self.overflow_flags or ([nonfinite(all_grads)] if all_grads else [])
        state = dict(self.loss_state)
        policy = self.config.loss_scale
        if not flags or not isinstance(policy, DynamicLossScale):
            return state
        overflow = torch.stack(flags).any()
        scale, good, hysteresis = state["scale"], state["good_steps"], state["hysteresis"]
        backed_off = torch.clamp(scale * policy.backoff_factor, min=policy.min_scale)
        on_overflow_scale = torch.where(hysteresis <= 1, backed_off, scale)
        on_overflow_hysteresis = torch.where(hysteresis <= 1, hysteresis, hysteresis - 1)
        grown_good = good + 1
        grow = grown_good % policy.growth_interval == 0
        on_success_scale = torch.where(grow, scale * policy.growth_factor, scale)
        on_success_hysteresis = torch.where(grow, torch.full_like(hysteresis, policy.hysteresis), hysteresis)
        return {
            "scale": torch.where(overflow, on_overflow_scale, on_success_scale),
            "good_steps": torch.where(overflow, torch.zeros_like(good), grown_good),
            "hysteresis": torch.where(overflow, on_overflow_hysteresis, on_success_hysteresis),
        }


def kept_in_own_dtype(binding: Binding, classes: tuple[type[nn.Module], ...]) -> set[int]:
    """Indices of the bound parameters ``Config.keep_fp32_modules`` keeps in their own dtype: those every module
    holding them is an instance of one of ``classes`` or lies inside one."""
    inside = {
        id(sub)
        for _, root in binding.modules
        for module in root.modules()
        if isinstance(module, classes)
        for sub in module.modules()
    }
    return {r.index for r in binding.params if r.slots and all(id(module) in inside for module, _ in r.slots)}


def keep_if_overflow(flag: Tensor | None, tensors: list[Tensor], before: list[Tensor]) -> None:
    """Put back each tensor's value from before the update where ``flag`` (an overflow) is set. Host tensors
    (torch.optim's ``step`` counters beside device state) read one host copy of the flag (``flag_to_host``)."""
    if flag is None:
        return
    on_host = None
    for tensor, old in zip(tensors, before):
        here = flag
        if tensor.device != flag.device and tensor.device.type == "cpu":
            on_host = here = on_host if on_host is not None else flag_to_host(flag)
        tensor.copy_(torch.where(here, old, tensor))


_ONE_DTYPE_NORMS = (torch.nn.functional.layer_norm, torch.nn.functional.group_norm)
"""Norms whose CUDA kernels take the input and the weight (third argument, or ``weight=``) in one dtype only."""


def _wide_weight_off_cpu(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The weight's dtype where a norm gets a 16-bit input off the CPU with a weight kept wider
    (``Config.keep_fp32_modules``), else None. The CPU kernels take that mix, compute in float32 and return the
    input's dtype; CUDA's refuse it (``expected scalar type BFloat16 but found Float``), so there the norm runs on
    the input cast up, its output cast back: the same arithmetic in two steps."""
    x = args[0] if args else None
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    mixed = (
        isinstance(x, Tensor)
        and isinstance(weight, Tensor)
        and x.device.type != "cpu"
        and x.is_floating_point()
        and weight.dtype.itemsize > x.dtype.itemsize
    )
    return weight.dtype if mixed else None


class StepMode(TorchFunctionMode):
    """Torch-function hooks active while the step is traced: backward calls are tagged ``backward`` and
    loss-scaled; parameters are read in the compute dtype; norms of gradients become ``zgraph::grad_norm``."""

    def __init__(self, precision: TracePrecision, is_grad: Callable[[Tensor], bool]):
        super().__init__()
        self.precision = precision
        self.is_grad = is_grad
        self.in_backward = False

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        precision = self.precision
        if func in BACKWARD_CALLS:
            # A backward called from inside a backward (a reentrant checkpoint's) is autograd's business: its
            # seeds are already scaled gradients, and the round ends with the outer call.
            if self.in_backward:
                return func(*args, **kwargs)
            self.in_backward = True
            try:
                with fx_traceback.annotate({PHASE: BACKWARD}), active_in_engine(self):
                    result = self._backward(func, args, kwargs)
            finally:
                self.in_backward = False
            precision.end_round()
            return result
        norms = self._grad_norms(func, args, kwargs)
        if norms is not None:
            return norms
        name = getattr(func, "__name__", "")
        if precision.config.param_dtype is not None and name not in ("__get__", "__set__") and not name.endswith("_"):
            args, kwargs = tree_map(precision.compute_view, (args, kwargs))
            wide = _wide_weight_off_cpu(args, kwargs) if func in _ONE_DTYPE_NORMS else None
            if wide is not None:
                return func(args[0].to(wide), *args[1:], **kwargs).to(args[0].dtype)
        return func(*args, **kwargs)

    def _grad_norms(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``zgraph::grad_norm`` for a whole-tensor norm of parameter gradients; None for anything else."""
        if func is torch.linalg.vector_norm:  # vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None)
            bound = dict(zip(("x", "ord", "dim", "keepdim"), args))
            bound.update(kwargs)
            x = bound.get("x", bound.get("input"))
            plain = bound.get("dim") is None and not bound.get("keepdim") and bound.get("dtype") is None
            if isinstance(x, Tensor) and plain and self.is_grad(x):
                return grad_norm(x, float(bound.get("ord", 2)))
        elif func is torch._foreach_norm:
            tensors = args[0] if args else kwargs["self"]
            order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
            dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
            if dtype is None and tensors and all(self.is_grad(t) for t in tensors):
                return [grad_norm(t, float(order)) for t in tensors]
        return None

    def _backward(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        precision = self.precision
        if not precision.scaling:
            return func(*args, **kwargs)
        bound = _bind(func, args, kwargs)
        if func is Tensor.backward:
            out, grad = precision.scale_seed(bound["self"], bound["gradient"])
            options = {k: bound[k] for k in ("retain_graph", "create_graph", "inputs")}
            return torch.autograd.backward([out], [grad], **options)
        outputs_key, grads_key = (
            ("outputs", "grad_outputs") if func is torch.autograd.grad else ("tensors", "grad_tensors")
        )
        outputs = bound[outputs_key]
        outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
        grads = bound[grads_key]
        grads = [None] * len(outputs) if grads is None else ([grads] if isinstance(grads, Tensor) else list(grads))
        seeds = [precision.scale_seed(o, g) for o, g in zip(outputs, grads)]
        bound[outputs_key] = [s[0] for s in seeds]
        bound[grads_key] = [s[1] for s in seeds]
        result = func(**bound)
        if func is not torch.autograd.grad:
            return result
        inputs = bound["inputs"]
        inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
        return tuple(r if id(i) in precision.params else precision.unscale_returned(r) for i, r in zip(inputs, result))


@contextlib.contextmanager
def active_in_engine(mode: TorchFunctionMode) -> Iterator[None]:
    """Run autograd's engine with ``mode`` active, so Python code that runs inside a backward (activation
    checkpointing's recomputation, custom autograd functions' ``backward``) reads parameters in the compute dtype
    as forward did.

    A torch-function mode is popped while it handles a call, and a backward call only reaches the engine once no
    mode is active (each re-checks for modes on entry), so the engine would start without it and, since it runs
    every node under the thread-local state captured when it starts, nothing in the backward would see it. The
    one point after the check and before the engine captures that state is ``torch.autograd``'s call of
    ``_engine_run_backward`` (shared by ``Tensor.backward``, ``autograd.backward`` and ``autograd.grad``): it
    is wrapped, while this call lasts, to start the engine with ``mode`` pushed."""
    engine_run = torch.autograd._engine_run_backward

    def run_with_mode(*args: Any, **kwargs: Any) -> Any:
        with mode:
            return engine_run(*args, **kwargs)

    torch.autograd._engine_run_backward = run_with_mode
    try:
        yield
    finally:
        torch.autograd._engine_run_backward = engine_run


def _bind(func: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``func``'s arguments by name, defaults filled in."""
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)
