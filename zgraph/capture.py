"""Capture a whole training step — forward, every backward call, the optimizer — into one functional aten graph.

How:

1. The step runs once under ``make_fx`` on fake tensors. Every parameter, buffer, ``.grad`` present on entry,
   optimizer state tensor, numeric optimizer hyper-parameter (0-d float64) and tensor argument is a graph
   input; the traced tensors are swapped into the modules and optimizers for the duration of the trace, so
   the user's code runs unchanged. Autograd runs for real during the trace, so ``loss.backward()``,
   ``out.backward(gradient=g)``, several backward calls, ``torch.autograd.grad`` all become explicit aten ops.
   Every gradient autograd produces for a parameter passes through ``zgraph::grad_contribution`` (see
   ``zgraph.ops``). Registered optimizers (``zgraph.optimizers``) run a kernel that reads hyper-parameters
   from graph inputs; other optimizers run their own ``step()``.
2. The traced graph (which still mutates its inputs in place) is traced again through
   ``torch.func.functionalize``: the result is functional. Every piece of state the step changed is a graph
   output: the new value of a parameter, buffer, optimizer state tensor, mutated tensor argument, and the
   ``.grad`` left on each parameter. State the step did not change is not an output.

What later code may rely on (the captured graph's contract; meta keys from ``zgraph.graph``):

- placeholders carry ``node.meta[INPUT]`` (a ``GraphInput``) and readable names;
- the output node carries ``node.meta[OUTPUTS]``, one ``GraphOutput`` per returned value;
- every op node carries ``node.meta[PHASE]``: ``"forward"``, ``"backward"`` or ``"optimizer"`` (how it is
  decided: ``_tag_phases``);
- the graph is functional: no op mutates its inputs (``copy_`` into inputs has been turned into outputs).
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.fx import traceback as fx_traceback
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.optim.lr_scheduler import LRScheduler

from zgraph import optimizers as zopt
from zgraph.errors import CaptureError
from zgraph.graph import (
    BACKWARD,
    CUSTOM,
    FORWARD,
    INPUT,
    OPTIMIZER,
    OUTPUTS,
    PHASE,
    GraphInput,
    GraphOutput,
    output_node,
    state_key,
)
from zgraph.ops import grad_contribution
from zgraph.precision import StepMode, TracePrecision, keep_if_overflow
from zgraph.random_layout import match_random_layout
from zgraph.runtime.state import Binding
from zgraph.traced_collectives import functional_c10d, untraceable_collective
from zgraph.tree import map_leaves

aten = torch.ops.aten


_TORCH_DIR = os.path.dirname(torch.__file__)
_ZGRAPH_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__))
    for m in (__import__("zgraph"), __import__("zgraph.passes"), __import__("zgraph.runtime"))
)


@dataclass
class CapturedGraph:
    """The captured step and what is needed to run it again.

    Attributes:
        gm: the functional graph (see the module docstring for its contract).
        result_template: the step's return value with each graph-returned leaf replaced by ``_Returned(i)``.
        none_grads: parameter indices whose ``.grad`` is None after the step.
        none_input_grads: argument-leaf indices whose ``.grad`` is None after the step.
        constant_state: non-tensor optimizer state the step sets: ``(optimizer, param, key, value)``.
        training_flags: ``(module, training)`` to restore where the step called ``train()``/``eval()``.
        created_state: ``(optimizer, param)`` pairs whose state the step created (first optimizer step).
        optimizers_stepped: indices of optimizers whose ``step()`` the step called.
        scheduler_steps: LR schedulers whose ``step()`` the step called, in call order, each as
            ``(scheduler, before_update)``: they run eagerly around the graph on every call (``before_update``:
            before the graph, so its optimizer update reads the new values, as in eager; else after it).
        python_results: ``(path, value)`` of the Python numbers in the step's return value: computed once, while
            capturing, and returned unchanged by every call.
    """

    gm: fx.GraphModule
    result_template: Any
    none_grads: list[int] = field(default_factory=list)
    none_input_grads: list[int] = field(default_factory=list)
    constant_state: list[tuple[int, int, str, Any]] = field(default_factory=list)
    training_flags: list[tuple[nn.Module, bool]] = field(default_factory=list)
    created_state: list[tuple[int, int]] = field(default_factory=list)
    optimizers_stepped: list[int] = field(default_factory=list)
    scheduler_steps: list[tuple[LRScheduler, bool]] = field(default_factory=list)
    python_results: list[tuple[str, Any]] = field(default_factory=list)


class _Returned:
    """Stands for the ``position``-th graph-returned leaf in a result template (deliberately not a dataclass:
    templates are walked by ``zgraph.tree``, which would look inside one)."""

    __slots__ = ("position",)

    def __init__(self, position: int):
        self.position = position


# --------------------------------------------------------------------------------------------- trace helpers
def _batch_norm_with_honest_schema(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    # aten.native_batch_norm updates running stats in place without declaring it in its schema, so
    # functionalization would drop the update. The _legit variants declare it and run the same CPU/CUDA kernels.
    if running_mean is None or running_var is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    if training:
        return aten._native_batch_norm_legit.default(
            input, weight, bias, running_mean, running_var, training, momentum, eps
        )
    return aten._native_batch_norm_legit_no_training.default(
        input, weight, bias, running_mean, running_var, momentum, eps
    )


def _random_from_to(self: Tensor, low: int, high: int | None = None, *, generator: Any = None) -> Tensor:
    # FX cannot print `aten.random_.from` (`from` is a Python keyword). The CPU and CUDA kernels draw
    # `low + (random % (high - low))`: drawing in [0, high - low) and adding `low` gives the same numbers.
    if high is None:
        raise CaptureError("Tensor.random_(from) without `to` is not supported inside a zgraph step")
    return aten.random_.to(self, high - low, generator=generator).add_(low)


_TRACE_DECOMPOSITIONS = {
    aten.native_batch_norm.default: _batch_norm_with_honest_schema,
    getattr(aten.random_, "from"): _random_from_to,
}


def _user_frame(tb: traceback.StackSummary | list) -> traceback.FrameSummary | None:
    """The innermost frame of the user's own code (not torch, not zgraph) in a traceback."""
    found = None
    for frame in tb:
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or path.startswith(_ZGRAPH_DIRS) or frame.filename.startswith("<"):
            continue
        found = frame
    return found


def _where(exc: BaseException) -> str:
    frame = _user_frame(traceback.extract_tb(exc.__traceback__))
    if frame is None:
        return ""
    return f" at {frame.filename}:{frame.lineno} ({frame.name}): `{(frame.line or '').strip()}`"


def _raised_in_grad_scaler(exc: BaseException) -> bool:
    return any(
        frame.filename.replace(os.sep, "/").endswith("amp/grad_scaler.py")
        for frame in traceback.extract_tb(exc.__traceback__)
    )


def _data_dependent(exc: BaseException) -> str | None:
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


# ------------------------------------------------------------------------------------------- state swapping
@contextlib.contextmanager
def _swap_module_tensors(binding: Binding, params: list[Tensor], buffers: list[Tensor]) -> Iterator[None]:
    saved: list[tuple[dict, str, Any]] = []
    try:
        for record, value in zip(binding.params, params):
            for module, attr in record.slots:
                saved.append((module._parameters, attr, module._parameters[attr]))
                module._parameters[attr] = value
        for record, value in zip(binding.buffers, buffers):
            for module, attr in record.slots:
                saved.append((module._buffers, attr, module._buffers[attr]))
                module._buffers[attr] = value
        yield
    finally:
        for store, attr, original in reversed(saved):
            store[attr] = original


@contextlib.contextmanager
def _cast_forward_inputs(binding: Binding, dtype: torch.dtype) -> Iterator[None]:
    """Floating-point tensors passed to a bound model's forward are cast to the compute dtype (what FSDP2's
    ``cast_forward_inputs`` and DeepSpeed's bf16/fp16 engines do), so they meet parameters in that dtype."""

    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, Tensor) and value.is_floating_point() else value

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return map_leaves(args, lambda _p, v: cast(v)), map_leaves(kwargs, lambda _p, v: cast(v))

    handles = [root.register_forward_pre_hook(hook, with_kwargs=True) for _, root in binding.modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class UnboundState(Exception):  # noqa: N818 - a signal to the caller, not an error the user sees
    """Raised while tracing when the step reaches training state zgraph did not bind: a module whose parameters
    or buffers are real tensors (reached through a helper function, a ``functools.partial``, an object deeper
    than zgraph looks), or an optimizer stepped or zeroed that is not among the bound ones. The caller binds
    them and captures again."""

    def __init__(self, modules: list[nn.Module] = (), optimizers: list[torch.optim.Optimizer] = ()):
        super().__init__("the step uses modules or optimizers zgraph has not bound yet")
        self.modules = list(modules)
        self.optimizers = list(optimizers)


def _is_real(t: Any) -> bool:
    return isinstance(t, Tensor) and not isinstance(t, FakeTensor)


@contextlib.contextmanager
def _watch_unbound_state(binding: Binding) -> Iterator[None]:
    """Raise ``UnboundState`` as soon as the traced step calls a module that holds real (unbound) parameters or
    buffers, or steps / zeroes an optimizer that is not bound — before either can act on real tensors."""
    bound = {id(r.optimizer) for r in binding.optimizers}

    def module_called(module: nn.Module, args: Any) -> None:
        tensors = [*module._parameters.values(), *module._buffers.values()]
        if any(_is_real(t) for t in tensors):
            raise UnboundState(modules=[module])

    def optimizer_used(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        if id(opt) not in bound:
            raise UnboundState(optimizers=[opt])

    original_zero_grad = torch.optim.Optimizer.zero_grad

    def zero_grad(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        optimizer_used(opt)  # bound optimizers have their own traced zero_grad (see _swap_optimizers)
        return original_zero_grad(opt, *args, **kwargs)

    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handles = [register_module_forward_pre_hook(module_called), register_optimizer_step_pre_hook(optimizer_used)]
    torch.optim.Optimizer.zero_grad = zero_grad
    try:
        yield
    finally:
        torch.optim.Optimizer.zero_grad = original_zero_grad
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _swap_slots(swaps: list[tuple[Any, Tensor]], traced: dict[int, Tensor]) -> Iterator[None]:
    """Put the traced stand-in of each located tensor (see ``zgraph.locate``) into its slot while tracing."""
    done = []
    try:
        for slot, real in swaps:
            stand_in = traced.get(id(real))
            if stand_in is not None:
                slot.set(stand_in)
                done.append((slot, real))
        yield
    finally:
        for slot, real in reversed(done):
            slot.set(real)


@contextlib.contextmanager
def _data_assignment_as_copy(state: list[Tensor]) -> Iterator[None]:
    """``t.data = value`` on a traced piece of state (a parameter, buffer, optimizer state, argument) becomes
    ``t.copy_(value)`` without autograd: the tracer does not see a ``.data`` assignment, so the new value
    would be lost. A value of another shape or dtype cannot be expressed that way and is an error."""
    tracked = {id(t) for t in state}
    descriptor = torch._C.TensorBase.data

    def set_data(tensor: Tensor, value: Tensor) -> None:
        if id(tensor) not in tracked:
            descriptor.__set__(tensor, value)
            return
        if value.shape != tensor.shape or value.dtype != tensor.dtype:
            raise CaptureError(
                f"the step assigns `.data` of shape {tuple(value.shape)} ({value.dtype}) to a tensor of shape "
                f"{tuple(tensor.shape)} ({tensor.dtype}); zgraph can only trace a `.data` assignment that keeps "
                "shape and dtype (it becomes an in-place copy)"
            )
        with torch.no_grad():
            tensor.copy_(value)

    torch.Tensor.data = property(descriptor.__get__, set_data)
    try:
        yield
    finally:
        del torch.Tensor.data


def real_constants(gm: fx.GraphModule) -> list[Tensor]:
    """The real (not fake) tensors a trace froze into ``gm`` as constants: tensors the step read from places
    zgraph did not swap traced stand-ins into."""
    out, seen = [], set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if _is_real(value) and id(value) not in seen:
                seen.add(id(value))
                out.append(value)
    return out


@contextlib.contextmanager
def _autocast_forwards(binding: Binding, dtype: torch.dtype) -> Iterator[None]:
    """Each bound model's forward runs under ``torch.autocast(dtype)`` (``Config.autocast_dtype``), as DeepSpeed's
    engine runs its forward with the ``torch_autocast`` section; code outside the forward (the loss) does not."""
    device = binding.params[0].tensor.device.type if binding.params else "cpu"
    entered: list[contextlib.AbstractContextManager] = []

    def enter(module: nn.Module, args: Any) -> None:
        region = torch.autocast(device, dtype=dtype)
        region.__enter__()
        entered.append(region)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        entered.pop().__exit__(None, None, None)

    handles = []
    for _, root in binding.modules:
        handles.append(root.register_forward_pre_hook(enter))
        handles.append(root.register_forward_hook(leave))
    try:
        yield
    finally:
        while entered:  # a forward that raised
            entered.pop().__exit__(None, None, None)
        for handle in handles:
            handle.remove()


_INSTANCE_MISSING = object()


@dataclass
class _Trace:
    """What one trace of the step works with: the traced parameters, optimizer state and hyper-parameters,
    precision handling, and what the optimizers did."""

    binding: Binding
    config: Any
    params: list[Tensor]
    states: dict[tuple[int, int], dict[str, Any]]
    hparams: dict[tuple[int, int], dict[str, Tensor]]
    precision: TracePrecision
    created: list[tuple[int, int]] = field(default_factory=list)
    stepped: list[int] = field(default_factory=list)
    scheduler_steps: list[tuple[LRScheduler, bool, int]] = field(default_factory=list)  # + len(stepped) then


@contextlib.contextmanager
def _swap_optimizers(trace: _Trace) -> Iterator[None]:
    saved = []
    try:
        for record in trace.binding.optimizers:
            opt = record.optimizer
            saved.append(
                (
                    opt,
                    [g["params"] for g in opt.param_groups],
                    opt.state,
                    opt.__dict__.get("step", _INSTANCE_MISSING),
                    opt.__dict__.get("zero_grad", _INSTANCE_MISSING),
                )
            )
            traced_state: defaultdict = defaultdict(dict)
            for group, indices in zip(opt.param_groups, record.group_params):
                group["params"] = [trace.params[i] for i in indices]
                for i in indices:
                    if (record.index, i) in trace.states:
                        traced_state[trace.params[i]] = trace.states[(record.index, i)]
            opt.state = traced_state
            opt.step = _traced_step(trace, record.index, opt.step)
            opt.zero_grad = _in_optimizer(trace, opt.zero_grad)
        yield
    finally:
        for opt, group_params, state, step, zero_grad in saved:
            for group, ps in zip(opt.param_groups, group_params):
                group["params"] = ps
            opt.state = state
            for attr, value in (("step", step), ("zero_grad", zero_grad)):
                if value is _INSTANCE_MISSING:
                    opt.__dict__.pop(attr, None)
                else:
                    opt.__dict__[attr] = value


def _scheduler_classes() -> list[type]:
    """``LRScheduler`` and every loaded subclass that defines its own ``step``."""
    found, todo = [], [LRScheduler]
    while todo:
        cls = todo.pop()
        if "step" in cls.__dict__:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@contextlib.contextmanager
def _record_scheduler_steps(trace: _Trace) -> Iterator[None]:
    """While tracing, an LR scheduler's ``step()`` is recorded instead of run: it changes Python numbers (the
    learning rates), not tensors, so zgraph runs it for real around the graph on every call (see
    ``CapturedGraph.scheduler_steps``); the graph reads the learning rates as inputs."""
    optimizer_index = {id(r.optimizer): r.index for r in trace.binding.optimizers}

    def record(scheduler: LRScheduler, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise CaptureError(
                f"{type(scheduler).__name__}.step() with arguments inside a zgraph step: its new learning rate "
                "would depend on values the graph computes (e.g. ReduceLROnPlateau's metric). Call it between "
                "step calls with the value the step returns."
            )
        o_index = optimizer_index.get(id(scheduler.optimizer))
        before_update = o_index is not None and o_index not in trace.stepped
        trace.scheduler_steps.append((scheduler, before_update, len(trace.stepped)))

    classes = _scheduler_classes()
    saved = [(cls, cls.__dict__["step"]) for cls in classes]
    try:
        for cls in classes:
            cls.step = record
        yield
    finally:
        for cls, step in saved:
            cls.step = step


def _scheduler_order(trace: _Trace) -> list[tuple[LRScheduler, bool]]:
    """The recorded scheduler steps, checked: a scheduler stepped between two updates of its optimizer would
    change the learning rate in the middle of the graph, which reads each learning rate once."""
    optimizer_index = {id(r.optimizer): r.index for r in trace.binding.optimizers}
    for scheduler, _, stepped_before in trace.scheduler_steps:
        o_index = optimizer_index.get(id(scheduler.optimizer))
        if o_index in trace.stepped[:stepped_before] and o_index in trace.stepped[stepped_before:]:
            raise CaptureError(
                f"{type(scheduler).__name__}.step() runs between two step() calls of its optimizer inside one "
                "zgraph step; zgraph reads each learning rate once per call. Step the scheduler before the first "
                "or after the last optimizer step."
            )
    return [(scheduler, before) for scheduler, before, _ in trace.scheduler_steps]


@contextlib.contextmanager
def _optimizer_phase(trace: _Trace) -> Iterator[None]:
    trace.precision.in_optimizer = True
    try:
        with fx_traceback.annotate({PHASE: OPTIMIZER}), torch.no_grad():
            yield
    finally:
        trace.precision.in_optimizer = False


def _in_optimizer(trace: _Trace, fn: Callable) -> Callable:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _optimizer_phase(trace):
            return fn(*args, **kwargs)

    return wrapped


def _untraceable(opt: torch.optim.Optimizer, exc: Exception) -> CaptureError:
    return CaptureError(
        f"zgraph cannot trace the optimizer {type(opt).__module__}.{type(opt).__qualname__}: "
        f"its step() failed under the tracer ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        f"{_where(exc)}. zgraph traces torch.optim.SGD, Adam and AdamW with hyper-parameters as "
        "graph inputs, and other optimizers whose step() is plain tensor code."
    )


def _traced_step(trace: _Trace, o_index: int, original_step: Callable) -> Callable:
    """``optimizer.step`` while the step is traced: zgraph's kernel for registered classes (hyper-parameters
    from graph inputs), the optimizer's own ``step()`` otherwise; with loss-scale overflow skipping and
    ``max_grad_norm`` clipping around it."""
    record = trace.binding.optimizers[o_index]
    opt = record.optimizer
    kernel = zopt.kernel_for(opt)
    params = trace.params
    precision = trace.precision
    state_dtype = trace.config.optimizer_state_dtype

    def step(closure: Callable | None = None) -> None:
        if closure is not None:
            raise CaptureError(
                f"{type(opt).__name__}.step(closure) is not supported inside a zgraph step: the closure "
                "re-evaluates the model, which zgraph cannot trace. Call step() without a closure."
            )
        trace.stepped.append(o_index)
        groups = [[i for i in indices if params[i].grad is not None] for indices in record.group_params]
        flat = [i for group in groups for i in group]
        for i in flat:
            if params[i].grad.is_sparse:
                raise CaptureError(f"{type(opt).__name__}: sparse gradients are not supported by zgraph")
        with _optimizer_phase(trace):
            grads, overflow = precision.prepare_update([params[i] for i in flat])
            grad_of = {i: g for i, g in zip(flat, grads)}
            if kernel is None:
                if precision.grads_stay_scaled:
                    raise CaptureError(
                        f"fp16 master gradients with loss scaling need an optimizer zgraph has a kernel for "
                        f"(SGD, Adam, AdamW), not {type(opt).__name__}"
                    )
                before = {id(params[i]): len(opt.state.get(params[i], {})) for i in flat}
                tensors = [params[i] for i in flat] + [
                    v for i in flat for v in opt.state.get(params[i], {}).values() if isinstance(v, Tensor)
                ]
                previous = [t.clone() for t in tensors] if overflow is not None else []
                try:
                    original_step()
                except (CaptureError, UnboundState):
                    raise
                except Exception as exc:
                    raise _untraceable(opt, exc) from exc
                keep_if_overflow(overflow, tensors, previous)
                new_state = [i for i in flat if before[id(params[i])] == 0 and opt.state.get(params[i])]
                trace.created.extend((o_index, i) for i in new_state)
                return
            for g_index, (group, indices) in enumerate(zip(opt.param_groups, groups)):
                states = []
                for i in indices:
                    state = opt.state[params[i]]
                    if not state and kernel.initial_state is not None:
                        state.update(kernel.initial_state(params[i], group, state_dtype))
                        trace.created.append((o_index, i))
                    states.append(state)
                state_tensors = [v for st in states for v in st.values() if isinstance(v, Tensor)]
                tensors = [params[i] for i in indices] + state_tensors
                previous = [t.clone() for t in tensors] if overflow is not None else []
                kernel.update(
                    [params[i] for i in indices],
                    [grad_of[i] for i in indices],
                    states,
                    trace.hparams[(o_index, g_index)],
                    group,
                    state_dtype,
                )
                keep_if_overflow(overflow, tensors, previous)

    return step


@contextlib.contextmanager
def _restore_python_state_on_error(binding: Binding) -> Iterator[None]:
    """If capture fails, undo what the traced Python did to optimizer param groups and module train flags."""
    groups = [[dict(g) for g in r.optimizer.param_groups] for r in binding.optimizers]
    flags = [(m, m.training) for _, root in binding.modules for m in root.modules()]
    try:
        yield
    except BaseException:
        for record, saved in zip(binding.optimizers, groups):
            for group, values in zip(record.optimizer.param_groups, saved):
                group.clear()
                group.update(values)
        for module, training in flags:
            module.training = training
        raise


def _group_values(binding: Binding) -> list:
    return [
        [{k: v for k, v in g.items() if k != "params"} for g in r.optimizer.param_groups] for r in binding.optimizers
    ]


# ------------------------------------------------------------------------------------------------- capture
@dataclass
class _Inputs:
    specs: list[GraphInput]
    values: list[Tensor]  # real tensors (or fakes made from metadata) in spec order


def collect_inputs(binding: Binding, user_tensors: list[tuple[str, Tensor]]) -> _Inputs:
    """The graph inputs of a step call, in graph order, with the tensors they are read from."""
    specs: list[GraphInput] = []
    values: list[Tensor] = []

    def add(spec: GraphInput, value: Tensor) -> None:
        specs.append(spec)
        values.append(value)

    for r in binding.params:
        add(GraphInput("param", r.name, r.index), r.tensor)
    for r in binding.params:
        if r.tensor.grad is not None:
            add(GraphInput("grad", r.name, r.index), r.tensor.grad)
    for r in binding.buffers:
        value = r.get()
        if value is not None:
            add(GraphInput("buffer", r.name, r.index), value)
    for o in binding.optimizers:
        for i in sorted({i for indices in o.group_params for i in indices}):
            for key, value in binding.optimizer_state(o.index, i).items():
                if isinstance(value, Tensor):
                    name = f"{binding.params[i].name}:{key}"
                    add(GraphInput("opt_state", name, i, field=key, optimizer=o.index), value)
    for o in binding.optimizers:
        kernel = zopt.kernel_for(o.optimizer)
        if kernel is None:
            continue
        for g_index, group in enumerate(o.optimizer.param_groups):
            for hp_name, hp_value in kernel.hyperparameters(group).items():
                name = f"{o.name}.group{g_index}:{hp_name}"
                add(GraphInput("hparam", name, g_index, field=hp_name, optimizer=o.index, group=g_index), hp_value)
    for leaf_index, (path, t) in enumerate(user_tensors):
        add(GraphInput("input", path, leaf_index), t)
    for leaf_index, (path, t) in enumerate(user_tensors):
        if t.grad is not None:
            add(GraphInput("input_grad", f"{path}.grad", leaf_index), t.grad)
    for name, value in binding.loss_scale_state.items():
        add(GraphInput("loss_scale", f"loss_scale:{name}", 0, field=name), value)
    return _Inputs(specs, values)


def _fake_inputs(mode: FakeTensorMode, inputs: _Inputs) -> list[Tensor]:
    fakes = []
    for spec, value in zip(inputs.specs, inputs.values):
        if spec.kind == "hparam":
            with mode:
                fakes.append(torch.empty((), dtype=torch.float64))
            continue
        if isinstance(value, DTensor):  # sharded state: the graph is captured on the whole (logical) tensor
            with mode:
                fake = torch.empty(value.shape, dtype=value.dtype, device=value._local_tensor.device)
        else:
            fake = mode.from_tensor(value.detach(), static_shapes=True)
        if spec.kind in ("param", "input") and value.requires_grad:
            fake.requires_grad_(True)
        fakes.append(fake)
    return fakes


def capture(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    binding: Binding,
    user_tensors: list[tuple[str, Tensor]],
    substitute: Callable[[str, Any, dict[int, Tensor]], Any],
    config: Any,
    materialize_state: Callable[[CapturedGraph], bool] | None = None,
    swaps: list[tuple[Any, Tensor]] = (),
    check_constants: Callable[[list[Tensor]], None] | None = None,
) -> CapturedGraph:
    """Trace ``fn(*args, **kwargs)`` into a functional graph, with ``config``'s precision handling (compute
    dtype, loss scaling, clipping: see ``zgraph.precision``).

    ``user_tensors`` are the tensors the step reads that are not bound state: leaves of its arguments, and
    tensors located elsewhere (``zgraph.locate``); ``substitute(label, arguments, traced)`` rebuilds the
    arguments the traced step receives (``traced`` maps ``id`` of bound parameters, buffers and user tensors to
    their traced stand-ins), and ``swaps`` are ``(slot, tensor)`` pairs whose slot gets the tensor's stand-in
    while tracing. ``check_constants(tensors)`` sees the real tensors the trace froze as constants; it may
    raise (to bind them, or to refuse them). Raises ``UnboundState`` when the step reaches modules or
    optimizers that are not bound. If the step creates optimizer state (a first ``step()``) and
    ``materialize_state(captured)`` creates it for real and returns True, the step is traced again with that
    state as graph inputs.
    """
    inputs = collect_inputs(binding, user_tensors)
    for spec, value in zip(inputs.specs, inputs.values):
        if spec.kind == "hparam":
            continue
        if not isinstance(value, Tensor) or value.is_sparse:
            raise CaptureError(f"{spec.name}: only dense tensors can be graph inputs, got {type(value).__name__}")
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True, static_shapes=True)
    fakes = _fake_inputs(mode, inputs)
    result_holder: dict[str, Any] = {}
    grad_enabled = torch.is_grad_enabled()
    n_params = len(binding.params)

    def traced_step(*flat: Tensor) -> list[Any]:
        by_kind: dict[str, dict] = defaultdict(dict)
        for spec, value in zip(inputs.specs, flat):
            key = (spec.optimizer, spec.index, spec.field) if spec.kind == "opt_state" else spec.index
            if spec.kind == "hparam":
                key = (spec.optimizer, spec.group, spec.field)
            by_kind[spec.kind][key] = value
        params = [by_kind["param"][i] for i in range(n_params)]
        buffers = [by_kind["buffer"].get(r.index) for r in binding.buffers]
        for i, grad in by_kind["grad"].items():
            params[i].grad = grad
        states: dict[tuple[int, int], dict[str, Any]] = defaultdict(dict)
        for o in binding.optimizers:
            for i in {i for indices in o.group_params for i in indices}:
                for key, value in binding.optimizer_state(o.index, i).items():
                    states[(o.index, i)][key] = by_kind["opt_state"].get((o.index, i, key), value)
        hparams: dict[tuple[int, int], dict[str, Tensor]] = defaultdict(dict)
        for (o_index, g_index, name), value in by_kind["hparam"].items():
            hparams[(o_index, g_index)][name] = value
        user = [by_kind["input"][i] for i in range(len(user_tensors))]
        for i, grad in by_kind["input_grad"].items():
            user[i].grad = grad
        loss_state = {spec.field: value for spec, value in zip(inputs.specs, flat) if spec.kind == "loss_scale"}
        precision = TracePrecision(config, {id(p): p for p in params}, loss_state)
        for i, p in enumerate(params):
            if p.requires_grad:
                p.register_hook(lambda g, i=i: grad_contribution(precision.unscale_contribution(g), i))

        traced = {id(r.tensor): params[r.index] for r in binding.params}
        traced.update({id(t): user[i] for i, (_, t) in enumerate(user_tensors)})
        trace = _Trace(binding, config, params, states, hparams, precision)
        flags_before = [(m, m.training) for _, root in binding.modules for m in root.modules()]
        groups_before = _group_values(binding)

        def is_grad(t: Tensor) -> bool:
            return any(t is p.grad for p in params)

        with contextlib.ExitStack() as stack:
            stack.enter_context(_restore_python_state_on_error(binding))
            stack.enter_context(_swap_module_tensors(binding, params, buffers))
            stack.enter_context(_swap_slots(swaps, traced))
            stack.enter_context(_watch_unbound_state(binding))
            stack.enter_context(
                _data_assignment_as_copy(
                    [*params, *(b for b in buffers if b is not None), *user]
                    + [v for state in states.values() for v in state.values() if isinstance(v, Tensor)]
                )
            )
            if config.param_dtype is not None:
                stack.enter_context(_cast_forward_inputs(binding, config.param_dtype))
            if config.autocast_dtype is not None:
                stack.enter_context(_autocast_forwards(binding, config.autocast_dtype))
            stack.enter_context(_swap_optimizers(trace))
            stack.enter_context(_record_scheduler_steps(trace))
            stack.enter_context(functional_c10d())
            stack.enter_context(StepMode(precision, is_grad))
            stack.enter_context(torch.set_grad_enabled(grad_enabled))
            new_args = substitute("args", args, traced)
            new_kwargs = substitute("kwargs", kwargs, traced)
            result = fn(*new_args, **new_kwargs)
            final_buffers = [r.get() for r in binding.buffers]
            final_states = {
                (o.index, i): dict(o.optimizer.state.get(params[i], {}))
                for o in binding.optimizers
                for i in {i for indices in o.group_params for i in indices}
            }
            if _group_values(binding) != groups_before:
                raise CaptureError(
                    "the step changed optimizer param_groups values (e.g. lr) while it ran; in a zgraph step that "
                    "change would be baked into the graph as a constant. Set them before calling the step, or use an "
                    "LR scheduler (its step(), inside the step or between calls, runs eagerly around the graph): "
                    "they are graph inputs."
                )
            with torch.no_grad():
                final_loss_state = precision.finish_step([p.grad for p in params if p.grad is not None])
        flags_after = [(m, m.training) for m, _ in flags_before]
        outs: list[Any] = []
        roles: list[GraphOutput] = []
        captured = CapturedGraph(gm=None, result_template=None)  # type: ignore[arg-type]

        def returned(path: str, leaf: Any) -> Any:
            if isinstance(leaf, (Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
                outs.append(leaf)
                roles.append(GraphOutput("user", path, len(roles)))
                return _Returned(len(outs) - 1)
            if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
                captured.python_results.append((f"result{path}", leaf))
            return leaf

        captured.result_template = map_leaves(result, returned)
        for r in binding.params:
            outs.append(params[r.index])
            roles.append(GraphOutput("param", r.name, r.index))
        for r in binding.params:
            if params[r.index].grad is None:
                captured.none_grads.append(r.index)
            else:
                outs.append(params[r.index].grad)
                roles.append(GraphOutput("grad", r.name, r.index))
        for r, value in zip(binding.buffers, final_buffers):
            if value is not None:
                outs.append(value)
                roles.append(GraphOutput("buffer", r.name, r.index))
        for (o_index, i), state in final_states.items():
            for key, value in state.items():
                if isinstance(value, Tensor):
                    outs.append(value)
                    name = f"{binding.params[i].name}:{key}"
                    roles.append(GraphOutput("opt_state", name, i, field=key, optimizer=o_index))
                else:
                    captured.constant_state.append((o_index, i, key, value))
        for i, (path, _) in enumerate(user_tensors):
            outs.append(user[i])
            roles.append(GraphOutput("input", path, i))
            if user[i].requires_grad and user[i].is_leaf:
                if user[i].grad is None:
                    captured.none_input_grads.append(i)
                else:
                    outs.append(user[i].grad)
                    roles.append(GraphOutput("input_grad", f"{path}.grad", i))
        captured.training_flags = [
            (m, after) for (m, before), (_, after) in zip(flags_before, flags_after) if before != after
        ]
        for name, value in final_loss_state.items():
            outs.append(value)
            roles.append(GraphOutput("loss_scale", f"loss_scale:{name}", 0, field=name))
        captured.created_state = trace.created
        captured.optimizers_stepped = sorted(set(trace.stepped))
        captured.scheduler_steps = _scheduler_order(trace)
        result_holder["captured"] = captured
        result_holder["roles"] = roles
        return outs

    gm1 = _trace(traced_step, fakes, mode, fn)
    constants = real_constants(gm1)
    for t in constants:
        if isinstance(t.grad, FakeTensor):  # autograd reached a real leaf the trace read as a constant
            t.grad = None
    if check_constants is not None:
        check_constants(constants)
    collective = untraceable_collective(gm1)
    if collective is not None:
        raise CaptureError(
            f"the step calls a torch.distributed collective zgraph cannot trace ({collective}); inside a step "
            "use torch.distributed.all_reduce, broadcast, all_gather_into_tensor or reduce_scatter_tensor on "
            "tensors (traced as functional collectives), or torch.distributed._functional_collectives"
        )
    captured = result_holder["captured"]
    roles = result_holder["roles"]
    if captured.created_state and materialize_state is not None and materialize_state(captured):
        return capture(fn, args, kwargs, binding, user_tensors, substitute, config, None, swaps, check_constants)
    captured.gm = _functionalize(gm1, inputs, fakes, mode, roles)
    return captured


def _trace(traced_step: Callable, fakes: list[Tensor], mode: FakeTensorMode, fn: Callable) -> fx.GraphModule:
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        with fx_traceback.preserve_node_meta(), mode, _use_lazy_graph_module(True):
            return make_fx(
                traced_step,
                tracing_mode="fake",
                decomposition_table=_TRACE_DECOMPOSITIONS,
                _allow_non_fake_inputs=True,
            )(*fakes)
    except (CaptureError, UnboundState):
        raise
    except Exception as exc:
        detail = _data_dependent(exc)
        if detail is not None and _raised_in_grad_scaler(exc):
            raise CaptureError(
                f"zgraph cannot capture `{name}`: torch.amp.GradScaler decides in Python whether gradients "
                f"overflowed{_where(exc)}. zgraph does fp16 loss scaling in the graph: drop the GradScaler (call "
                'loss.backward() and opt.step() directly) and set zgraph.Config(loss_scale="dynamic"), or '
                "zgraph.DynamicLossScale(...) for GradScaler's init_scale / growth_factor / backoff_factor / "
                "growth_interval."
            ) from exc
        if detail is None:
            raise CaptureError(
                f"zgraph could not capture `{name}`: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                f"{_where(exc)}"
            ) from exc
        raise CaptureError(
            f"zgraph cannot capture `{name}`: {detail}{_where(exc)}. zgraph traces the step once and replays "
            "the graph on later calls, so Python cannot branch on tensor values inside it. Move the check "
            "outside the step, or express it with tensor ops (torch.where, masking)."
        ) from exc


def _functionalize(
    gm1: fx.GraphModule, inputs: _Inputs, fakes: list[Tensor], mode: FakeTensorMode, roles: list[GraphOutput]
) -> fx.GraphModule:
    def replay(*flat: Tensor) -> Any:
        with torch.no_grad():
            return fx.Interpreter(gm1).run(*flat)

    plain = [f.detach() for f in fakes]
    with fx_traceback.preserve_node_meta(), mode, _use_lazy_graph_module(True):
        gm = make_fx(torch.func.functionalize(replay, remove="mutations"), tracing_mode="fake")(*plain)
    graph = gm.graph
    graph._codegen = fx.graph.CodeGen()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, inputs.specs):
        node.meta[INPUT] = spec
    output = output_node(gm)
    values = list(output.args[0])
    # copy_ into inputs at the end is functionalization's write-back; the new values are already outputs.
    profiler_nodes = []
    for node in list(graph.nodes):
        if node.target is aten.copy_.default and node.args[0].op == "placeholder" and not node.users:
            graph.erase_node(node)
        elif node.op == "call_function" and str(node.target).startswith("profiler."):
            profiler_nodes.append(node)  # record_function enter/exit from torch.optim: no effect on values
    for node in reversed(profiler_nodes):
        graph.erase_node(node)
    kept_values, kept_roles = [], []
    placeholder_of = {state_key(n.meta[INPUT]): n for n in placeholders}
    for value, role in zip(values, roles):
        if role.kind != "user" and placeholder_of.get(state_key(role)) is value:
            continue  # state the step did not change
        kept_values.append(value)
        kept_roles.append(role)
    output.args = (tuple(kept_values),)
    output.meta[OUTPUTS] = kept_roles
    _name_placeholders(graph, placeholders)
    graph.eliminate_dead_code()
    match_random_layout(gm, gm1)  # eager's random fill order on non-contiguous tensors
    _tag_phases(graph)
    gm.recompile()
    return gm


def _tag_phases(graph: fx.Graph) -> None:
    """Give every op node ``meta["phase"]``.

    The trace tagged what ran inside an autograd backward call (``backward``) and inside ``optimizer.step()``
    or ``zero_grad()`` (``optimizer``). Of the rest, a node that reads gradients (it depends on a backward
    node or a ``.grad`` input) and feeds no backward node is gradient post-processing, such as
    ``clip_grad_norm_``, and belongs to ``optimizer``; everything else is ``forward``.
    """
    nodes = list(graph.nodes)
    for node in nodes:
        tagged = (node.meta.get(CUSTOM) or {}).get(PHASE)
        if tagged is not None:
            node.meta[PHASE] = tagged
    reads_grads: set[fx.Node] = set()
    for node in nodes:
        spec = node.meta.get(INPUT)
        if (spec is not None and spec.kind in ("grad", "input_grad")) or node.meta.get(PHASE) == BACKWARD:
            reads_grads.add(node)
        elif any(arg in reads_grads for arg in node.all_input_nodes):
            reads_grads.add(node)
    feeds_backward: set[fx.Node] = set()
    for node in reversed(nodes):
        if node.meta.get(PHASE) == BACKWARD or any(u in feeds_backward for u in node.users):
            feeds_backward.add(node)
    for node in nodes:
        if node.op == "call_function" and PHASE not in node.meta:
            node.meta[PHASE] = OPTIMIZER if node in reads_grads and node not in feeds_backward else FORWARD


def _readable_name(spec: GraphInput) -> str:
    if spec.kind in ("opt_state", "hparam"):
        owner = spec.name.rsplit(":", 1)[0]
        return f"{spec.field}_{owner}"
    if spec.kind == "grad":
        return f"grad_{spec.name}"
    if spec.kind == "loss_scale":
        return f"loss_scale_{spec.field}"
    return spec.name


def _name_placeholders(graph: fx.Graph, placeholders: list[fx.Node]) -> None:
    for node in placeholders:
        base = _readable_name(node.meta[INPUT])
        ident = re.sub(r"\W+", "_", base).strip("_") or "input"
        if ident[0].isdigit():
            ident = "_" + ident
        node._rename(ident)
        node.target = node.name
