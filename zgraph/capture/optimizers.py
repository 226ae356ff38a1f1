"""Optimizers and LR schedulers while a step is traced.

A bound optimizer's ``step()`` runs zgraph's kernel for its class (``zgraph.capture.update_rules``: hyper-parameters
read from graph inputs), or its own ``step()`` for other classes (``zgraph.capture.as_written``: a ``torch.optim``
class's hyper-parameters from graph inputs too; ``.item()`` of host-known values is a ``zgraph.capture.host_scalars``
symbol, as everywhere in the step), on the traced parameters and state, inside the
``optimizer`` phase, with loss-scale overflow skipping (``zgraph.capture.precision``). What the optimizers did (state
created, which stepped) is recorded on the ``Trace``. An LR scheduler's ``step()`` is recorded, not run: zgraph
runs it for real around the graph on every call.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.fx import traceback as fx_traceback
from torch.optim.lr_scheduler import LRScheduler

from zgraph.capture import update_rules as zopt
from zgraph.capture.as_written import lifted_groups, symbolic_builtins
from zgraph.capture.diagnosis import data_dependent, where
from zgraph.capture.environment import UnboundState
from zgraph.capture.host_scalars import HostScalars
from zgraph.capture.precision import TracePrecision, keep_if_overflow
from zgraph.errors import CaptureError
from zgraph.graph import OPTIMIZER, PHASE, offload_moves
from zgraph.runtime.host_state import mark_state
from zgraph.runtime.optimizers import unwrap_optimizer
from zgraph.runtime.sharded_state import graph_tensor, normalize_param_state
from zgraph.runtime.state import Binding

_INSTANCE_MISSING = object()


@dataclass
class Trace:
    """What one trace of the step works with: the traced parameters, optimizer state and hyper-parameters,
    precision handling, and what the optimizers did."""

    binding: Binding
    config: Any
    params: list[Tensor]
    states: dict[tuple[int, int], dict[str, Any]]
    hparams: dict[tuple[int, int], dict[str, Tensor]]
    precision: TracePrecision
    host: HostScalars
    created: list[tuple[int, int]] = field(default_factory=list)
    updated: list[tuple[int, int]] = field(default_factory=list)
    stepped: list[int] = field(default_factory=list)
    scheduler_steps: list[tuple[LRScheduler, bool, int]] = field(default_factory=list)  # + len(stepped) then


@contextlib.contextmanager
def swap_optimizers(trace: Trace) -> Iterator[None]:
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
def record_scheduler_steps(trace: Trace) -> Iterator[None]:
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
        o_index = optimizer_index.get(id(unwrap_optimizer(scheduler.optimizer)))
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


def scheduler_order(trace: Trace) -> list[tuple[LRScheduler, bool]]:
    """The recorded scheduler steps, checked: a scheduler stepped between two updates of its optimizer would
    change the learning rate in the middle of the graph, which reads each learning rate once."""
    optimizer_index = {id(r.optimizer): r.index for r in trace.binding.optimizers}
    for scheduler, _, stepped_before in trace.scheduler_steps:
        o_index = optimizer_index.get(id(unwrap_optimizer(scheduler.optimizer)))
        if o_index in trace.stepped[:stepped_before] and o_index in trace.stepped[stepped_before:]:
            raise CaptureError(
                f"{type(scheduler).__name__}.step() runs between two step() calls of its optimizer inside one "
                "zgraph step; zgraph reads each learning rate once per call. Step the scheduler before the first "
                "or after the last optimizer step."
            )
    return [(scheduler, before) for scheduler, before, _ in trace.scheduler_steps]


@contextlib.contextmanager
def _optimizer_phase(trace: Trace) -> Iterator[None]:
    trace.precision.in_optimizer = True
    try:
        with fx_traceback.annotate({PHASE: OPTIMIZER}), torch.no_grad():
            yield
    finally:
        trace.precision.in_optimizer = False


def _in_optimizer(trace: Trace, fn: Callable) -> Callable:
    @functools.wraps(fn)  # its signature stays fn's: wrappers inspect it (accelerate's zero_grad reads set_to_none)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _optimizer_phase(trace):
            return fn(*args, **kwargs)

    return wrapped


def _untraceable(opt: torch.optim.Optimizer, exc: Exception) -> CaptureError:
    name = f"{type(opt).__module__}.{type(opt).__qualname__}"
    detail = data_dependent(exc)
    if detail is not None:
        return CaptureError(
            f"zgraph cannot trace the optimizer {name}: in its step(), {detail}{where(exc)}. zgraph traces the "
            "step once and replays it: Python may branch on hyper-parameters and on values computed only from "
            "them and 0-d optimizer state (step counters: known before each call), not on a value only the "
            "device knows (a norm of a parameter or gradient). Write that decision as tensor ops "
            "(torch.where, torch.clamp, torch.maximum) or, on a Python number, torch.sym_max / torch.sym_min."
        )
    return CaptureError(
        f"zgraph cannot trace the optimizer {name}: "
        f"its step() failed under the tracer ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        f"{where(exc)}. zgraph traces every torch.optim optimizer but LBFGS and SparseAdam, and other "
        "optimizers whose step() is tensor code."
    )


def _own_step(trace: Trace, o_index: int, original_step: Callable, flat: list[int], overflow: Tensor | None) -> None:
    """The optimizer's own ``step()`` on the traced parameters ``flat`` (indices of those with a gradient), for a
    class zgraph has no kernel for; its updates undone on overflow, the state it created recorded."""
    opt = trace.binding.optimizers[o_index].optimizer
    params = trace.params
    if trace.precision.grads_stay_scaled:
        raise CaptureError(
            f"fp16 master gradients with loss scaling need an optimizer zgraph has a kernel for "
            f"(SGD, Adam, AdamW), not {type(opt).__name__}"
        )
    before = {id(params[i]): len(opt.state.get(params[i], {})) for i in flat}
    tensors = [params[i] for i in flat] + [
        v for i in flat for v in opt.state.get(params[i], {}).values() if isinstance(v, Tensor)
    ]
    previous = [t.clone() for t in tensors] if overflow is not None else []
    hparams = [trace.hparams.get((o_index, g), {}) for g in range(len(opt.param_groups))]
    try:
        with lifted_groups(opt, hparams), symbolic_builtins(opt):
            original_step()
    except (CaptureError, UnboundState):
        raise
    except Exception as exc:
        raise _untraceable(opt, exc) from exc
    keep_if_overflow(overflow, tensors, previous)
    new_state = [i for i in flat if before[id(params[i])] == 0 and opt.state.get(params[i])]
    trace.created.extend((o_index, i) for i in new_state)


def _traced_step(trace: Trace, o_index: int, original_step: Callable) -> Callable:
    """``optimizer.step`` while the step is traced: zgraph's kernel for registered classes (hyper-parameters
    from graph inputs), the optimizer's own ``step()`` otherwise; with loss-scale overflow skipping and
    ``max_grad_norm`` clipping around it."""
    record = trace.binding.optimizers[o_index]
    opt = record.optimizer
    kernel = zopt.kernel_for(opt)
    params = trace.params
    precision = trace.precision
    state_dtype = trace.config.optimizer_state_dtype
    # 16-bit master weights or states asked for in the config: DeepSpeed's recipe updates them in float32
    low_precision_recipe = any(d in (torch.bfloat16, torch.float16) for d in (state_dtype, trace.config.master_dtype))

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
                _own_step(trace, o_index, original_step, flat, overflow)
                return
            for g_index, (group, indices) in enumerate(zip(opt.param_groups, groups)):
                trace.updated.extend((o_index, i) for i in indices)
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
                with trace.host.suspended():
                    kernel.update(
                        [params[i] for i in indices],
                        [grad_of[i] for i in indices],
                        states,
                        trace.hparams[(o_index, g_index)],
                        group,
                        state_dtype,
                        low_precision_recipe or bool(group.get("fused")),
                    )
                keep_if_overflow(overflow, tensors, previous)

    return step


def create_first_state(
    binding: Binding,
    created: list[tuple[int, int]],
    state_dtype: torch.dtype | None,
    settle: Callable[[int, int], None] | None = None,
) -> bool:
    """Create, eagerly and exactly as torch.optim would, the state a first optimizer step creates for the
    ``(optimizer, param)`` pairs ``created`` (``CapturedGraph.created_state``); True if any was created. On meta
    parameters (an estimate's) the state is meta too: no memory. ``settle(optimizer, param)`` runs after each
    parameter's state is made (the step shards it, and moves it to the offload tier, before the next is made)."""
    made = False
    for o_index, p_index in created:
        opt = binding.optimizers[o_index].optimizer
        kernel = zopt.kernel_for(opt)
        if kernel is None or kernel.initial_state is None:
            continue
        group = next(g for g, idx in zip(opt.param_groups, binding.optimizers[o_index].group_params) if p_index in idx)
        param = binding.params[p_index].tensor
        opt.state[param] = kernel.initial_state(param.detach(), group, state_dtype)
        made = True
        if settle is not None:
            settle(o_index, p_index)
    return made


def first_state_candidates(binding: Binding) -> list[tuple[int, int]]:
    """The ``(optimizer, param)`` pairs a first step creates state for when every parameter that requires grad
    gets a gradient: parameters without state of optimizers whose zgraph kernel has an initial state."""
    pairs = []
    for o in binding.optimizers:
        kernel = zopt.kernel_for(o.optimizer)
        if kernel is None or kernel.initial_state is None:
            continue
        for i in sorted({i for indices in o.group_params for i in indices}):
            if binding.params[i].tensor.requires_grad and not binding.optimizer_state(o.index, i):
                pairs.append((o.index, i))
    return pairs


def stateless_pairs(binding: Binding) -> list[tuple[int, int]]:
    """Every ``(optimizer, param)`` pair whose parameter has no optimizer state yet (what a failed first compile
    drops again: ``drop_state``)."""
    return [
        (o.index, i)
        for o in binding.optimizers
        for i in sorted({i for indices in o.group_params for i in indices})
        if not binding.optimizer_state(o.index, i)
    ]


def drop_state(binding: Binding, pairs: list[tuple[int, int]]) -> None:
    """Remove the optimizer state of the ``(optimizer, param)`` pairs (and what the offload tier holds of it)."""
    dropped = []
    for o_index, p_index in pairs:
        state = binding.optimizers[o_index].optimizer.state.pop(binding.params[p_index].tensor, None) or {}
        dropped += [graph_tensor(v) for v in state.values() if isinstance(v, Tensor)]
    if binding.offload is not None and dropped:
        binding.offload.forget(dropped)


def settle_first_state(binding: Binding, config: Any) -> Callable[[int, int], None]:
    """What happens to each parameter's new optimizer state as soon as ``create_first_state`` makes it: it is
    sharded (stage >= 1) and, when the optimizer's states are all offloaded (``Config.offload_fraction`` 1, the
    default), moved to the offload tier, so that a first step never holds every parameter's whole state at once
    (on a GPU that is what would not fit). With a smaller fraction the graph's plan decides which states move, at
    the first run. The state of a parameter the host updates is made in host memory (``zgraph.runtime.host_state``)."""
    moves = offload_moves(config.offload_optimizer, binding.device.type) and config.offload_fraction == 1.0
    offloaded = binding.offload is not None and moves

    def settle(o_index: int, p_index: int) -> None:
        normalize_param_state(binding.plan, binding, o_index, p_index)
        if p_index in binding.host_params:  # made from the host parameter, in host memory already
            mark_state(binding, p_index, binding.device)
            return
        for key, value in binding.optimizer_state(o_index, p_index).items():
            if offloaded and isinstance(value, Tensor) and value.dim() > 0:
                binding.offload.offload_now(("opt_state", p_index, key, o_index), graph_tensor(value))

    return settle
