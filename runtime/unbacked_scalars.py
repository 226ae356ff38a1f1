"""Host-known scalars as numbers only the run knows, for inductor.

Capture reads a value the host knows before each call (a hyper-parameter of an optimizer traced as written, a step
counter) with ``.item()`` as a *backed* symbol, its hint the value the capturing call had: a Python branch on it
becomes a guard that the host checks before every call (``zgraph.dispatch``), and the graph computes the number
itself. Inductor cannot compile against such a symbol: its AOT pass ``tensorify_python_scalars`` asks dynamo (which
is not there) to restart for a backed float, and a backed symbol is one inductor may fix to its hint. The graph
needs none: only the host decides on these values.

``unbacked_scalars`` propagates the graph's fake values again (torch's ``FakeTensorProp``) in a fresh fake mode,
where every ``.item()`` is a fresh *unbacked* symbol, as those of zgraph's own optimizer kernels are; the capture's
guards on the symbols it replaces hold whenever the graph runs, so the fresh ShapeEnv is told them
(``guard_or_defer_runtime_assert``, as ``torch._check`` does): what an op's fake kernel decides on such a value
(``addmm``'s ``beta == 0``) is decided as in the capture. ``decompositions`` leaves out of inductor's table an
op's decomposition that would branch on a value no guard decides (``lerp.Scalar``'s ``weight >= 0.5``): that op
runs its aten kernel, with the number the run computes (its fallback lowering registered as overriding the
decomposition, which inductor otherwise refuses when the ``CI`` variable is set).
"""

from __future__ import annotations

from collections.abc import Callable

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (
    GuardOnDataDependentSymNode,
    ShapeEnv,
    free_unbacked_symbols,
)
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from zgraph.graph import VAL, fake_mode, placeholders

aten = torch.ops.aten
SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool)


def reads_host_scalars(gm: fx.GraphModule) -> bool:
    """Whether an ``.item()`` of ``gm`` reads a host-known value (a backed symbol)."""
    return any(_host_symbol(n) is not None for n in gm.graph.nodes)


def unbacked_scalars(gm: fx.GraphModule) -> fx.GraphModule:
    """Give every node of ``gm`` a fake value from a fresh fake mode, each ``.item()`` an unbacked symbol; in place,
    returns ``gm``."""
    guards = [g.expr for g in fake_mode(gm).shape_env.guards]
    for node in gm.graph.nodes:  # bindings to the capture's symbols: the propagation binds fresh ones
        node.meta.pop("unbacked_bindings", None)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True, static_shapes=True)
    _Propagation(gm, mode, guards).propagate(*[n.meta[VAL] for n in placeholders(gm)])
    return gm


class _Propagation(FakeTensorProp):
    """``FakeTensorProp`` that, as each ``.item()`` of a backed symbol gets its unbacked one, tells the fresh
    ShapeEnv every capture guard whose symbols all have theirs."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, guards: list[sympy.Basic]):
        super().__init__(gm, mode)
        self.shape_env = mode.shape_env
        self.guards = guards
        self.renamed: dict[sympy.Symbol, sympy.Expr] = {}

    def run_node(self, n: fx.Node) -> object:
        symbol = _host_symbol(n)
        result = super().run_node(n)
        if symbol is not None and isinstance(result, SCALARS):
            self.renamed[symbol] = result.node.expr
            told = [g for g in self.guards if g.free_symbols <= self.renamed.keys()]
            self.guards = [g for g in self.guards if g not in told]
            for guard in told:
                self.shape_env.guard_or_defer_runtime_assert(guard.xreplace(self.renamed), "a zgraph host guard")
        return result


def decompositions(gm: fx.GraphModule) -> dict[torch._ops.OpOverload, Callable]:
    """Inductor's decompositions, less those that would branch on a number only the run knows (each tried once on
    this graph's fake values, per op and the positions of its symbolic arguments): that op runs its aten kernel."""
    from torch._inductor import config as inductor_config

    random = inductor_config.fallback_random
    table = inductor_table(random, ())
    tried, removed = set(), []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in table:
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get(VAL))
        leaves = pytree.tree_leaves((args, kwargs))
        key = (
            node.target,
            tuple(i for i, a in enumerate(leaves) if isinstance(a, SCALARS) and free_unbacked_symbols(a)),
        )
        if not key[1] or key in tried:
            continue
        tried.add(key)
        try:
            with fake_mode(gm):
                table[node.target](*args, **kwargs)
        except GuardOnDataDependentSymNode:
            del table[node.target]
            _run_aten_kernel(node.target)
            removed.append(node.target.name())
    return inductor_table(random, tuple(sorted(removed))) if removed else table


class _Table(dict):
    """A decomposition table that pickles as what it is made from (inductor's own, less some ops), not as its
    functions (most do not pickle): inductor's cache key for a graph compiled with it is stable, so its compiled
    code is reused (another process, a restarted job) instead of compiled again."""

    def __init__(self, table: dict, made_from: tuple[bool, tuple[str, ...]]):
        super().__init__(table)
        self.made_from = made_from

    def __reduce__(self) -> tuple:
        return inductor_table, self.made_from


def inductor_table(fallback_random: bool, removed: tuple[str, ...]) -> dict[torch._ops.OpOverload, Callable]:
    """Inductor's decomposition table (as with ``fallback_random``) without the ops named ``removed``."""
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table  # imports inductor: only when it compiles

    with inductor_config.patch(fallback_random=fallback_random):
        table = {op: fn for op, fn in select_decomp_table().items() if op.name() not in removed}
    return _Table(table, (fallback_random, removed))


def _run_aten_kernel(op: torch._ops.OpOverload) -> None:
    """Lower ``op`` to its aten kernel where inductor has no lowering of its own for it."""
    from torch._inductor.lowering import lowerings, make_fallback

    if op not in lowerings:
        make_fallback(op, override_decomp=True)


def _host_symbol(node: fx.Node) -> sympy.Symbol | None:
    """The backed symbol (one with a hint) that an ``.item()`` node's value was made as, if it was; a guard may
    have replaced it by a number since."""
    val = node.meta.get(VAL)
    if node.target is not aten._local_scalar_dense.default or not isinstance(val, SCALARS):
        return None
    symbol = val.node._expr
    return symbol if symbol in val.node.shape_env.backed_var_to_val else None
