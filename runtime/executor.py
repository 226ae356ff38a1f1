"""Backends that turn the final step graph into something to call, and the rewrites each backend needs first.

``eager`` runs the FX GraphModule op by op; ``inductor`` compiles it with ``compile_fx``. The graph already holds
the backward pass as explicit ops and its inputs do not require grad, so nothing is recorded for autograd.

Each backend rewrites the pass list's last graph before it runs it (``backend_rewrites``); the step runs these
rewrites as recorded passes, so the graph it shows as ``final`` is exactly the one that runs:

- eager: ``reinplace`` (``zgraph.runtime.reinplace``): state updates and all-reduces in place, functional copies
  into buffers of their own size.
- both (for inductor first: its other rewrites never see them): ``host_partitions``
  (``zgraph.runtime.host_partitions``): the optimizer's host nodes (``Config.offload_update="host"``) cut into
  partitions a host thread runs, as eager PyTorch computes on the CPU (an Adam/AdamW update as one call of torch's
  fused CPU kernel: ``zgraph.runtime.host_fused``).
- inductor: ``explicit_alpha``: ``add``/``sub`` with an ``alpha`` other than 1 become an explicit multiplication,
  ``add(x, mul(y, alpha))``. Inductor's pattern that fuses ``add(x, mm(a, b))`` into ``addmm`` drops ``alpha``,
  and the optimizer kernels update parameters with ``param.add_(grad, alpha=-lr)`` (``lr`` a graph scalar).
  ``addcmul``/``addcdiv`` keep their ``value``: inductor lowers them itself, with symbolic values.

Inductor compiles a copy of the graph. Where it reads host-known values with ``.item()`` (a hyper-parameter of an
optimizer traced as written, a step counter), the Python arithmetic on them is computed in float64
(``zgraph.runtime.float64_scalars``) and the fake values are made again with each ``.item()`` a number only the
run knows; the decompositions that would branch on such a number are left out (``zgraph.runtime.unbacked_scalars``).

Ranks of one host compile a graph in turn (``zgraph.runtime.compile_turns``): the first compiles it, the others
load it from inductor's on-disk cache.

Random ops are compiled with ``fallback_random``: they call the aten kernels on the global generator, so they draw
the numbers eager draws and leave the generator in eager's state, run in the graph's order
(``zgraph.runtime.random_order``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor
from torch.fx.graph import _BoxedCodeGen

from zgraph.graph import PHASE, UPDATED_INPUTS, fake_mode, insert, placeholders
from zgraph.graph_copy import copy_graph_module
from zgraph.host_ops import HOST_PARTS
from zgraph.runtime.agreement import DEFAULT_COLLECTIVE_TIMEOUT
from zgraph.runtime.compile_turns import compile_turn
from zgraph.runtime.float64_scalars import float64_scalars
from zgraph.runtime.host_partitions import has_host_ops, host_partitions
from zgraph.runtime.reinplace import reinplace
from zgraph.runtime.unbacked_scalars import decompositions, reads_host_scalars, unbacked_scalars

aten = torch.ops.aten


@dataclass
class Executable:
    """A compiled step graph: ``run(inputs) -> outputs`` (flat lists, in graph order).

    Attributes:
        updated_inputs: output positions that are their own state's input tensor, updated in place (eager
            backend, see ``zgraph.runtime.reinplace``): they alias an input on purpose.
    """

    run: Callable[[Sequence[Tensor]], Sequence]
    backend: str
    compile_seconds: float
    updated_inputs: frozenset[int] = frozenset()
    host_parts: list[fx.GraphModule] | None = None  # the update on the host's partitions; None: no host ops


def backend_rewrites(
    backend: str, gm: fx.GraphModule | None = None
) -> list[tuple[str, Callable[[fx.GraphModule], fx.GraphModule]]]:
    """``[(name, rewrite)]`` a backend applies to the graph (``gm``) before ``compile_graph`` (each in place,
    returning it); ``host_partitions`` only where ``gm`` has the update on the host's operators."""
    hosted = [("host_partitions", host_partitions)] if gm is not None and has_host_ops(gm) else []
    if backend == "eager":
        return [("reinplace", reinplace), *hosted]
    if backend == "inductor":
        return [*hosted, ("explicit_alpha", explicit_alpha)]
    raise ValueError(f"unknown backend {backend!r}; expected 'eager' or 'inductor'")


def compile_graph(gm: fx.GraphModule, backend: str) -> Executable | None:
    """Compile ``gm`` (already rewritten by ``backend_rewrites(backend)``) for ``backend`` (``"eager"`` or
    ``"inductor"``); None, with a warning, when inductor cannot compile it (run it with the eager backend)."""
    start = time.perf_counter()
    if backend == "eager":
        updated = gm.meta.get(UPDATED_INPUTS, frozenset())

        def run_eager(inputs: Sequence[Tensor]) -> Sequence:
            # grad mode as when the step was traced: a few kernels (mkldnn's LSTM) keep what their explicit
            # backward needs only with it on; no input requires grad, so nothing is recorded
            with torch.enable_grad():
                return gm(*inputs)

        return Executable(run_eager, backend, time.perf_counter() - start, frozenset(updated), gm.meta.get(HOST_PARTS))
    if backend == "inductor":
        try:
            with compile_turn(gm, DEFAULT_COLLECTIVE_TIMEOUT):
                compiled = _compile_inductor(gm)
        except Exception as error:  # the same graph runs op by op: slower, same numbers
            warnings.warn(
                f"zgraph: inductor could not compile the step graph ({type(error).__name__}: "
                f"{(str(error).strip().splitlines() or [''])[0][:300]}); running it with the eager backend instead",
                RuntimeWarning,
                stacklevel=2,
            )
            return None

        def run_inductor(inputs: Sequence[Tensor]) -> Sequence:
            with torch.no_grad():
                return compiled(*inputs)

        updated = gm.meta.get(UPDATED_INPUTS, frozenset())  # host states their partitions write in place
        return Executable(
            run_inductor, backend, time.perf_counter() - start, frozenset(updated), gm.meta.get(HOST_PARTS)
        )
    raise ValueError(f"unknown backend {backend!r}; expected 'eager' or 'inductor'")


def run_consuming(gm: fx.GraphModule) -> Callable[[list[Tensor]], Sequence]:
    """``gm`` (for the eager backend) run op by op on a list of inputs it empties as it reads them (FX's boxed
    calling convention, on a copy of ``gm``): each input is let go after its last use rather than when the call
    returns, where the caller holds it nowhere else (a pipeline stage's activations saved for its backward)."""
    boxed = copy_graph_module(gm)
    boxed.graph.set_codegen(_BoxedCodeGen())
    boxed.recompile()

    def run(inputs: list[Tensor]) -> Sequence:
        with torch.enable_grad():  # as ``compile_graph``'s eager run
            return boxed(inputs)

    return run


def _compile_inductor(gm: fx.GraphModule) -> Callable:
    """``compile_fx`` on a copy of ``gm`` (its host scalars' arithmetic in float64 and its fake values made again,
    where it reads any), against its fake inputs: their fake mode has the ShapeEnv that holds the scalar symbols the
    graph's ``.item()`` reads create."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from zgraph.runtime.random_order import KeepGeneratorOrder  # imports inductor: only when it compiles

    graph, table = copy_graph_module(gm), None
    if reads_host_scalars(graph):
        graph = unbacked_scalars(float64_scalars(graph))
        table = decompositions(graph)
    fake_inputs = [n.meta["val"] for n in placeholders(graph)]
    with torch.no_grad(), inductor_config.patch(fallback_random=True, _pre_fusion_custom_pass=KeepGeneratorOrder()):
        return compile_fx(graph, fake_inputs, decompositions=table)


def explicit_alpha(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``add``/``sub(x, y, alpha=a)`` with ``a`` other than 1 (a graph scalar, such as ``-lr`` read with
    ``.item()``, or a constant) into ``add``/``sub(x, mul(y, a))``, ``y`` first cast to the result's dtype as
    the eager kernel does; in place, returns ``gm``.

    For inductor only: its ``add(x, mm(a, b))`` -> ``addmm`` fusion ignores ``alpha`` (torch 2.13). The product
    is rounded once more than in eager's fused ``x + alpha * y``: within fp32 rounding, not bitwise."""
    mode = None
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.add.Tensor, aten.sub.Tensor):
            continue
        alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
        other = node.args[1]
        if (not isinstance(alpha, fx.Node) and alpha == 1) or not isinstance(other, fx.Node):
            continue
        out, val = node.meta.get("val"), other.meta.get("val")
        if not isinstance(out, Tensor) or not isinstance(val, Tensor):
            continue
        mode = mode or fake_mode(gm)
        at = dict(before=node, phase=node.meta.get(PHASE), mode=mode)
        if val.dtype != out.dtype:
            other = insert(gm, aten._to_copy.default, (other,), {"dtype": out.dtype}, **at)
        scaled = insert(gm, aten.mul.Tensor, (other, alpha), **at)
        node.args = (node.args[0], scaled)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
    gm.recompile()
    return gm
