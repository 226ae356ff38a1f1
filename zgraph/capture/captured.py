"""What a capture is asked (``CaptureRequest``) and what it returns: one trace's findings (``Traced``) and the
finished step graph (``CapturedGraph``), with what a split step's runner needs (``SplitInfo``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.optim.lr_scheduler import LRScheduler

from zgraph.capture.environment import UnboundState
from zgraph.capture.host_scalars import HostGuards
from zgraph.capture.size_guards import SizeGuards
from zgraph.config import Config
from zgraph.graph import GraphInput, GraphOutput
from zgraph.runtime.state import Binding
from zgraph.tree import Slot


@dataclass(frozen=True, kw_only=True)
class CaptureRequest:
    """One step call to capture, against the state bound for it."""

    fn: Callable
    """The user's step (or, for a split step's joint trace, the step followed by its outputs' backward)."""
    args: tuple
    kwargs: dict
    binding: Binding
    """The modules and optimizers the step uses, bound and laid out (``zgraph.binding``)."""
    user_tensors: list[tuple[str, Tensor]]
    """``(path, tensor)`` of the tensors the step reads that are not bound state: leaves of its arguments, then
    tensors located elsewhere (``zgraph.binding.locate``)."""
    config: Config
    swaps: Sequence[tuple[Slot, Tensor]] = ()
    """``(slot, tensor)``: each slot holds its tensor's traced stand-in while tracing (located tensors)."""
    meta_as: torch.device | None = None
    """Meta tensors stand for tensors on this device (an estimate's stand-ins hold no memory)."""
    settle: Callable[[int, int], None] | None = None
    """Runs on each ``(optimizer, param)`` whose first-step state the capture creates (the step shards and
    offloads it at once: ``zgraph.capture.optimizers.settle_first_state``)."""
    through_compile: bool = False
    """``torch.compile`` wrappers the step reaches are traced through (``zgraph.capture.compiled``): set by the
    capture once a trace stopped at one."""
    dynamic: Mapping[str, Collection[int]] = field(default_factory=dict)
    """Argument path -> the dims of that tensor argument traced as symbolic sizes (``zgraph.capture.inputs``): a
    collection of dims, or a mapping of each to its declared ``(min, max)`` (``zgraph.mark_dynamic``)."""


@dataclass
class SplitInfo:
    """What partitions a split step's joint graph and runs it (``zgraph.capture.joint``).

    Attributes:
        positions: positions (among the step's returned tensors) of the outputs that carry a ``grad_fn``.
        tangents: argument-leaf indices of the tangent inputs, one per position.
        n_user: the step's own user tensors (the tangents follow them).
        grad_inputs: argument-leaf indices of the step's tensors that require grad (their gradients are
            returned by the backward, to flow upstream or land in ``.grad``).
    """

    positions: list[int]
    tangents: list[int]
    n_user: int
    grad_inputs: list[int]


@dataclass
class CapturedGraph:
    """The captured step and what is needed to run it again.

    Attributes:
        gm: the functional graph (see ``zgraph.capture.trace`` for its contract).
        result_template: the step's return value with each graph-returned leaf replaced by ``Returned(i)``.
        none_grads: parameter indices whose ``.grad`` is None after the step.
        none_input_grads: argument-leaf indices whose ``.grad`` is None after the step.
        constant_state: non-tensor optimizer state the step sets: ``(optimizer, param, key, value)``.
        training_flags: ``(module, training)`` to restore where the step called ``train()``/``eval()``.
        created_state: ``(optimizer, param)`` pairs whose state the step created (first optimizer step).
        updated_state: ``(optimizer, param)`` pairs whose state a zgraph optimizer kernel updated.
        optimizers_stepped: indices of optimizers whose ``step()`` the step called.
        scheduler_steps: LR schedulers whose ``step()`` the step called, in call order, each as
            ``(scheduler, before_update)``: they run eagerly around the graph on every call (``before_update``:
            before the graph, so its optimizer update reads the new values, as in eager; else after it).
        python_results: ``(path, value)`` of the Python numbers in the step's return value: computed once, while
            capturing, and returned unchanged by every call.
        grad_outputs: ``(position, shape, dtype, device)`` of the returned tensors that require grad.
        split: set on a split step (``zgraph.capture.joint``): what partitions its joint graph and runs its
            backward.
        host_guards: the conditions the step's Python branches took on values the host knows before each call
            (an optimizer's step counter, its hyper-parameters, a module's 0-d integer buffer such as
            ``AveragedModel.n_averaged``: ``zgraph.capture.host_scalars``); None if none.
        size_guards: the conditions on the symbolic sizes of the step's tensor arguments the graph holds for
            (``zgraph.capture.size_guards``); None if it has no symbolic sizes.
        through_compile: the step reached ``torch.compile`` wrappers and was traced through them
            (``zgraph.capture.compiled``).
    """

    gm: fx.GraphModule | None
    result_template: object
    none_grads: list[int] = field(default_factory=list)
    none_input_grads: list[int] = field(default_factory=list)
    constant_state: list[tuple[int, int, str, object]] = field(default_factory=list)
    training_flags: list[tuple[nn.Module, bool]] = field(default_factory=list)
    created_state: list[tuple[int, int]] = field(default_factory=list)
    updated_state: list[tuple[int, int]] = field(default_factory=list)
    optimizers_stepped: list[int] = field(default_factory=list)
    scheduler_steps: list[tuple[LRScheduler, bool]] = field(default_factory=list)
    python_results: list[tuple[str, int | float]] = field(default_factory=list)
    grad_outputs: list[tuple[int, tuple, torch.dtype, torch.device]] = field(default_factory=list)
    split: SplitInfo | None = None
    host_guards: HostGuards | None = None
    size_guards: SizeGuards | None = None
    through_compile: bool = False

    @property
    def graph(self) -> fx.GraphModule:
        """The functional graph (set once the capture is finished)."""
        if self.gm is None:
            raise AssertionError("the capture is not finished: it has no graph yet")
        return self.gm


class Returned:
    """Stands for the ``position``-th graph-returned leaf in a result template (deliberately not a dataclass:
    templates are walked by ``zgraph.tree``, which would look inside one)."""

    __slots__ = ("position",)

    def __init__(self, position: int):
        self.position = position


@dataclass
class Traced:
    """What one trace of the step found; the capture protocol (``zgraph.capture.protocol``) decides what to do
    with it (bind more state and trace again, create optimizer state and trace again, or finish the graph).

    Attributes:
        unbound: the trace stopped at modules or optimizers zgraph has not bound (the rest is then empty).
        gm: the traced graph, functional, its inputs and outputs not yet named.
        captured: what the trace recorded (``gm`` not set yet; ``created_state``: optimizer state it created).
        constants: real tensors the trace froze into ``gm`` (read from places zgraph did not swap).
        specs, roles: the graph's inputs and outputs (before unchanged state is dropped).
    """

    unbound: UnboundState | None = None
    gm: fx.GraphModule | None = None
    captured: CapturedGraph | None = None
    constants: list[Tensor] = field(default_factory=list)
    specs: list[GraphInput] = field(default_factory=list)
    roles: list[GraphOutput] = field(default_factory=list)
