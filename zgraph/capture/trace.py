"""Capture a whole training step — forward, every backward call, the optimizer — into one functional aten graph.

How:

1. The step runs once under ``make_fx`` on fake tensors. Every parameter, buffer, ``.grad`` present on entry,
   optimizer state tensor, numeric optimizer hyper-parameter (0-d float64) and tensor argument is a graph
   input; the traced tensors are swapped into the modules and optimizers for the duration of the trace, so
   the user's code runs unchanged. Autograd runs for real during the trace, so ``loss.backward()``,
   ``out.backward(gradient=g)``, several backward calls, ``torch.autograd.grad`` all become explicit aten ops.
   Every gradient autograd produces for a parameter passes through ``zgraph::grad_contribution`` (see
   ``zgraph.ops``). Registered optimizers (``zgraph.capture.update_rules``) run a kernel that reads hyper-parameters
   from graph inputs; other optimizers run their own ``step()``. The ``.item()`` or ``bool()`` of a value the host
   knows before the call (from hyper-parameters, step counters, modules' 0-d integer buffers) is a backed
   symbol whose Python branches are guards (``zgraph.capture.host_scalars``).
2. The step runs under functionalization while traced (``zgraph.capture.functionalize``), so the one trace yields
   a functional graph (as AOTAutograd does): autograd runs above functionalization, in-place ops reach the graph
   as their functional forms. Every piece of state the step changed is a graph output: the new value of a
   parameter, buffer, optimizer state tensor, mutated tensor argument, and the ``.grad`` left on each parameter.
   State the step did not change is not an output.

Where: this module collects the graph inputs and traces the step once (``trace_step``), returning what the trace
found (``Traced``: the graph, frozen constants, created optimizer state, or the unbound modules and optimizers it
stopped at); the capture protocol (``zgraph.capture.protocol``) decides whether to bind more and trace again, and
``finish`` names and tags the graph. The trace
environment (swaps, autocast, restoring Python state, diagnosing failures) is ``zgraph.capture.environment``;
optimizers and LR schedulers while tracing, ``zgraph.capture.optimizers``; functionalization, naming and phases,
``zgraph.capture.functionalize``.

What later code may rely on (the captured graph's contract; meta keys from ``zgraph.graph``):

- placeholders carry ``node.meta[INPUT]`` (a ``GraphInput``) and readable names;
- the output node carries ``node.meta[OUTPUTS]``, one ``GraphOutput`` per returned value;
- every op node carries ``node.meta[PHASE]``: ``"forward"``, ``"backward"`` or ``"optimizer"`` (how it is
  decided: ``_tag_phases``);
- the graph is functional: no op mutates its inputs (``copy_`` into inputs has been turned into outputs).
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from zgraph.capture.blocks import mark_blocks
from zgraph.capture.captured import CapturedGraph, CaptureRequest, Returned, Traced
from zgraph.capture.collectives import functional_c10d
from zgraph.capture.compiled import optimized_modules_as_modules, through_compile_wrappers
from zgraph.capture.environment import (
    UnboundState,
    autocast_forwards,
    cast_forward_inputs,
    data_assignment_as_copy,
    group_values,
    real_constants,
    refuse_created_state,
    restore_python_state_on_error,
    swap_module_tensors,
    swap_slots,
    trace,
    traced_tensor,
    watch_unbound_state,
)
from zgraph.capture.functionalize import functionalized
from zgraph.capture.generator_state import generator_state_ops
from zgraph.capture.host_scalars import HostScalars
from zgraph.capture.inputs import check_dense, collect_inputs, fake_inputs
from zgraph.capture.optimizers import Trace, record_scheduler_steps, scheduler_order, swap_optimizers
from zgraph.capture.precision import StepMode, TracePrecision, kept_in_own_dtype
from zgraph.capture.size_guards import size_guards
from zgraph.capture.symbolic_calls import symbolic_calls
from zgraph.errors import CaptureError
from zgraph.graph import GraphInput, GraphOutput
from zgraph.ops import grad_contribution
from zgraph.runtime.state import Binding
from zgraph.tree import map_leaves


def trace_step(request: CaptureRequest) -> Traced:
    """Trace the request's step once on fake tensors, with its config's precision handling (compute dtype, loss
    scaling, clipping: see ``zgraph.capture.precision``).

    The traced step receives its arguments with bound parameters, buffers and user tensors (see
    ``CaptureRequest``) replaced by their traced stand-ins; each swap's slot holds its tensor's stand-in while
    tracing. Returns what the trace found (``Traced``).
    """
    binding, user_tensors = request.binding, request.user_tensors
    inputs = collect_inputs(binding, user_tensors)
    check_dense(inputs)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True, static_shapes=True)
    fakes = fake_inputs(mode, inputs, request.meta_as, request.dynamic)
    found: list[tuple[CapturedGraph, list[GraphOutput]]] = []
    grad_enabled = torch.is_grad_enabled()
    host = HostScalars(inputs.specs, inputs.values, mode.shape_env)

    def traced_step(*flat: Tensor) -> list[object]:
        state = _unpack(inputs.specs, flat, binding, len(user_tensors))
        step_trace = _step_trace(request, state, host)
        flags_before = [(m, m.training) for _, root in binding.modules for m in root.modules()]
        groups_before = group_values(binding)
        with _environment(request, state, step_trace, grad_enabled) as traced, host, symbolic_calls():
            result = request.fn(*_substitute(request.args, traced), **_substitute(request.kwargs, traced))
            _refuse_deferred(result)
            final = _final_state(binding, state.params)
            _refuse_changed_groups(binding, groups_before)
            with torch.no_grad():
                grads = [p.grad for p in state.params if p.grad is not None]
                final_loss_state = step_trace.precision.finish_step(grads)
        captured = CapturedGraph(gm=None, result_template=None)
        captured.training_flags = [(m, m.training) for m, before in flags_before if m.training != before]
        outs, roles = _outputs(captured, result, binding, state, final, user_tensors, final_loss_state)
        _record(captured, step_trace)
        found.append((captured, roles))
        return outs

    try:
        with through_compile_wrappers() if request.through_compile else contextlib.nullcontext():
            gm = trace(functionalized(traced_step), fakes, mode, request.fn)
    except UnboundState as unbound:
        return Traced(unbound=unbound)
    constants = real_constants(gm)
    for t in constants:
        if traced_tensor(t.grad):  # autograd reached a real leaf the trace read as a constant
            t.grad = None
    captured, roles = found[-1]
    captured.host_guards = host.guards()
    captured.size_guards = size_guards(mode.shape_env, inputs.specs, fakes, request.dynamic)
    return Traced(None, gm, captured, constants, inputs.specs, roles)


def _step_trace(request: CaptureRequest, state: _TracedState, host: HostScalars) -> Trace:
    """The trace's record of optimizers and precision, with each traced parameter's gradient hooked so that
    every contribution passes through ``zgraph::grad_contribution``."""
    binding, config = request.binding, request.config
    kept = kept_in_own_dtype(binding, config.keep_fp32_modules) if config.param_dtype is not None else set()
    precision = TracePrecision(
        config, {id(p): p for p in state.params}, state.loss_state, {id(state.params[i]) for i in kept}
    )
    for i, p in enumerate(state.params):
        if p.requires_grad:
            p.register_hook(lambda g, i=i: grad_contribution(precision.unscale_contribution(g), i))
    return Trace(binding, config, state.params, state.states, state.hparams, precision, host)


def _refuse_changed_groups(binding: Binding, before: object) -> None:
    if group_values(binding) != before:
        raise CaptureError(
            "the step changed optimizer param_groups values (e.g. lr) while it ran; in a zgraph step that "
            "change would be baked into the graph as a constant. Set them before calling the step, or use "
            "an LR scheduler (its step(), inside the step or between calls, runs eagerly around the "
            "graph): they are graph inputs."
        )


def _record(captured: CapturedGraph, step_trace: Trace) -> None:
    """What the optimizers and LR schedulers did while traced."""
    captured.created_state = step_trace.created
    captured.updated_state = step_trace.updated
    captured.optimizers_stepped = sorted(set(step_trace.stepped))
    captured.scheduler_steps = scheduler_order(step_trace)


def _refuse_deferred(result: object) -> None:
    """A generator (or coroutine) step has not run when it returns: nothing of it would be captured."""
    if inspect.isgenerator(result) or inspect.isasyncgen(result) or inspect.iscoroutine(result):
        raise CaptureError(
            f"the step returned a {type(result).__name__}: its body runs only when that is iterated or awaited, "
            "after zgraph has captured the step (so nothing would be captured). Write the step as a plain function "
            "that runs forward, backward and the optimizer and returns its values (a tuple or list instead of "
            "`yield`)."
        )


def _substitute(obj: object, traced: dict[int, Tensor]) -> object:
    """``obj`` with each tensor leaf that has a traced stand-in replaced by it."""
    return map_leaves(obj, lambda _path, leaf: traced.get(id(leaf), leaf) if isinstance(leaf, Tensor) else leaf)


@dataclass
class _TracedState:
    """The traced stand-ins of one trace's inputs, sorted by what they are."""

    params: list[Tensor]
    buffers: list[Tensor | None]
    states: dict[tuple[int, int], dict[str, object]]
    hparams: dict[tuple[int, int], dict[str, Tensor]]
    user: list[Tensor]
    loss_state: dict[str, Tensor]


def _unpack(specs: list[GraphInput], flat: tuple, binding: Binding, n_user: int) -> _TracedState:
    """Sort the traced inputs by kind; set the ``.grad`` stand-ins on the traced parameters and arguments."""
    by_kind: dict[str, dict] = defaultdict(dict)
    for spec, value in zip(specs, flat):
        key = (spec.optimizer, spec.index, spec.field) if spec.kind == "opt_state" else spec.index
        if spec.kind == "hparam":
            key = (spec.optimizer, spec.group, spec.field)
        by_kind[spec.kind][key] = value
    params = [by_kind["param"][i] for i in range(len(binding.params))]
    buffers = [by_kind["buffer"].get(r.index) for r in binding.buffers]
    for i, grad in by_kind["grad"].items():
        params[i].grad = grad
    states: dict[tuple[int, int], dict[str, object]] = defaultdict(dict)
    for o in binding.optimizers:
        for i in {i for indices in o.group_params for i in indices}:
            for key, value in binding.optimizer_state(o.index, i).items():
                states[(o.index, i)][key] = by_kind["opt_state"].get((o.index, i, key), value)
    hparams: dict[tuple[int, int], dict[str, Tensor]] = defaultdict(dict)
    for (o_index, g_index, name), value in by_kind["hparam"].items():
        hparams[(o_index, g_index)][name] = value
    user = [by_kind["input"][i] for i in range(n_user)]
    for i, grad in by_kind["input_grad"].items():
        user[i].grad = grad
    loss_state = {spec.field: value for spec, value in zip(specs, flat) if spec.kind == "loss_scale"}
    return _TracedState(params, buffers, states, hparams, user, loss_state)


@contextlib.contextmanager
def _environment(
    request: CaptureRequest, state: _TracedState, step_trace: Trace, grad_enabled: bool
) -> Iterator[dict[int, Tensor]]:
    """Everything the user's step runs under while traced (``zgraph.capture.environment``,
    ``zgraph.capture.optimizers``); yields ``id`` of each real tensor -> its traced stand-in."""
    binding, config, user_tensors = request.binding, request.config, request.user_tensors
    params, buffers, user = state.params, state.buffers, state.user
    traced = {id(r.tensor): params[r.index] for r in binding.params}
    traced.update({id(t): user[i] for i, (_, t) in enumerate(user_tensors)})

    def is_grad(t: Tensor) -> bool:
        return any(t is p.grad for p in params)

    with contextlib.ExitStack() as stack:
        stack.enter_context(restore_python_state_on_error(binding))
        stack.enter_context(refuse_created_state(binding))
        stack.enter_context(swap_module_tensors(binding, params, buffers))
        stack.enter_context(swap_slots(list(request.swaps), traced))
        stack.enter_context(watch_unbound_state(binding))
        stack.enter_context(
            data_assignment_as_copy(
                [*params, *(b for b in buffers if b is not None), *user]
                + [v for st in state.states.values() for v in st.values() if isinstance(v, Tensor)]
            )
        )
        if config.param_dtype is not None:
            stack.enter_context(cast_forward_inputs(binding, config.param_dtype))
        if config.autocast_dtype is not None:
            stack.enter_context(autocast_forwards(binding, config.autocast_dtype, _device_type(state.params)))
        if config.remat is not None or config.pipeline_parallel is not None:  # what remat and stage_cut read
            stack.enter_context(mark_blocks(binding))
        stack.enter_context(swap_optimizers(step_trace))
        stack.enter_context(record_scheduler_steps(step_trace))
        stack.enter_context(functional_c10d())
        stack.enter_context(generator_state_ops())
        stack.enter_context(StepMode(step_trace.precision, is_grad))
        stack.enter_context(torch.set_grad_enabled(grad_enabled))
        stack.enter_context(optimized_modules_as_modules())
        yield traced


def _device_type(params: list[Tensor]) -> str:
    """The device the traced parameters are on (the stand-ins' device, not the meta device of an estimate's)."""
    return params[0].device.type if params else "cpu"


def _final_state(binding: Binding, params: list[Tensor]) -> tuple[list, dict]:
    """The buffers and optimizer state as the traced step left them."""
    buffers = [r.get() for r in binding.buffers]
    states = {
        (o.index, i): dict(o.optimizer.state.get(params[i], {}))
        for o in binding.optimizers
        for i in {i for indices in o.group_params for i in indices}
    }
    return buffers, states


def _outputs(
    captured: CapturedGraph,
    result: object,
    binding: Binding,
    state: _TracedState,
    final: tuple[list, dict],
    user_tensors: list[tuple[str, Tensor]],
    final_loss_state: dict[str, Tensor],
) -> tuple[list[object], list[GraphOutput]]:
    """The traced step's outputs and their roles: the result's tensors, then every piece of state (unchanged
    state is dropped later); fills the result template and what the runtime restores on ``captured``."""
    params, user = state.params, state.user
    final_buffers, final_states = final
    outs: list[object] = []
    roles: list[GraphOutput] = []

    def returned(path: str, leaf: object) -> object:
        if isinstance(leaf, (Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            if isinstance(leaf, Tensor) and leaf.requires_grad:
                captured.grad_outputs.append((len(outs), tuple(leaf.shape), leaf.dtype, leaf.device))
            outs.append(leaf)
            roles.append(GraphOutput("user", path, len(roles)))
            return Returned(len(outs) - 1)
        if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            captured.python_results.append((f"result{path}", leaf))
        return leaf

    def out(value: object, role: GraphOutput) -> None:
        outs.append(value)
        roles.append(role)

    captured.result_template = map_leaves(result, returned)
    for r in binding.params:
        out(params[r.index], GraphOutput("param", r.name, r.index))
    for r in binding.params:
        if params[r.index].grad is None:
            captured.none_grads.append(r.index)
        else:
            out(params[r.index].grad, GraphOutput("grad", r.name, r.index))
    for r, value in zip(binding.buffers, final_buffers):
        if value is not None:
            out(value, GraphOutput("buffer", r.name, r.index))
    for (o_index, i), opt_state in final_states.items():
        for key, value in opt_state.items():
            if isinstance(value, Tensor):
                out(value, GraphOutput("opt_state", f"{binding.params[i].name}:{key}", i, field=key, optimizer=o_index))
            else:
                captured.constant_state.append((o_index, i, key, value))
    for i, (path, _) in enumerate(user_tensors):
        out(user[i], GraphOutput("input", path, i))
        if user[i].requires_grad and user[i].is_leaf:
            if user[i].grad is None:
                captured.none_input_grads.append(i)
            else:
                out(user[i].grad, GraphOutput("input_grad", f"{path}.grad", i))
    for name, value in final_loss_state.items():
        out(value, GraphOutput("loss_scale", f"loss_scale:{name}", 0, field=name))
    return outs, roles
