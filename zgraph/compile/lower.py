"""Lowering for the backend: the backend's rewrites as recorded passes, then compilation; a split step's joint
graph partitioned (``zgraph.passes.partition``) and both halves lowered."""

from __future__ import annotations

import time

import torch.fx as fx

from zgraph.capture.captured import SplitInfo
from zgraph.compile.variant import SplitCompiled, reload_slots
from zgraph.graph import input_specs, output_roles
from zgraph.passes import Pass, PassContext, PassRecord, run_passes
from zgraph.passes.partition import partition
from zgraph.runtime.executor import Executable, backend_rewrites, compile_graph


def lower(gm: fx.GraphModule, ctx: PassContext, backend: str, keep: bool = True) -> tuple[list[PassRecord], Executable]:
    """Run ``backend``'s rewrites on ``gm`` as recorded passes and compile the result; where inductor cannot
    compile it, the eager backend's rewrites and executor instead. Returns the records and the executable.
    ``keep``: as for ``run_passes`` (False: the eager rewrites edit ``gm``; inductor's always edit a copy)."""
    start = time.perf_counter()
    for name in (backend, "eager"):
        rewrites = [
            Pass(n, lambda g, _ctx, fn=fn: fn(g), doc=fn.__doc__.strip().splitlines()[0])
            for n, fn in backend_rewrites(name, gm)
        ]
        records = run_passes(gm, ctx, rewrites, check_input=False, keep=keep or name != "eager")
        executable = compile_graph(records[-1].gm, name)
        if executable is not None:
            if name != backend:  # the time inductor spent failing counts too
                executable.compile_seconds = time.perf_counter() - start
            return records, executable
    raise AssertionError("the eager backend always compiles")


def lower_split(transformed: fx.GraphModule, ctx: PassContext, backend: str, info: SplitInfo) -> SplitCompiled:
    """Partition a split step's transformed joint graph (``zgraph.passes.partition``) and lower both halves."""
    part = partition(transformed, set(info.tangents))
    forward_records, forward = lower(part.forward, ctx, backend)
    backward_records, backward = lower(part.backward, ctx, backend)
    return SplitCompiled(
        info,
        forward,
        backward,
        forward_records,
        backward_records,
        input_specs(forward_records[-1].gm),
        output_roles(forward_records[-1].gm),
        output_roles(backward_records[-1].gm),
        part.n_saved,
        {"forward": part.forward, "backward": part.backward},
        reload_slots(forward_records[-1].gm),
        reload_slots(backward_records[-1].gm),
    )
