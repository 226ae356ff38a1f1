"""The pass list: named passes with contracts, run in order, each leaving a graph to inspect.

A pass is ``fn(gm, ctx) -> gm``. It receives its own copy of the previous graph (so it may edit in place) and
returns the graph it produced; the pass list keeps every pass's output for ``step.graphs``. A pass that says it
does not apply to a graph (``Pass.applies``: its config or the context leaves it nothing to do) is neither run nor
given a copy: its record shares the previous graph.

Contracts are sets of property names. A pass ``requires`` properties some earlier pass (or capture)
``provides``; the pass list is checked before anything runs, so a disabled pass another one depends on, or a
user pass placed before what it needs, is an error naming both. Every property has a checker
(``PROPERTY_CHECKS``): it is verified on the graph of the pass that claims to provide it (the captured graph's
properties before the first pass).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from zgraph.errors import PassError
from zgraph.graph import PHASE, PHASES, Axis, CostModel, ParamInfo
from zgraph.graph_copy import copy_graph_module
from zgraph.ops import GRAD_CONTRIBUTION, GRAD_NORM, LAYOUT_OPS, NONFINITE
from zgraph.passes.provenance import run_pass
from zgraph.sequence_ops import SEQUENCE_OPS
from zgraph.sizes import bind_sizes

# Properties the captured graph has before any pass runs (see zgraph.capture.trace); checked before the first pass.
CAPTURED_PROPERTIES = frozenset({"functional", "phases", "grad_markers"})


@dataclass(frozen=True)
class PassContext:
    """Everything a pass may read about the step it transforms; passes read nothing global. A pass's own options
    (bucket sizes, dtypes, the ZeRO stage) are bound to it when the pass list is built (``functools.partial``), so
    its signature shows them.

    Attributes:
        world_size: ranks taking part (1 without a process group).
        rank: this rank.
        group_name: name of the process group collectives run on; None when there is none (single process).
        backend: the ``torch.distributed`` backend that serves the state's device in that group (``"gloo"``,
            ``"nccl"``); None without a group.
        device_type: the device type the training state lives on (``"cpu"``, ``"cuda"``).
        params: per-parameter information, indexed like the graph's parameter inputs.
        cost_model: collective latency and bandwidth, compute speed (``zgraph.runtime.cost_model.CostModel``),
            identical on every rank; None where planning must not depend on one.
        split: the graph is a split step's joint graph (its tangents are inputs of kind ``input``), cut into a
            forward and a backward graph after the passes, run in two calls.
        shard_group: hybrid sharding (``Config.shard_group_size``): the ranks state is sharded across; None: all.
        replicate_group: hybrid sharding: the ranks holding the same shards as this one (one per shard group),
            across which sharded gradients are all-reduced; None without hybrid sharding.
        secondary_group: hpZ (``Config.secondary_shard_group_size``): the ranks the backward re-gathers stage-3
            parameters from, out of a secondary shard kept from the forward's gather; None without hpZ.
        sequence_group: sequence parallelism (``Config.sequence_parallel``): the ranks holding a slice each of the
            same sequences, among which attention's all-to-alls run; None without it.
        host_params: the parameters (indices) whose master value and optimizer state live in host memory and
            whose update runs on the host (``Config.offload_update``; the ``host_update`` pass places them).
    """

    world_size: int = 1
    rank: int = 0
    group_name: str | None = None
    backend: str | None = None
    device_type: str = "cpu"
    params: tuple[ParamInfo, ...] = ()
    cost_model: CostModel | None = None
    split: bool = False
    shard_group: Axis | None = None
    replicate_group: Axis | None = None
    secondary_group: Axis | None = None
    sequence_group: Axis | None = None
    host_params: frozenset[int] = frozenset()

    @property
    def distributed(self) -> bool:
        """True when collectives are inserted (a process group exists, even of size 1)."""
        return self.group_name is not None

    @property
    def shard(self) -> Axis:
        """The ranks a parameter's state is split across: hybrid sharding's shard group, else every rank."""
        if self.shard_group is not None:
            return self.shard_group
        return Axis(size=self.world_size, rank=self.rank, name=self.group_name or "")


GraphPass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


@dataclass(frozen=True)
class Pass:
    """A named graph transformation with its contract.

    Attributes:
        name: unique name, used in ``step.graphs``, ``explain()`` and ``Config.disable_passes``.
        fn: ``fn(gm, ctx) -> gm``.
        requires: properties that must hold on the graph it receives.
        provides: properties that hold on the graph it returns; each has a checker in ``PROPERTY_CHECKS``, run on
            the graph the pass returns.
        after: for user passes, the pass to run right after (default: at the end of the pass list).
        doc: one line for ``explain()``; defaults to the first line of ``fn``'s docstring.
        applies: ``applies(gm, ctx, **options)`` with the options bound to ``fn`` (the pass's own signature):
            False only where ``fn`` would return ``gm`` unchanged (a check of its options and the context, or a
            cheap scan of the graph); the pass list then skips the copy and the run, and the record shares the
            previous graph. None: the pass always runs.
    """

    name: str
    fn: GraphPass
    requires: frozenset[str] = field(default_factory=frozenset)
    provides: frozenset[str] = field(default_factory=frozenset)
    after: str | None = None
    doc: str = ""
    applies: Callable[..., bool] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "requires", frozenset(self.requires))
        object.__setattr__(self, "provides", frozenset(self.provides))
        unchecked = sorted(self.provides - PROPERTY_CHECKS.keys())
        if unchecked:
            raise PassError(
                f"pass {self.name!r} provides {unchecked}, which have no checker; a property a pass provides is "
                f"verified on its graph (known: {', '.join(sorted(PROPERTY_CHECKS))})"
            )
        if not self.doc:
            fn = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
            first = (fn.__doc__ or "").strip().splitlines()
            object.__setattr__(self, "doc", first[0] if first else "")


def build_pass_list(default: Sequence[Pass], disable: Sequence[str], extra: Sequence[Pass]) -> list[Pass]:
    """The passes to run: ``default`` minus ``disable``, plus ``extra`` at their places; contracts checked."""
    names = [p.name for p in default]
    unknown = [n for n in disable if n not in names]
    if unknown:
        raise PassError(
            f"Config.disable_passes names unknown pass(es) {unknown}; the pass list has: {', '.join(names)}"
        )
    passes = [p for p in default if p.name not in set(disable)]
    for user_pass in extra:
        if user_pass.name in [p.name for p in passes] or user_pass.name in names:
            raise PassError(f"extra pass name {user_pass.name!r} is already used by another pass")
        if user_pass.after is None:
            passes.append(user_pass)
            continue
        position = [p.name for p in passes]
        if user_pass.after not in position:
            raise PassError(
                f"extra pass {user_pass.name!r} asks to run after {user_pass.after!r}, which is not in the "
                f"pass list ({', '.join(position)})"
            )
        passes.insert(position.index(user_pass.after) + 1, user_pass)
    check_contracts(passes, default)
    return passes


def check_contracts(passes: Sequence[Pass], default: Sequence[Pass] = ()) -> None:
    """Raise ``PassError`` if some pass requires a property no earlier pass provides."""
    have = set(CAPTURED_PROPERTIES)
    providers = {prop: p.name for p in default for prop in p.provides}
    for p in passes:
        missing = sorted(p.requires - have)
        if missing:
            hints = [f"{m!r} (provided by {providers[m]!r})" if m in providers else repr(m) for m in missing]
            raise PassError(
                f"pass {p.name!r} requires {', '.join(hints)}, which no earlier pass provides; "
                "check Config.disable_passes and where extra passes are placed"
            )
        have |= p.provides


@dataclass
class PassRecord:
    """One pass's result, for inspection. ``applied``: False when the pass did not apply (``Pass.applies``): ``gm``
    is then the previous graph itself."""

    name: str
    gm: fx.GraphModule
    seconds: float
    doc: str = ""
    applied: bool = True


def check_properties(gm: fx.GraphModule, properties: frozenset[str] | set[str], who: str) -> None:
    """Raise ``PassError`` if ``gm`` lacks one of ``properties`` (each has a checker)."""
    for prop in sorted(properties):
        problem = PROPERTY_CHECKS[prop](gm)
        if problem:
            raise PassError(f"{who} claims {prop!r} but: {problem}")


def run_passes(
    gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass], *, check_input: bool = True, keep: bool = True
) -> list[PassRecord]:
    """Run ``passes`` in order; returns one record per pass (its output graph and time).

    ``check_input``: verify the captured graph's properties (``CAPTURED_PROPERTIES``) first. Every node a pass
    creates carries ``meta[MADE_BY]``, the pass's name (``zgraph.passes.provenance.run_pass`` runs it: a
    create-node hook on the module the pass edits, the copy below when ``keep``).
    A symbolic size a pass wrote into an op's arguments is then computed by the graph (``zgraph.sizes.bind_sizes``).
    ``keep``: each pass edits a copy, leaving ``gm`` and every record's graph as it was; False: each pass edits
    the graph it receives, ``gm`` included (only the last record's graph is then the pass's output as made).
    A pass that does not apply (``Pass.applies``) is not run: its record holds the graph it received, whose
    properties are checked against what the pass provides.
    """
    if check_input:
        check_properties(gm, CAPTURED_PROPERTIES, "the captured graph")
    records = []
    for p in passes:
        start = time.perf_counter()
        if not pass_applies(p, gm, ctx):
            check_properties(gm, p.provides, f"pass {p.name!r}")
            records.append(PassRecord(p.name, gm, time.perf_counter() - start, p.doc, applied=False))
            continue
        before = copy_graph_module(gm) if keep else gm
        out = run_pass(p.name, before, p.fn, ctx)
        if not isinstance(out, fx.GraphModule):
            raise PassError(f"pass {p.name!r} returned {type(out).__name__}, expected a torch.fx.GraphModule")
        bind_sizes(out)
        out.graph.lint()
        out.recompile()
        check_properties(out, p.provides, f"pass {p.name!r}")
        records.append(PassRecord(p.name, out, time.perf_counter() - start, p.doc))
        gm = out
    return records


def pass_applies(p: Pass, gm: fx.GraphModule, ctx: PassContext) -> bool:
    """``p.applies(gm, ctx, **options)``, with the options bound to ``p.fn``; True without ``p.applies``."""
    if p.applies is None:
        return True
    options = p.fn.keywords if isinstance(p.fn, functools.partial) else {}
    return p.applies(gm, ctx, **options)


def with_group(gm: fx.GraphModule, ctx: PassContext, **options: object) -> bool:
    """``Pass.applies`` of a pass that changes nothing without a process group (whatever its options)."""
    return ctx.distributed


def _check_functional(gm: fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            return f"node {node.name} ({target}) mutates its input"
    return None


def _check_phases(gm: fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.meta.get(PHASE) not in PHASES:
            return f"node {node.name} ({node.target}) has no phase"
    return None


def _check_markers(gm: fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        if node.target is GRAD_CONTRIBUTION and not (isinstance(node.args[1], int) and node.args[1] >= 0):
            return f"gradient marker {node.name} names no parameter ({node.args[1]!r})"
    return None


def _check_no_markers(gm: fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        if node.target is GRAD_CONTRIBUTION:
            return f"gradient marker {node.name} is still in the graph"
    return None


def _check_lowered(gm: fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        if node.target in LAYOUT_OPS or node.target in (GRAD_NORM, NONFINITE, *SEQUENCE_OPS):
            return f"layout operator {node.name} ({node.target}) is still in the graph"
    return None


PROPERTY_CHECKS: dict[str, Callable[[fx.GraphModule], str | None]] = {
    "functional": _check_functional,
    "phases": _check_phases,
    "grad_markers": _check_markers,
    "grads_reduced": _check_no_markers,
    "collectives_lowered": _check_lowered,
}
