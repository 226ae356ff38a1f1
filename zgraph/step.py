"""``@zgraph.distribute``: the object that replaces the user's training step.

On a call it finds the modules and optimizers the step uses, looks up a compiled graph by a guard key (shapes,
dtypes, structure, requires_grad, grad mode, training flags, optimizer structure), captures, transforms and
compiles on a miss, then runs the graph and writes the new state back into the modules and optimizers.

Discovery and guard keys live in ``zgraph.binding.guards``; a compiled variant, its lowering for the backend and running
it against the live state in ``zgraph.compile.variant``. This module binds state and decides: when a trace finds state
to bind first (``zgraph.capture.trace.Traced``), the call binds it and captures again, up to ``_MAX_REBINDS`` times.
"""

from __future__ import annotations

import functools
import os
import time
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from zgraph.binding.guards import (
    KEY_PARTS,
    binding_key,
    bound_arguments,
    describe_leaf,
    discover,
    guard_key,
    named_objects,
)
from zgraph.binding.locate import Locator, Slot, locate
from zgraph.binding.setup import bind_state
from zgraph.capture import update_rules as zopt
from zgraph.capture.environment import traced_arguments
from zgraph.capture.joint import needs_split, trace_joint
from zgraph.capture.optimizers import create_first_state, drop_state, first_state_candidates, settle_first_state
from zgraph.capture.trace import CapturedGraph, UnboundState, finish, trace_step
from zgraph.compile.split_runner import Peers, lower_split, run_split
from zgraph.compile.variant import CompiledStep, lower, pass_context, reserve_offload, run
from zgraph.config import Config
from zgraph.errors import CaptureError
from zgraph.graph import input_specs, output_roles
from zgraph.inspect.estimate import Estimate, estimate_step
from zgraph.inspect.explain import dump_graphs, explain_table
from zgraph.passes import build_pipeline, default_pipeline, run_pipeline
from zgraph.runtime.agreement import Channel, is_collective_failure, mark_broken
from zgraph.runtime.consistency import check_same_graph, describe_collectives, describe_graph, digest
from zgraph.runtime.devices import control_device, state_device
from zgraph.runtime.process_group import (
    ProcessGroupInfo,
    ensure_process_group,
    timed_group,
)
from zgraph.runtime.sharded_state import (
    adopt_sharded_parameters,
    current_parameter,
)
from zgraph.runtime.state import Binding, state_tensors
from zgraph.tree import iter_leaves


class DistributedStep:
    """A training step compiled by zgraph; call it like the original function.

    Attributes:
        config: the ``zgraph.Config`` it was built with.
        process_group: the group its collectives run on (None: the default group, or one process).
    """

    def __init__(self, fn: Callable, config: Config, process_group: Any = None):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.config = config
        self.process_group = process_group
        self._pipeline = build_pipeline(
            default_pipeline(**config.pipeline_options()), config.disable_passes, config.extra_passes
        )
        self._bindings: dict[tuple, Binding] = {}
        self._cache: dict[tuple, CompiledStep] = {}
        self._last: CompiledStep | None = None
        self._observed: list[tuple[str, Any]] = []  # modules / optimizers the step reached that discovery missed
        self._locators: list[Locator] = []  # where the tensors it reads outside its arguments live
        self._searched: set[int] = set()  # bindings whose requires-grad tensors have been located
        self._calls = 0  # calls made, for naming the call in errors other ranks see
        self._failed = False  # the last call raised (its failure record is cleared by the next good call)
        self._device: torch.device | None = None  # the device of the state the step last bound

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return types.MethodType(self, instance)

    # -------------------------------------------------------------------------------------------- calling
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if traced_arguments(args, kwargs):
            raise CaptureError(
                f"zgraph step `{getattr(self._fn, '__qualname__', self._fn)}` was called from inside another zgraph "
                "step while that one was being captured; steps do not nest. Call the inner step's undecorated "
                "function there (`inner.__wrapped__`), or call the two steps one after the other."
            )
        group = ensure_process_group(self.process_group, lambda: self._device_of(args, kwargs))
        label = f"call {self._calls} of step `{getattr(self._fn, '__qualname__', self._fn)}`"
        self._calls += 1
        if not group.distributed:
            return self._call(args, kwargs, None, group, label)
        channel = Channel(group, self.config.collective_timeout)
        try:
            result = self._call(args, kwargs, channel, group, label)
        except Exception as error:
            if not getattr(error, "_zgraph_recorded", False):
                channel.record_failure(label, error)
            self._failed = True
            raise
        if self._failed:
            channel.clear_failure()
            self._failed = False
        return result

    def _call(self, args: tuple, kwargs: dict, channel: Channel | None, group: ProcessGroupInfo, label: str) -> Any:
        """One call: bind, look up or capture, agree with the other ranks on the graph, run it."""
        if channel is not None:
            channel.enter(label)
            group = timed_group(group, self.config.collective_timeout, lambda: channel.exchange(f"{label} (set-up)"))
        try:
            compiled, binding, user_tensors = self._prepare(args, kwargs, group, channel)
        except Exception as error:
            if channel is None:
                raise
            channel.record_failure(label, error)
            error._zgraph_recorded = True
            device = control_device(group.backend, self._device)
            check_same_graph(channel, group.group_name, label, 0, [], error, device)  # tell the others; re-raises
            raise
        if channel is not None:
            device = control_device(group.backend, binding.device)
            check_same_graph(channel, group.group_name, label, compiled.digest, compiled.description, device=device)
        self._last = compiled
        try:
            if compiled.split is not None:
                peers = None if channel is None else Peers(channel, group.group_name, device, label)
                return run_split(
                    compiled, binding, user_tensors, getattr(self._fn, "__qualname__", str(self._fn)), peers
                )
            return run(compiled, binding, user_tensors)
        except Exception as error:
            if channel is None:
                raise
            failures = channel.failures(wait=0.0)
            if failures or is_collective_failure(error):
                raise channel.peer_failure(label, error) from error
            mark_broken(channel.group, f"rank {channel.rank} failed in {label}: {type(error).__name__}: {error}")
            raise

    def _prepare(
        self, args: tuple, kwargs: dict, group: ProcessGroupInfo, channel: Channel | None
    ) -> tuple[CompiledStep, Binding, list]:
        """The compiled variant for these arguments (captured now if there is none), its binding and the
        step's own tensors."""
        schedulers_stepped = False
        for attempt in range(_MAX_REBINDS + 1):
            binding = self._binding(args, kwargs, group, channel)
            if id(binding) not in self._searched:
                self._searched.add(id(binding))
                # tensors that require grad, read outside the arguments: located before the first trace, so
                # autograd never sees the real tensor (it would leave a traced .grad on it)
                self._add_locators(binding, args, kwargs, lambda t: t.requires_grad)
            located = self._located(binding, args, kwargs)
            user_tensors = self._user_tensors(binding, args, kwargs, located)
            arguments = bound_arguments(self._fn, args, kwargs)
            key = guard_key(binding, arguments, [t for _, _, t in located])
            compiled = self._cache.get(key)
            if compiled is not None:
                if not schedulers_stepped:
                    schedulers_stepped = True
                    if self._step_schedulers_first(compiled):
                        continue
                break
            compiled = self._compile(binding, args, kwargs, user_tensors, located)
            if isinstance(compiled, str):  # the trace found state to bind first: bind it, capture again
                if attempt == _MAX_REBINDS:
                    raise CaptureError(f"zgraph could not bind the state the step uses: {compiled}")
                continue
            key = guard_key(binding, arguments, [t for _, _, t in located])
            self._warn_if_recaptured_often(key)
            self._cache[key] = compiled
            if not schedulers_stepped:
                schedulers_stepped = True
                if self._step_schedulers_first(compiled):
                    continue
            break
        store = getattr(binding, "offload", None)
        if store is not None:
            reserve_offload(compiled, store)  # a full disk is reported here, where every rank hears of it
        return compiled, binding, user_tensors

    def _warn_if_recaptured_often(self, key: tuple) -> None:
        """Warn once when the step has been captured ``_RECAPTURE_WARNING`` times for the same state, naming what
        changed since the previous capture: each capture traces (and compiles) the whole step."""
        same_state = [k for k in self._cache if k[0] == key[0]]
        if len(same_state) + 1 != _RECAPTURE_WARNING:
            return
        previous = same_state[-1]
        part = next(i for i, (a, b) in enumerate(zip(previous, key)) if a != b)
        why = KEY_PARTS[part]
        if part == KEY_PARTS.index("an argument"):
            changed = [(p, a, b) for (p, a), (_, b) in zip(previous[part], key[part]) if a != b]
            if changed:
                path, before, after = changed[0]
                why = f"argument `{path}` changed from {describe_leaf(before)} to {describe_leaf(after)}"
        warnings.warn(
            f"zgraph: `{getattr(self._fn, '__qualname__', self._fn)}` has been captured {_RECAPTURE_WARNING} times; "
            f"the last time because {why}. Every capture traces and compiles the whole step again. Python numbers "
            "and objects among the arguments are part of the graph (pass numbers that change as tensors), and an "
            "optimizer zgraph has no kernel for (other than SGD, Adam, AdamW) is traced with its hyper-parameters "
            "as constants, so a changing learning rate recaptures it.",
            RuntimeWarning,
            stacklevel=3,
        )

    @staticmethod
    def _step_schedulers_first(compiled: CompiledStep) -> bool:
        """Step the LR schedulers the user's step steps before its optimizer's ``step()``, as eager would at
        that point (the graph then reads the new learning rates). True if an optimizer traced as written (no
        zgraph kernel: its hyper-parameters are constants of the graph, part of the guard key) reads them: the
        graph must then be looked up, or traced, again."""
        first = [scheduler for scheduler, before_update in compiled.captured.scheduler_steps if before_update]
        for scheduler in first:
            scheduler.step()
        return any(zopt.kernel_for(scheduler.optimizer) is None for scheduler in first)

    def _device_of(self, args: tuple, kwargs: dict) -> torch.device:
        """The device of the state the step's call would bind (for starting a process group)."""
        return state_device(state_tensors(Binding(*discover(self._fn, args, kwargs, self._observed))))

    def _binding(self, args: tuple, kwargs: dict, group: ProcessGroupInfo, channel: Channel | None) -> Binding:
        modules, optimizers = discover(self._fn, args, kwargs, self._observed)
        adopt_sharded_parameters([opt for _, opt in optimizers])
        binding = self._bindings.get(binding_key(modules, optimizers))
        if binding is None:
            binding = bind_state(self.config, group, channel, modules, optimizers)
            self._device = binding.device
            self._bindings[binding_key(modules, optimizers)] = binding
        return binding

    def _located(self, binding: Binding, args: tuple, kwargs: dict) -> list[tuple[str, Slot, Tensor]]:
        """``(path, slot, tensor)`` of the located tensors (see ``zgraph.binding.locate``) as they are in this call.

        A located parameter that stage 3 replaced by its sharded version (a plain-object optimizer's list of
        ``model.parameters()``) is replaced in its place too, as ``torch.optim`` optimizers' are: the step then
        reads and updates the parameter the module uses."""
        arguments = dict(bound_arguments(self._fn, args, kwargs))
        out = []
        for locator in self._locators:
            slot = locator.resolve(self._fn, arguments)
            value = slot.get() if slot is not None else None
            if isinstance(value, Tensor):
                current = current_parameter(value)
                if current is not value:
                    slot.set(current)
                out.append((locator.path, slot, current))
        return out

    def _user_tensors(
        self, binding: Binding, args: tuple, kwargs: dict, located: Sequence[tuple[str, Slot, Tensor]] = ()
    ) -> list[tuple[str, Tensor]]:
        """The tensors the step reads that are not bound state: its arguments' tensor leaves, then the located
        tensors."""
        out = []
        seen: set[int] = set()
        leaves = [leaf for name, value in bound_arguments(self._fn, args, kwargs) for leaf in iter_leaves(value, name)]
        for path, leaf in [*leaves, *((path, t) for path, _, t in located)]:
            if not isinstance(leaf, Tensor) or id(leaf) in seen:
                continue
            seen.add(id(leaf))
            if binding.param_index(leaf) is None and binding.buffer_index(leaf) is None:
                out.append((path, leaf))
        return out

    def _add_locators(self, binding: Binding, args: tuple, kwargs: dict, wanted: Callable) -> list[Locator]:
        """Locate the tensors ``wanted`` accepts (``zgraph.binding.locate``) and remember the new places."""
        arguments = dict(bound_arguments(self._fn, args, kwargs))
        known = {loc.path for loc in self._locators}
        new = [loc for loc in locate(wanted, self._fn, arguments, binding.modules).values() if loc.path not in known]
        self._locators.extend(new)
        return new

    def _check_constants(self, binding: Binding, args: tuple, kwargs: dict, constants: list[Tensor]) -> str | None:
        """Capture froze ``constants`` into the graph. Those zgraph can locate become inputs read on every call
        (returns what was found: capture again); a parameter, buffer or tensor that requires grad it cannot
        locate is an error: its gradient or updates would be lost."""
        already = {id(t) for _, _, t in self._located(binding, args, kwargs)}
        frozen = {id(t) for t in constants} - already
        found = self._add_locators(binding, args, kwargs, lambda t: id(t) in frozen)
        if found:
            return f"tensors read outside the arguments: {', '.join(loc.path for loc in found)}"
        for t in constants:
            if id(t) in already:
                continue
            index = binding.param_index(t)
            if t.requires_grad or index is not None or binding.buffer_index(t) is not None:
                what = f"parameter {binding.params[index].name}" if index is not None else "a tensor"
                raise CaptureError(
                    f"the step reads {what} of shape {tuple(t.shape)} ({t.dtype}"
                    f"{', requires_grad' if t.requires_grad else ''}) from a place zgraph cannot swap a traced "
                    "value into (inside a tuple, or an object it does not search), so it would be frozen into the "
                    "graph and its gradient or updates lost. Pass it to the step as an argument, or make it an "
                    "nn.Parameter or buffer of a module the step uses."
                )
        return None

    def _capture(
        self, binding: Binding, args: tuple, kwargs: dict, user_tensors: list, located: Sequence
    ) -> CapturedGraph | str:
        """Trace the step and finish its graph; or, when the trace found state zgraph must bind first (modules,
        optimizers, tensors read outside the arguments), bind it and return what it found.

        A first optimizer step's state is created for real, as torch.optim creates it, and traced as graph
        inputs. It is guessed first (every parameter that requires grad gets a gradient) and created before the
        trace: when the step updates all of it, that one trace is the step's. Otherwise (or when the trace
        fails, or finds more to bind) the guessed state is removed again, and the step traced without it, its
        first step's state created from what that trace created, and traced once more with it."""
        materialized = guess = False
        swaps = [(slot, t) for _, slot, t in located]
        while True:
            guessed = self._guess_first_state(binding) if not (guess or materialized) else []
            guess = True
            try:
                traced = trace_step(self._fn, args, kwargs, binding, user_tensors, self.config, swaps)
                if traced.unbound is not None:
                    self._observe(traced.unbound, args, kwargs)
                    found = f"modules / optimizers reached while tracing: {self._observed}"
                else:
                    found = self._check_constants(binding, args, kwargs, traced.constants)
            except BaseException:
                drop_state(binding, guessed)
                raise
            if found is not None:  # more to bind first: the state as it was
                drop_state(binding, guessed)
                return found
            if not set(guessed) <= set(traced.captured.updated_state):
                drop_state(binding, guessed)  # a parameter got no gradient: trace again without the guess
                continue
            if not materialized and traced.captured.created_state:
                materialized = True
                if self._materialize_created_state(binding, traced.captured):
                    continue
            if needs_split(traced):  # outputs with a grad_fn: trace forward + backward from tangents
                traced = trace_joint(self._fn, args, kwargs, binding, user_tensors, self.config, swaps, traced)
            return finish(traced)

    def _compile(
        self, binding: Binding, args: tuple, kwargs: dict, user_tensors: list, located: Sequence = ()
    ) -> CompiledStep | str:
        """Capture, transform and compile the step; or what the trace found to bind first (see ``_capture``)."""
        start = time.perf_counter()
        captured = self._capture(binding, args, kwargs, user_tensors, located)
        if isinstance(captured, str):
            return captured
        capture_seconds = time.perf_counter() - start
        if captured.python_results:
            shown = ", ".join(f"{path} = {value!r}" for path, value in captured.python_results[:3])
            warnings.warn(
                f"zgraph: `{getattr(self._fn, '__qualname__', self._fn)}` returns Python numbers ({shown}"
                f"{', ...' if len(captured.python_results) > 3 else ''}): they were computed once, when the step "
                "was captured, and every call returns them unchanged. Return tensors (they are computed on every "
                "call), or read Python values such as the learning rate after the call.",
                RuntimeWarning,
                stacklevel=3,
            )
        ctx = pass_context(binding)
        records = run_pipeline(captured.gm, ctx, self._pipeline)
        transformed = records[-1].gm if records else captured.gm
        split = None
        if captured.split is not None:
            split = lower_split(transformed, ctx, self.config.backend, captured.split)
            backend_records, executable = split.forward_records, split.forward
        else:
            backend_records, executable = lower(transformed, ctx, self.config.backend)
        final = backend_records[-1].gm
        description = describe_graph(captured.gm) + describe_collectives(transformed)
        return CompiledStep(
            captured,
            records,
            executable,
            capture_seconds,
            input_specs(final),
            output_roles(final),
            description,
            digest(description),
            binding.cost_model,
            backend_records,
            ctx.params,
            split,
        )

    def _guess_first_state(self, binding: Binding) -> list[tuple[int, int]]:
        """Create the state a first optimizer step would create if every parameter that requires grad got a
        gradient (as ``_materialize_created_state`` does); the ``(optimizer, param)`` pairs created."""
        guessed = first_state_candidates(binding)
        if guessed:
            create_first_state(
                binding, guessed, self.config.optimizer_state_dtype, settle_first_state(binding, self.config)
            )
        return guessed

    def _materialize_created_state(self, binding: Binding, captured: CapturedGraph) -> bool:
        """Create, eagerly and exactly as torch.optim would, the optimizer state a first step creates; True if
        any was created (the step is then captured again with that state as inputs)."""
        created = captured.created_state
        settle = settle_first_state(binding, self.config)
        return create_first_state(binding, created, self.config.optimizer_state_dtype, settle)

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

    def estimate(
        self, *args: Any, world_size: int | None = None, device: str | torch.device | None = None, **kwargs: Any
    ) -> Estimate:
        """Memory and communication per rank of calling the step with these arguments on ``world_size`` ranks
        (None: the current world) with the state on ``device`` (``"cpu"``, ``"cuda"``; None: the parameters'
        device), without running it: captured and transformed on meta stand-ins of the modules and optimizers
        among the arguments; the real ones, and this step's caches, stay as they are. ``world_size`` and
        ``device`` are the estimate's own keywords, never passed to the step. See ``zgraph.Estimate``."""
        return estimate_step(self, args, kwargs, world_size, device=device)

    def _observe(self, found: UnboundState, args: tuple, kwargs: dict) -> None:
        """Remember the modules and optimizers the trace reached (bound from the next capture on), each named
        after where the step's code holds it, else after its class."""
        known = {id(obj) for _, obj in self._observed}
        roots = named_objects(self._fn, args, kwargs)
        for obj in [*found.modules, *found.optimizers]:
            if id(obj) in known:
                continue
            known.add(id(obj))
            self._observed.append((roots.get(id(obj), type(obj).__name__.lower()), obj))


_MAX_REBINDS = 4


_RECAPTURE_WARNING = 8


def distribute(
    config: Config | None = None, *, process_group: Any = None, **overrides: Any
) -> Callable[[Callable], DistributedStep]:
    """Decorator: compile a training step with zgraph.

    ``@zgraph.distribute(zgraph.Config(stage=3))``, ``@zgraph.distribute(stage=3)`` or both (keywords
    override the config's fields). ``process_group`` (a ``torch.distributed.ProcessGroup``, e.g. from
    ``dist.new_group(ranks)``) runs the step on those ranks only: its parameters are sharded over them and its
    collectives stay inside them, so separate groups of ranks can train separate models (default: the default
    group, as DDP and FSDP).
    """
    if config is not None and not isinstance(config, Config):
        if callable(config) and not overrides:
            raise TypeError("use @zgraph.distribute() (with parentheses) or @zgraph.distribute(zgraph.Config(...))")
        raise ValueError(f"distribute(config=...) expects a zgraph.Config, got {type(config).__name__}")
    config = config or Config()
    if overrides:
        config = config.replace(**overrides)

    def decorate(fn: Callable) -> DistributedStep:
        return DistributedStep(fn, config, process_group)

    return decorate
