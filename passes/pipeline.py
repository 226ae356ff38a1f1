"""The pass pipeline: named passes with contracts, run in order, each leaving a graph to inspect.

A pass is ``fn(gm, ctx) -> gm``. It receives its own copy of the previous graph (so it may edit in place) and
returns the graph it produced; the pipeline keeps every pass's output for ``step.graphs``.

Contracts are sets of property names. A pass ``requires`` properties some earlier pass (or capture)
``provides``; the pipeline is checked before anything runs, so a disabled pass another one depends on, or a
user pass placed before what it needs, is an error naming both. Where a property has a checker
(``PROPERTY_CHECKS``), it is verified on the graph of the pass that claims to provide it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from zgraph.errors import PipelineError

# Properties the captured graph has before any pass runs (see zgraph.capture).
CAPTURED_PROPERTIES = frozenset({"functional", "phases", "grad_markers"})


@dataclass(frozen=True)
class ShardSpec:
    """How a tensor of a parameter's shape is split across ranks: along dim 0, padded to equal shards.

    Rank ``r`` holds rows ``[r * rows, (r + 1) * rows)`` of the tensor padded with zero rows to
    ``rows * world_size``. Every rank's shard has the same shape, so every rank's graph has the same shapes.
    """

    shape: tuple[int, ...]
    world_size: int

    @property
    def rows(self) -> int:
        """Rows per shard."""
        return -(-self.shape[0] // self.world_size)

    @property
    def padded_rows(self) -> int:
        return self.rows * self.world_size

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.rows, *self.shape[1:])

    def local_rows(self, rank: int) -> int:
        """Rows of the real (unpadded) tensor rank ``rank`` holds."""
        return max(0, min(self.rows, self.shape[0] - rank * self.rows))


@dataclass(frozen=True)
class ParamInfo:
    """What passes know of one parameter (``index`` is its number in graph inputs and markers).

    Attributes:
        shard: how the parameter's gradient and optimizer state (and the parameter itself in stage 3) are
            split across ranks; None when they stay whole (0-d parameters, no process group).
        persistent: the parameter itself stays whole in stage 3 (a tensor only an optimizer holds, or one under
            ``Config.param_persistence_threshold``).
    """

    index: int
    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    shard: ShardSpec | None = None
    persistent: bool = False

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class PassContext:
    """Everything a pass may read; passes read nothing global.

    Attributes:
        config: the step's ``zgraph.Config``.
        world_size: ranks taking part (1 without a process group).
        rank: this rank.
        group_name: name of the process group collectives run on; None when there is none (single process).
        params: per-parameter information, indexed like the graph's parameter inputs.
        cost_model: ``zgraph.runtime.cost_model.CostModel`` (collective latency and bandwidth, compute speed),
            identical on every rank; None where planning must not depend on one.
    """

    config: object
    world_size: int = 1
    rank: int = 0
    group_name: str | None = None
    params: tuple[ParamInfo, ...] = ()
    cost_model: object | None = None

    @property
    def distributed(self) -> bool:
        """True when collectives are inserted (a process group exists, even of size 1)."""
        return self.group_name is not None


GraphPass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


@dataclass(frozen=True)
class Pass:
    """A named graph transformation with its contract.

    Attributes:
        name: unique name, used in ``step.graphs``, ``explain()`` and ``Config.disable_passes``.
        fn: ``fn(gm, ctx) -> gm``.
        requires: properties that must hold on the graph it receives.
        provides: properties that hold on the graph it returns.
        after: for user passes, the pass to run right after (default: at the end of the pipeline).
        doc: one line for ``explain()``; defaults to the first line of ``fn``'s docstring.
    """

    name: str
    fn: GraphPass
    requires: frozenset[str] = field(default_factory=frozenset)
    provides: frozenset[str] = field(default_factory=frozenset)
    after: str | None = None
    doc: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "requires", frozenset(self.requires))
        object.__setattr__(self, "provides", frozenset(self.provides))
        if not self.doc:
            first = (self.fn.__doc__ or "").strip().splitlines()
            object.__setattr__(self, "doc", first[0] if first else "")


def build_pipeline(default: Sequence[Pass], disable: Sequence[str], extra: Sequence[Pass]) -> list[Pass]:
    """The passes to run: ``default`` minus ``disable``, plus ``extra`` at their places; contracts checked."""
    names = [p.name for p in default]
    unknown = [n for n in disable if n not in names]
    if unknown:
        raise PipelineError(
            f"Config.disable_passes names unknown pass(es) {unknown}; the pipeline has: {', '.join(names)}"
        )
    passes = [p for p in default if p.name not in set(disable)]
    for user_pass in extra:
        if user_pass.name in [p.name for p in passes] or user_pass.name in names:
            raise PipelineError(f"extra pass name {user_pass.name!r} is already used by another pass")
        if user_pass.after is None:
            passes.append(user_pass)
            continue
        position = [p.name for p in passes]
        if user_pass.after not in position:
            raise PipelineError(
                f"extra pass {user_pass.name!r} asks to run after {user_pass.after!r}, which is not in the "
                f"pipeline ({', '.join(position)})"
            )
        passes.insert(position.index(user_pass.after) + 1, user_pass)
    check_contracts(passes, default)
    return passes


def check_contracts(passes: Sequence[Pass], default: Sequence[Pass] = ()) -> None:
    """Raise ``PipelineError`` if some pass requires a property no earlier pass provides."""
    have = set(CAPTURED_PROPERTIES)
    providers = {prop: p.name for p in default for prop in p.provides}
    for p in passes:
        missing = sorted(p.requires - have)
        if missing:
            hints = [f"{m!r} (provided by {providers[m]!r})" if m in providers else repr(m) for m in missing]
            raise PipelineError(
                f"pass {p.name!r} requires {', '.join(hints)}, which no earlier pass provides; "
                "check Config.disable_passes and where extra passes are placed"
            )
        have |= p.provides


@dataclass
class PassRecord:
    """One pass's result, for inspection."""

    name: str
    gm: fx.GraphModule
    seconds: float
    doc: str = ""


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose graph can be edited without touching ``gm`` (node meta is shallow-copied).

    The copy is a ``_LazyGraphModule`` (inductor's own): its Python code is generated when it is first called or
    printed, not on every ``recompile()`` — a pipeline keeps one graph per pass and most are only inspected."""
    graph = fx.Graph()
    graph._codegen = copy.copy(gm.graph._codegen)
    value_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, value_map)
    old_output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    new_output = graph.output(out)
    new_output.meta = copy.copy(old_output.meta)
    new = _LazyGraphModule(gm, graph)
    new.meta = copy.copy(getattr(gm, "meta", {}))
    return new


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass]) -> list[PassRecord]:
    """Run ``passes`` in order; returns one record per pass (its output graph and time)."""
    records = []
    for p in passes:
        start = time.perf_counter()
        out = p.fn(copy_graph_module(gm), ctx)
        if not isinstance(out, fx.GraphModule):
            raise PipelineError(f"pass {p.name!r} returned {type(out).__name__}, expected a torch.fx.GraphModule")
        out.graph.lint()
        out.recompile()
        for prop in sorted(p.provides):
            check = PROPERTY_CHECKS.get(prop)
            problem = check(out) if check else None
            if problem:
                raise PipelineError(f"pass {p.name!r} claims {prop!r} but: {problem}")
        records.append(PassRecord(p.name, out, time.perf_counter() - start, p.doc))
        gm = out
    return records


def _check_phases(gm: fx.GraphModule) -> str | None:
    from zgraph.capture import PHASES

    for node in gm.graph.nodes:
        if node.op == "call_function" and node.meta.get("phase") not in PHASES:
            return f"node {node.name} ({node.target}) has no phase"
    return None


def _check_no_markers(gm: fx.GraphModule) -> str | None:
    from zgraph.ops import GRAD_CONTRIBUTION

    for node in gm.graph.nodes:
        if node.target is GRAD_CONTRIBUTION:
            return f"gradient marker {node.name} is still in the graph"
    return None


def _check_lowered(gm: fx.GraphModule) -> str | None:
    from zgraph.ops import GRAD_NORM, LAYOUT_OPS, NONFINITE

    for node in gm.graph.nodes:
        if node.target in LAYOUT_OPS or node.target in (GRAD_NORM, NONFINITE):
            return f"layout operator {node.name} ({node.target}) is still in the graph"
    return None


PROPERTY_CHECKS: dict[str, Callable[[fx.GraphModule], str | None]] = {
    "phases": _check_phases,
    "grads_reduced": _check_no_markers,
    "collectives_lowered": _check_lowered,
}
