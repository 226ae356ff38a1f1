"""``@zgraph.distribute``: the object that replaces the user's training step.

On a call it finds the modules and optimizers the step uses, looks up a compiled graph by a guard key (shapes,
dtypes, structure, requires_grad, grad mode, training flags, optimizer structure), captures, transforms and
compiles on a miss, then runs the graph and writes the new state back into the modules and optimizers.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from zgraph import optimizers as zopt
from zgraph.capture import CapturedGraph, GraphInput, GraphOutput, _Returned, capture
from zgraph.config import Config
from zgraph.explain import dump_graphs, explain_table
from zgraph.passes import ParamInfo, PassContext, PassRecord, build_pipeline, default_pipeline, run_pipeline
from zgraph.precision import initial_loss_scale_state
from zgraph.runtime.consistency import check_same_graph, describe_collectives, describe_graph, digest
from zgraph.runtime.cost_model import fit_cost_model
from zgraph.runtime.executor import Executable, compile_graph
from zgraph.runtime.process_group import ensure_process_group
from zgraph.runtime.sharded_state import (
    StateIO,
    adopt_sharded_parameters,
    apply_plan,
    convert_master_dtype,
    make_plan,
    normalize_state,
)
from zgraph.runtime.state import Binding
from zgraph.tree import children, iter_leaves, map_leaves, structure_key

_STATE_TYPES = (nn.Module, torch.optim.Optimizer)


# ------------------------------------------------------------------------------------------------ discovery
def _bound_arguments(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """``[(name, value)]`` of the call's arguments, named after the step's signature where possible."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    return list(bound.arguments.items())


def _find_state(obj: Any, path: str, out: list[tuple[str, Any]], seen: set[int], depth: int = 0) -> None:
    if isinstance(obj, _STATE_TYPES):
        if id(obj) not in seen:
            seen.add(id(obj))
            out.append((path, obj))
        return
    kids = children(obj)
    if kids is not None:
        for suffix, child in kids:
            _find_state(child, path + suffix, out, seen, depth)
    elif depth == 0 and hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType, Tensor)):
        # A plain object (a trainer, ``self`` of a method): look at its attributes, one level deep.
        for name, value in list(vars(obj).items()):
            _find_state(value, f"{path}.{name}", out, seen, depth + 1)


def discover(fn: Callable, args: tuple, kwargs: dict) -> tuple[list[tuple[str, nn.Module]], list]:
    """Modules and optimizers a step uses: in its arguments (any nesting), its closure, and the globals it names."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for name, value in _bound_arguments(fn, args, kwargs):
        _find_state(value, name, found, seen)
    code = getattr(fn, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
            try:
                _find_state(cell.cell_contents, name, found, seen, depth=1)
            except ValueError:  # empty cell
                continue
        fn_globals = getattr(fn, "__globals__", {})
        for name in code.co_names:
            if name in fn_globals:
                _find_state(fn_globals[name], name, found, seen, depth=1)
    modules = [(label, m) for label, m in found if isinstance(m, nn.Module)]
    optimizers = [(label, o) for label, o in found if isinstance(o, torch.optim.Optimizer)]
    return modules, optimizers


# ------------------------------------------------------------------------------------------------ guard key
def _tensor_key(t: Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad, t.is_contiguous(), t.grad is not None)


def _value_key(value: Any) -> Any:
    if isinstance(value, Tensor):
        return _tensor_key(value)
    if isinstance(value, _STATE_TYPES):
        return (type(value), id(value))
    try:
        hash(value)
    except TypeError:
        return (type(value), id(value))
    return (type(value), value)


def guard_key(binding: Binding, args_tree: Any) -> tuple:
    """Everything a captured graph depends on besides tensor values. A different key retraces."""
    params = tuple(
        (tuple(r.tensor.shape), r.tensor.dtype, r.tensor.requires_grad, _grad_key(r.tensor)) for r in binding.params
    )
    buffers = tuple(_maybe_tensor_key(r.get()) for r in binding.buffers)
    opts = []
    for o in binding.optimizers:
        kernel = zopt.kernel_for(o.optimizer)
        groups = tuple(
            kernel.structure(g) if kernel else tuple(sorted((k, _value_key(v)) for k, v in g.items() if k != "params"))
            for g in o.optimizer.param_groups
        )
        states = tuple(
            tuple(sorted((k, _value_key(v)) for k, v in binding.optimizer_state(o.index, i).items()))
            for indices in o.group_params
            for i in indices
        )
        opts.append((groups, states))
    training = tuple(m.training for _, root in binding.modules for m in root.modules())
    leaves = tuple(_value_key(leaf) for _, leaf in iter_leaves(args_tree))
    autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    return (
        id(binding),
        torch.is_grad_enabled(),
        autocast,
        params,
        buffers,
        tuple(opts),
        training,
        structure_key(args_tree),
        leaves,
    )


def _grad_key(t: Tensor) -> tuple | None:
    g = t.grad
    return None if g is None else (tuple(g.shape), g.dtype)


def _maybe_tensor_key(t: Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.dtype, t.is_contiguous())


# ---------------------------------------------------------------------------------------------- compiled step
@dataclass
class CompiledStep:
    """One captured, transformed and compiled variant of the step (one guard key)."""

    captured: CapturedGraph
    records: list[PassRecord]
    executable: Executable
    capture_seconds: float
    input_specs: list[GraphInput] = field(default_factory=list)
    output_roles: list[GraphOutput] = field(default_factory=list)
    description: list[str] = field(default_factory=list)
    digest: int = 0
    cost_model: Any = None

    @property
    def final(self) -> fx.GraphModule:
        return self.records[-1].gm if self.records else self.captured.gm

    def graphs(self) -> OrderedDict[str, fx.GraphModule]:
        out: OrderedDict[str, fx.GraphModule] = OrderedDict(captured=self.captured.gm)
        for record in self.records:
            out[record.name] = record.gm
        out["final"] = self.final
        return out


class DistributedStep:
    """A training step compiled by zgraph; call it like the original function.

    Attributes:
        config: the ``zgraph.Config`` it was built with.
    """

    def __init__(self, fn: Callable, config: Config):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.config = config
        self._pipeline = build_pipeline(default_pipeline(), config.disable_passes, config.extra_passes)
        self._bindings: dict[tuple, Binding] = {}
        self._cache: dict[tuple, CompiledStep] = {}
        self._last: CompiledStep | None = None

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return types.MethodType(self, instance)

    # -------------------------------------------------------------------------------------------- calling
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        binding = self._binding(args, kwargs)
        user_tensors = self._user_tensors(binding, args, kwargs)
        key = guard_key(binding, (args, kwargs))
        compiled = self._cache.get(key)
        if compiled is None:
            try:
                compiled = self._compile(binding, args, kwargs, user_tensors)
            except Exception as error:
                if binding.plan.group.distributed:
                    check_same_graph(0, [], error)  # tell the other ranks, then re-raise
                raise
            key = guard_key(binding, (args, kwargs))
            self._cache[key] = compiled
        if binding.plan.group.distributed:
            check_same_graph(compiled.digest, compiled.description)
        self._last = compiled
        return self._run(compiled, binding, user_tensors)

    def _binding(self, args: tuple, kwargs: dict) -> Binding:
        modules, optimizers = discover(self._fn, args, kwargs)
        adopt_sharded_parameters([opt for _, opt in optimizers])
        binding = self._bindings.get(_binding_key(modules, optimizers))
        if binding is None:
            binding = Binding(modules, optimizers)
            convert_master_dtype(binding, self.config.master_dtype, self.config.optimizer_state_dtype)
            binding.loss_scale_state = initial_loss_scale_state(self.config)
            for _, opt in optimizers:
                loaded = getattr(opt, "_zgraph_loss_scale", None) or {}  # zgraph.load before the first step
                binding.loss_scale_state.update((k, v) for k, v in loaded.items() if k in binding.loss_scale_state)
                opt._zgraph_loss_scale = binding.loss_scale_state  # saved and restored by zgraph.save / load
            binding.plan = make_plan(
                self.config.stage, ensure_process_group(), binding, self.config.param_persistence_threshold
            )
            apply_plan(binding.plan, binding)  # may replace parameters (stage 3): key them as they are now
            device = binding.params[0].tensor.device if binding.params else torch.device("cpu")
            # collective on every rank: done here, before any user code runs, so a failing capture cannot skip it
            binding.cost_model = fit_cost_model(binding.plan.group, device, self.config.measure_collectives)
            self._bindings[_binding_key(modules, optimizers)] = binding
        return binding

    def _user_tensors(self, binding: Binding, args: tuple, kwargs: dict) -> list[tuple[str, Tensor]]:
        out = []
        seen: set[int] = set()
        for name, value in _bound_arguments(self._fn, args, kwargs):
            for path, leaf in iter_leaves(value, name):
                if not isinstance(leaf, Tensor) or id(leaf) in seen:
                    continue
                seen.add(id(leaf))
                if binding.param_index(leaf) is None and binding.buffer_index(leaf) is None:
                    out.append((path, leaf))
        return out

    def _substitute(self, label: str, obj: Any, traced: dict[int, Tensor]) -> Any:
        return map_leaves(obj, lambda _path, leaf: traced.get(id(leaf), leaf) if isinstance(leaf, Tensor) else leaf)

    def _compile(self, binding: Binding, args: tuple, kwargs: dict, user_tensors: list) -> CompiledStep:
        start = time.perf_counter()
        captured = capture(
            self._fn,
            args,
            kwargs,
            binding,
            user_tensors,
            self._substitute,
            self.config,
            materialize_state=functools.partial(self._materialize_created_state, binding),
        )
        capture_seconds = time.perf_counter() - start
        ctx = self._context(binding)
        records = run_pipeline(captured.gm, ctx, self._pipeline)
        final = records[-1].gm if records else captured.gm
        specs = [n.meta["zgraph_input"] for n in final.graph.nodes if n.op == "placeholder"]
        output = next(n for n in reversed(final.graph.nodes) if n.op == "output")
        executable = compile_graph(final, self.config.backend)
        description = describe_graph(captured.gm) + describe_collectives(final)
        return CompiledStep(
            captured,
            records,
            executable,
            capture_seconds,
            specs,
            output.meta["zgraph_outputs"],
            description,
            digest(description),
            binding.cost_model,
        )

    def _materialize_created_state(self, binding: Binding, captured: CapturedGraph) -> bool:
        """Create, eagerly and exactly as torch.optim would, the optimizer state a first step creates; True if
        any was created (the step is then captured again with that state as inputs)."""
        created = False
        for o_index, p_index in captured.created_state:
            opt = binding.optimizers[o_index].optimizer
            kernel = zopt.kernel_for(opt)
            if kernel is None or kernel.initial_state is None:
                continue
            group = next(
                g for g, idx in zip(opt.param_groups, binding.optimizers[o_index].group_params) if p_index in idx
            )
            param = binding.params[p_index].tensor
            opt.state[param] = kernel.initial_state(param.detach(), group, self.config.optimizer_state_dtype)
            created = True
        normalize_state(binding.plan, binding)
        return created

    def _context(self, binding: Binding) -> PassContext:
        plan = binding.plan
        params = tuple(
            ParamInfo(
                r.index,
                tuple(r.names),
                tuple(r.tensor.shape),
                r.tensor.dtype,
                r.tensor.requires_grad,
                shard=plan.specs[r.index],
                persistent=plan.persistent[r.index],
            )
            for r in binding.params
        )
        group = plan.group
        return PassContext(
            config=self.config,
            world_size=group.world_size,
            rank=group.rank,
            group_name=group.group_name,
            params=params,
            cost_model=binding.cost_model,
        )

    def _run(self, compiled: CompiledStep, binding: Binding, user_tensors: list) -> Any:
        io = StateIO(binding, binding.plan)
        captured = compiled.captured
        for scheduler, before_update in captured.scheduler_steps:
            if before_update:
                scheduler.step()  # the user's step stepped it before its optimizer: the graph reads the new lr
        hyper: dict[tuple[int, int], dict[str, float]] = {}
        for spec in compiled.input_specs:
            if spec.kind == "hparam" and (spec.optimizer, spec.group) not in hyper:
                opt = binding.optimizers[spec.optimizer].optimizer
                kernel = zopt.kernel_for(opt)
                hyper[(spec.optimizer, spec.group)] = kernel.hyperparameters(opt.param_groups[spec.group])
        inputs = [io.read(spec, user_tensors, hyper) for spec in compiled.input_specs]
        outputs = list(compiled.executable.run(inputs))
        _unalias(outputs, inputs, compiled.executable.updated_inputs)
        user_values = []
        for value, role in zip(outputs, compiled.output_roles):
            if role.kind == "user":
                user_values.append(value)
            else:
                io.write(role, value, user_tensors)
        for i in captured.none_grads:
            binding.params[i].tensor.grad = None
        for i in captured.none_input_grads:
            user_tensors[i][1].grad = None
        for o_index, p_index, key, value in captured.constant_state:
            opt = binding.optimizers[o_index].optimizer
            opt.state[binding.params[p_index].tensor][key] = value
        for module, training in captured.training_flags:
            module.training = training
        for o_index in captured.optimizers_stepped:
            binding.optimizers[o_index].optimizer._opt_called = True  # what LR schedulers check
        for scheduler, before_update in captured.scheduler_steps:
            if not before_update:
                scheduler.step()
        return map_leaves(
            captured.result_template,
            lambda _p, leaf: user_values[leaf.position] if isinstance(leaf, _Returned) else leaf,
        )

    # ------------------------------------------------------------------------------------------ inspection
    def _compiled(self) -> CompiledStep:
        if self._last is None:
            raise RuntimeError("the step has not been called yet: graphs exist after the first call")
        return self._last

    @property
    def graphs(self) -> OrderedDict[str, fx.GraphModule]:
        """The graphs of the last call's variant: ``captured``, one per pass, then ``final``."""
        return self._compiled().graphs()

    def explain(self) -> str:
        """A table of the pipeline: per pass, node count, collectives (count and bytes by kind), time."""
        compiled = self._compiled()
        return explain_table(compiled, self.config)

    def dump(self, directory: str | os.PathLike) -> list[str]:
        """Write every graph of the last variant as readable Python into ``directory``; returns the paths."""
        return dump_graphs(self.graphs, directory)


def _binding_key(modules: list, optimizers: list) -> tuple:
    return (
        tuple(id(m) for _, m in modules),
        tuple((id(o), tuple(tuple(id(p) for p in g["params"]) for g in o.param_groups)) for _, o in optimizers),
    )


def _memory(t: Tensor) -> tuple[int, int, int]:
    """``(storage, first byte, end byte)`` a tensor's elements occupy."""
    size = t.element_size()
    extent = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()) if n > 0) + 1
    start = t.storage_offset() * size
    return t.untyped_storage().data_ptr(), start, start + extent * size


def _unalias(outputs: list, inputs: list, updated_inputs: frozenset[int] = frozenset()) -> None:
    """Outputs whose memory overlaps an input's or another output's are cloned, so no two pieces of state ever
    share elements (except ``updated_inputs``: a state's own input, updated in place). Disjoint views of one
    buffer (a bucket's results) keep sharing it."""
    taken: dict[int, list[tuple[int, int]]] = {}

    def overlaps(t: Tensor) -> bool:
        storage, start, end = _memory(t)
        return any(start < e and s < end for s, e in taken.get(storage, ()))

    def take(t: Tensor) -> None:
        storage, start, end = _memory(t)
        taken.setdefault(storage, []).append((start, end))

    for t in inputs:
        if isinstance(t, Tensor) and t.numel():
            take(t)
    for i, value in enumerate(outputs):
        if i in updated_inputs or not isinstance(value, Tensor) or not value.numel():
            continue
        if overlaps(value):
            outputs[i] = value = value.clone()
        take(value)


def distribute(config: Config | None = None, **overrides: Any) -> Callable[[Callable], DistributedStep]:
    """Decorator: compile a training step with zgraph.

    ``@zgraph.distribute(zgraph.Config(stage=3))``, ``@zgraph.distribute(stage=3)`` or both (keywords
    override the config's fields).
    """
    if config is not None and not isinstance(config, Config):
        if callable(config) and not overrides:
            raise TypeError("use @zgraph.distribute() (with parentheses) or @zgraph.distribute(zgraph.Config(...))")
        raise ValueError(f"distribute(config=...) expects a zgraph.Config, got {type(config).__name__}")
    config = config or Config()
    if overrides:
        config = config.replace(**overrides)

    def decorate(fn: Callable) -> DistributedStep:
        return DistributedStep(fn, config)

    return decorate
