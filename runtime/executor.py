"""Backends that turn the transformed step graph into something to call.

``eager`` runs the FX GraphModule op by op; ``inductor`` compiles it with ``compile_fx``. The graph already holds
the backward pass as explicit ops and its inputs do not require grad, so nothing is recorded for autograd.
"""

from __future__ import annotations

import time
import warnings
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
            # grad mode as when the step was traced: a few kernels (mkldnn's LSTM) keep what their explicit
            # backward needs only with it on; no input requires grad, so nothing is recorded
            with torch.enable_grad():
                return runnable(*inputs)

        return Executable(run_eager, backend, time.perf_counter() - start, frozenset(updated))
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        # Compile against the graph's own fake inputs: their fake mode has the ShapeEnv that holds the scalar
        # symbols optimizer kernels create with .item() (hyper-parameters).
        fake_inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        try:
            with torch.no_grad():
                compiled = compile_fx(gm, fake_inputs)
        except Exception as error:  # the same graph runs op by op: slower, same numbers
            warnings.warn(
                f"zgraph: inductor could not compile the step graph ({type(error).__name__}: "
                f"{str(error).strip().splitlines()[0][:300]}); running it with the eager backend instead",
                RuntimeWarning,
                stacklevel=2,
            )
            fallback = compile_graph(gm, "eager")
            fallback.compile_seconds = time.perf_counter() - start
            return fallback

        def run_inductor(inputs: Sequence[Tensor]) -> Sequence:
            with torch.no_grad():
                return compiled(*inputs)

        return Executable(run_inductor, backend, time.perf_counter() - start)
    raise ValueError(f"unknown backend {backend!r}; expected 'eager' or 'inductor'")
