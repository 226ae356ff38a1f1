"""From a captured graph to a compiled variant: what the passes know of the bound state (``pass_context``), the
pass list, lowering for the backend (both halves of a split step), and the fingerprint the ranks compare."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence

from zgraph.capture.captured import CapturedGraph
from zgraph.compile.lower import lower, lower_split
from zgraph.compile.variant import CompiledStep
from zgraph.graph import ParamInfo, input_specs, output_roles
from zgraph.passes import Pass, PassContext, run_passes
from zgraph.runtime.consistency import describe_collectives, describe_graph, digest
from zgraph.runtime.cost_model import crossing_groups
from zgraph.runtime.offload_store import OffloadError
from zgraph.runtime.state import Binding


def compile_step(
    captured: CapturedGraph, binding: Binding, passes: Sequence[Pass], backend: str, capture_seconds: float
) -> CompiledStep:
    """Transform ``captured`` with ``passes`` and compile it for ``backend``."""
    assert captured.gm is not None
    overlap = binding.host.overlap if binding.host is not None else None
    if overlap is not None and (captured.split is not None or not captured.optimizers_stepped):
        raise OffloadError(
            f"zgraph: Config.offload_overlap={overlap!r} overlaps a step's update on the host with the next step's "
            "forward, so the step must run the forward, the backward and the optimizer's update; this one "
            + ("leaves its backward to the caller (split mode)" if captured.split is not None else "steps no optimizer")
            + ". Use offload_overlap=None"
        )
    ctx = pass_context(binding, split=captured.split is not None)
    records = run_passes(captured.gm, ctx, list(passes))
    transformed = records[-1].gm if records else captured.gm
    split = None
    if captured.split is not None:
        split = lower_split(transformed, ctx, backend, captured.split)
        backend_records, executable = split.forward_records, split.forward
    else:
        backend_records, executable = lower(transformed, ctx, backend)
    final = backend_records[-1].gm
    description = describe_graph(captured.gm) + describe_collectives(transformed)
    return CompiledStep(
        captured,
        records,
        executable,
        capture_seconds,
        input_specs(final),
        output_roles(final),
        description,
        digest(description),
        binding.cost_model,
        backend_records,
        ctx.params,
        split,
        crossing=crossing_groups(binding.plan.group) if binding.plan.group.distributed else {},
    )


def pass_context(binding: Binding, split: bool = False) -> PassContext:
    """What the passes know of a bound step: its parameters (shape, dtype, shard spec, persistence), its process
    group and the cost model; ``split``: a split step's joint graph."""
    plan = binding.plan
    params = tuple(
        ParamInfo(
            r.index,
            tuple(r.names),
            tuple(r.tensor.shape),
            r.tensor.dtype,
            r.tensor.requires_grad,
            shard=plan.specs[r.index],
            persistent=plan.persistent[r.index],
        )
        for r in binding.params
    )
    group = plan.group
    return PassContext(
        world_size=group.world_size,
        rank=group.rank,
        group_name=group.group_name,
        backend=binding.backend or group.backend,
        device_type=binding.device.type,
        params=params,
        cost_model=binding.cost_model,
        split=split,
        shard_group=group.shard,
        replicate_group=group.replicate,
        secondary_group=group.secondary,
        sequence_group=group.sequence,
        host_params=binding.host_params,
    )


@contextlib.contextmanager
def collector_paused(promote: bool = False) -> Iterator[None]:
    """Python's cyclic garbage collector paused inside (as it was after): building a step's graph makes millions of
    objects (fake tensors, nodes, a copy of the graph per pass), and each full collection that triggers walks them
    all again, a fifth of a 12-layer GPT-2's capture. What it would have freed waits for the next collection.

    ``promote``: on the way out what was made inside moves to the oldest generation (``gc.freeze`` then
    ``gc.unfreeze``: their documented effect, where nothing else is frozen). For a step being built: its graphs
    live as long as the step, and the young generations' collections would otherwise walk all of them twice in
    its first run (a 12-layer GPT-2's: 0.6 s); the garbage among them (the traces the capture discarded)
    is freed by the next full collection. Not where what is made is all garbage (an estimate)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if promote and gc.get_freeze_count() == 0:  # never unfreeze what the program froze itself
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()
