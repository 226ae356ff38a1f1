"""What a step remembers between calls about the state it uses, and what one call binds.

A step's modules and optimizers are found in its arguments, closure and globals (``zgraph.binding.guards``) and
bound once per set (``zgraph.binding.setup``); those a trace reached that discovery missed are observed and bound
from the next capture on. Tensors read outside the arguments are located (``zgraph.binding.locate``) and read on
every call. ``Session.bind`` turns a call into a ``Bound``: its binding, located tensors and user tensors, from
which the capture request is made; ``Session.more_to_bind`` is what the capture protocol asks after each trace.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from zgraph.binding.arguments import StepCall
from zgraph.binding.guards import binding_key, discover, guard_key, named_objects
from zgraph.binding.locate import Locator, locate
from zgraph.binding.setup import bind_state
from zgraph.capture.captured import CaptureRequest, Traced
from zgraph.capture.optimizers import settle_first_state
from zgraph.config import Config
from zgraph.errors import CaptureError
from zgraph.runtime.agreement import Channel
from zgraph.runtime.devices import allocation_device, state_device
from zgraph.runtime.process_group import ProcessGroupInfo
from zgraph.runtime.sharded_state import adopt_sharded_parameters, current_parameter
from zgraph.runtime.state import Binding, state_tensors
from zgraph.tree import Slot, iter_leaves

Located = list[tuple[str, Slot, Tensor]]


@dataclass(frozen=True)
class Bound:
    """One call bound: its state's binding, the located tensors (``(path, slot, tensor)``) as they are in this
    call, and the step's own tensors (arguments' tensor leaves, then located ones) that are not bound state."""

    call: StepCall
    binding: Binding
    located: Located
    user_tensors: list[tuple[str, Tensor]]

    def guard_key(self, dynamic: Mapping[str, Collection[int]] | None = None) -> tuple:
        """The key of the compiled variants this call may run (``zgraph.binding.guards.guard_key``); ``dynamic``:
        the symbolic dims of argument tensors by path."""
        return guard_key(self.binding, self.call.arguments, [t for _, _, t in self.located], dynamic)

    def request(self, config: Config, dynamic: Mapping[str, Collection[int]] | None = None) -> CaptureRequest:
        """What the capture of this call traces; first-step optimizer state is sharded and offloaded as made;
        ``dynamic``: the user tensors' dims traced as symbolic sizes, by path. A pipelined step's state released
        on this rank (``zgraph.runtime.stage_state``) is traced as the device's, as the ranks holding it trace it."""
        call = self.call
        swaps = [(slot, t) for _, slot, t in self.located]
        settle = settle_first_state(self.binding, config)
        return CaptureRequest(
            fn=call.fn,
            args=call.args,
            kwargs=call.kwargs,
            binding=self.binding,
            user_tensors=self.user_tensors,
            config=config,
            swaps=swaps,
            settle=settle,
            dynamic=dict(dynamic or {}),
            meta_as=self.binding.device if self.binding.holders else None,  # other stages' state, released to meta
        )


def user_tensors(binding: Binding, call: StepCall, located: Located = ()) -> list[tuple[str, Tensor]]:
    """The tensors the step reads that are not bound state: its arguments' tensor leaves, then the located
    tensors."""
    out = []
    seen: set[int] = set()
    leaves = [leaf for name, value in call.arguments for leaf in iter_leaves(value, name)]
    for path, leaf in [*leaves, *((path, t) for path, _, t in located)]:
        if not isinstance(leaf, Tensor) or id(leaf) in seen:
            continue
        seen.add(id(leaf))
        if binding.param_index(leaf) is None and binding.buffer_index(leaf) is None:
            out.append((path, leaf))
    return out


class Session:
    """What a step remembers between calls: its bindings, the objects traces reached, located tensors."""

    def __init__(self, config: Config):
        self.config = config
        self.bindings: dict[tuple, Binding] = {}
        self.observed: list[tuple[str, object]] = []  # modules / optimizers the step reached that discovery missed
        self.locators: list[Locator] = []  # where the tensors it reads outside its arguments live
        self.searched: set[int] = set()  # bindings whose requires-grad tensors have been located
        self.device: torch.device | None = None  # the device of the state the step last bound

    def device_of(self, call: StepCall) -> torch.device:
        """The device of the state the call would bind (for starting a process group)."""
        device = state_device(state_tensors(Binding(*discover(call, self.observed))))
        return allocation_device(None) if device.type == "meta" else device

    def bind(self, call: StepCall, group: ProcessGroupInfo, channel: Channel | None) -> Bound:
        """Bind the call's state (collective where ``channel`` is given, on its first binding) and locate what
        it reads outside its arguments."""
        modules, optimizers = discover(call, self.observed)
        adopt_sharded_parameters([opt for _, opt in optimizers])
        binding = self.bindings.get(binding_key(modules, optimizers))
        if binding is None:
            binding = bind_state(self.config, group, channel, modules, optimizers)
            self.device = binding.device
            # keyed after binding: stage 3 replaced the parameters the optimizers hold by their sharded versions
            self.bindings[binding_key(modules, optimizers)] = binding
        if id(binding) not in self.searched:
            self.searched.add(id(binding))
            # tensors that require grad, read outside the arguments: located before the first trace, so
            # autograd never sees the real tensor (it would leave a traced .grad on it)
            self._add_locators(binding, call, lambda t: t.requires_grad)
        located = self._located(call)
        return Bound(call, binding, located, user_tensors(binding, call, located))

    def bound_as_is(self, call: StepCall) -> Bound | None:
        """The call bound as the next call would bind it, where that changes nothing: its state bound already and
        no tensors located outside its arguments; else None (an estimate then captures on its own)."""
        if self.locators:
            return None
        binding = self.bindings.get(binding_key(*discover(call, self.observed)))
        if binding is None:
            return None
        return Bound(call, binding, [], user_tensors(binding, call))

    def more_to_bind(self, bound: Bound) -> Callable[[Traced], str | None]:
        """What the capture protocol asks after each trace of ``bound``'s call: the modules and optimizers it
        reached, or the frozen tensors zgraph can locate (observed or located: bound from the next capture on)."""

        def found(traced: Traced) -> str | None:
            if traced.unbound is not None:
                self._observe(bound.call, [*traced.unbound.modules, *traced.unbound.optimizers])
                return f"modules / optimizers reached while tracing: {self.observed}"
            return self._check_constants(bound, traced.constants)

        return found

    def _located(self, call: StepCall) -> Located:
        """``(path, slot, tensor)`` of the located tensors as they are in this call.

        A located parameter that stage 3 replaced by its sharded version (a plain-object optimizer's list of
        ``model.parameters()``) is replaced in its place too, as ``torch.optim`` optimizers' are: the step then
        reads and updates the parameter the module uses."""
        out = []
        for locator in self.locators:
            slot = locator.resolve(call.fn, dict(call.arguments))
            value = slot.get() if slot is not None else None
            if slot is not None and isinstance(value, Tensor):
                current = current_parameter(value)
                if current is not value:
                    slot.set(current)
                out.append((locator.path, slot, current))
        return out

    def _add_locators(self, binding: Binding, call: StepCall, wanted: Callable[[Tensor], bool]) -> list[Locator]:
        """Locate the tensors ``wanted`` accepts (``zgraph.binding.locate``) and remember the new places."""
        known = {loc.path for loc in self.locators}
        found = locate(wanted, call.fn, dict(call.arguments), binding.modules).values()
        new = [loc for loc in found if loc.path not in known]
        self.locators.extend(new)
        return new

    def _check_constants(self, bound: Bound, constants: Sequence[Tensor]) -> str | None:
        """Capture froze ``constants`` into the graph. Those zgraph can locate become inputs read on every call
        (returns what was found: capture again); a parameter, buffer or tensor that requires grad it cannot
        locate is an error: its gradient or updates would be lost."""
        binding = bound.binding
        already = {id(t) for _, _, t in self._located(bound.call)}
        frozen = {id(t) for t in constants} - already
        found = self._add_locators(binding, bound.call, lambda t: id(t) in frozen)
        if found:
            return f"tensors read outside the arguments: {', '.join(loc.path for loc in found)}"
        for t in constants:
            index = binding.param_index(t)
            if id(t) not in already and (t.requires_grad or index is not None or binding.buffer_index(t) is not None):
                what = f"parameter {binding.params[index].name}" if index is not None else "a tensor"
                raise CaptureError(
                    f"the step reads {what} of shape {tuple(t.shape)} ({t.dtype}"
                    f"{', requires_grad' if t.requires_grad else ''}) from a place zgraph cannot swap a traced "
                    "value into (inside a tuple, or an object it does not search), so it would be frozen into the "
                    "graph and its gradient or updates lost. Pass it to the step as an argument, or make it an "
                    "nn.Parameter or buffer of a module the step uses."
                )
        return None

    def _observe(self, call: StepCall, reached: list[object]) -> None:
        """Remember the modules and optimizers a trace reached (bound from the next capture on), each named
        after where the step's code holds it, else after its class."""
        known = {id(obj) for _, obj in self.observed}
        roots = named_objects(call)
        for obj in reached:
            if id(obj) not in known:
                known.add(id(obj))
                self.observed.append((roots.get(id(obj), type(obj).__name__.lower()), obj))
