"""``@zgraph.distribute``: the object that replaces the user's training step.

On a call it hands the call (``zgraph.binding.arguments.StepCall``: the arguments bound to the step's signature
once) to its ``zgraph.dispatch.Dispatcher``, which binds the state the step uses, looks up a compiled graph by a
guard key (shapes, dtypes, structure, requires_grad, grad mode, training flags, optimizer structure), captures,
transforms and compiles on a miss, then runs the graph and writes the new state back into the modules and
optimizers. Inspection (``graphs``, ``explain``, ``dump``) reads the last call's variant; ``estimate`` plans a
call without running it (``zgraph.inspect.estimate``).
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
import torch.fx as fx

from zgraph.binding.arguments import StepCall
from zgraph.binding.host_layout import layout_lines
from zgraph.compile.variant import CompiledStep
from zgraph.config import Config
from zgraph.config_checks import budget_bytes
from zgraph.dispatch import Dispatcher
from zgraph.inspect.budget import MemoryPlan, plan_for_sizes, plan_memory
from zgraph.inspect.budget_sizes import at_shapes, grown, planned_shapes
from zgraph.inspect.estimate import Estimate, estimate_step
from zgraph.inspect.explain import dump_graphs, explain_table


class DistributedStep:
    """A training step compiled by zgraph; call it like the original function.

    Attributes:
        config: the ``zgraph.Config`` it was built with.
        process_group: the group its collectives run on (None: the default group, or one process).
        memory_plan: with ``Config.memory_budget``, what the planner chose for the largest argument sizes so far
            (a ``zgraph.inspect.budget.MemoryPlan``; its ``config(step.config)`` is the config that runs); else None.
    """

    def __init__(self, fn: Callable, config: Config, process_group: dist.ProcessGroup | None = None):
        functools.update_wrapper(self, fn)
        self.config = config
        self.process_group = process_group
        self.memory_plan: MemoryPlan | None = None
        self._planned_shapes: dict[str, tuple[int, ...]] = {}  # the argument shapes the memory plan is for
        self._dispatch = Dispatcher(config, process_group)

    def __get__(self, instance: object, owner: type | None = None) -> DistributedStep | types.MethodType:
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __call__(self, *args: object, **kwargs: object) -> object:
        call = StepCall.of(self.__wrapped__, args, kwargs)
        if self.config.memory_budget is not None:
            self._plan(call)
        return self._dispatch(call)

    def _plan(self, call: StepCall) -> None:
        """Plan for the largest argument sizes so far (``zgraph.inspect.budget_sizes``): on the first call, and
        again, with a warning, on a call larger in some dim. The dispatcher changes only where the plan does; the
        budget ``"auto"`` resolves to bytes once (a later plan is one rank's own, with no collective)."""
        larger = grown(call, self._planned_shapes) if self.memory_plan is not None else []
        if self.memory_plan is not None and not larger:
            return
        shapes = planned_shapes(call, self._planned_shapes)
        world = dist.get_world_size(self.process_group) if dist.is_initialized() else None
        budget = self.config.memory_budget if self.memory_plan is None else self.memory_plan.budget
        plan = plan_memory(at_shapes(call, shapes), self.config, budget, world, process_group=self.process_group)
        if larger:
            warnings.warn(
                f"zgraph: step `{call.name}`'s memory plan was made for smaller arguments than this call's "
                f"({'; '.join(larger)}); planned again for the largest sizes so far: {plan.chosen.describe()}. "
                "Mark the dims with zgraph.mark_dynamic(t, dim, max=...) to plan once for the largest.",
                stacklevel=3,
            )
        config = plan.config(self.config)
        if config != self._dispatch.config:
            dispatch = Dispatcher(config, self.process_group)
            dispatch.dynamic = self._dispatch.dynamic  # the dims already found symbolic stay so
            self._dispatch = dispatch
        self.memory_plan, self._planned_shapes = plan, shapes

    # ------------------------------------------------------------------------------------------ inspection
    def _compiled(self) -> CompiledStep:
        if self._dispatch.last is None:
            raise RuntimeError("the step has not been called yet: graphs exist after the first call")
        return self._dispatch.last

    @property
    def graphs(self) -> OrderedDict[str, fx.GraphModule]:
        """The graphs of the last call's variant: ``captured``, one per pass, then ``final``."""
        return self._compiled().graphs()

    def explain(self) -> str:
        """A table of the pass list: per pass, node count, collectives (count and bytes by kind), time."""
        table = explain_table(self._compiled(), self._dispatch.config)
        table = "\n".join([table, *layout_lines(self._dispatch.asked, self._dispatch.config)])
        return table if self.memory_plan is None else "\n".join([table, *self.memory_plan.lines()])

    def dump(self, directory: str | os.PathLike) -> list[str]:
        """Write every graph of the last variant as readable Python into ``directory``; returns the paths."""
        return dump_graphs(self.graphs, directory)

    def estimate(
        self,
        *args: object,
        world_size: int | None = None,
        device: str | torch.device | None = None,
        memory_budget: int | str | None = None,
        ranks_per_node: int | None = None,
        inter_node_gbps: float | None = None,
        sizes: Mapping[str | tuple[str, int], int] | None = None,
        **kwargs: object,
    ) -> Estimate | MemoryPlan:
        """Memory and communication per rank of calling the step with these arguments on ``world_size`` ranks
        (None: the current world) with the state on ``device`` (``"cpu"``, ``"cuda"``; None: the parameters'
        device), without running it: captured and transformed on meta stand-ins of the modules and optimizers
        among the arguments; the real ones, and this step's caches, stay as they are. ``world_size``, ``device``,
        ``memory_budget``, ``ranks_per_node`` and ``inter_node_gbps`` are the estimate's own keywords, never passed
        to the step. See ``zgraph.Estimate``.

        ``ranks_per_node`` (consecutive ranks per node; None: torchrun's ``LOCAL_WORLD_SIZE``, else one node) says
        which groups cross nodes: their collectives are priced at ``inter_node_gbps`` (Gbit/s per rank; None: the
        cost model's default) and counted in ``Estimate.link_bytes["inter_node"]``.

        ``memory_budget`` (bytes per rank, ``"12GiB"``, ``"auto"``): returns the ``MemoryPlan`` the planner makes
        for that budget instead (``plan.chosen.estimate`` is the chosen config's estimate). Without it, a step whose
        config has a ``memory_budget`` is estimated as planned.

        Arguments marked with ``zgraph.mark_dynamic`` are traced with those sizes as symbols: the estimate is at
        ``sizes`` (by symbol name or ``(argument path, dim)``; the others at the call's sizes) and carries the
        peak and activation bytes as formulas in the symbols (``Estimate.peak_formula``, ``size_symbols``);
        with ``memory_budget``, the plan is for ``sizes``.

        A call the step has made with the same guard key (sizes, dtypes, state) is not traced again: the estimate
        copies the step's own capture where it is the graph it would trace (``zgraph.inspect.reuse``).

        A pipelined step (``Config.pipeline_parallel``) is estimated per stage and rank: ``Estimate.stages`` and
        ``Estimate.bubble`` (``zgraph.inspect.pipeline_estimate``); ``memory_budget`` plans it per rank."""
        call = StepCall.of(self.__wrapped__, args, kwargs)
        config = self.config
        held = self._dispatch.held_capture(call)  # the step's own capture of this call, copied where it serves
        if memory_budget is not None:
            return plan_for_sizes(call, config, budget_bytes(memory_budget), sizes or {}, world_size, device, held=held)
        if config.memory_budget is not None:
            plan = plan_for_sizes(call, config, config.memory_budget, sizes or {}, world_size, device, held=held)
            config = plan.config(config)
        links = {"ranks_per_node": ranks_per_node, "inter_node_gbps": inter_node_gbps}
        return estimate_step(call, config, world_size, device=device, sizes=sizes, held=held, **links)


def distribute(
    config: Config | None = None, *, process_group: dist.ProcessGroup | None = None, **overrides: object
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
