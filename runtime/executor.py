"""Backends that turn the transformed step graph into something to call.

``eager`` runs the FX GraphModule op by op; ``inductor`` compiles it with ``compile_fx``. Both run under
``torch.no_grad()``: the graph already holds the backward pass as explicit ops.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

from zgraph.passes.pipeline import copy_graph_module
from zgraph.runtime.reinplace import reinplace_state_updates


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


def compile_graph(gm: fx.GraphModule, backend: str) -> Executable:
    """Compile ``gm`` for ``backend`` (``"eager"`` or ``"inductor"``)."""
    start = time.perf_counter()
    if backend == "eager":
        runnable = copy_graph_module(gm)
        updated = reinplace_state_updates(runnable)

        def run_eager(inputs: Sequence[Tensor]) -> Sequence:
            with torch.no_grad():
                return runnable(*inputs)

        return Executable(run_eager, backend, time.perf_counter() - start, frozenset(updated))
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        # Compile against the graph's own fake inputs: their fake mode has the ShapeEnv that holds the scalar
        # symbols optimizer kernels create with .item() (hyper-parameters).
        fake_inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        with torch.no_grad():
            compiled = compile_fx(gm, fake_inputs)

        def run_inductor(inputs: Sequence[Tensor]) -> Sequence:
            with torch.no_grad():
                return compiled(*inputs)

        return Executable(run_inductor, backend, time.perf_counter() - start)
    raise ValueError(f"unknown backend {backend!r}; expected 'eager' or 'inductor'")
