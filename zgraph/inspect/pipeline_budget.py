"""``Config.memory_budget`` of a pipelined step (``Config.pipeline_parallel``): a remat policy per rank of the
pipeline, each rank's the lightest whose peak fits the budget; at ZeRO stage 3, where none fits, the same with each
stage's parameters gathered for each of its actions (``Config.pipeline_regather``: a rank running several stages,
interleaved, then holds one stage's whole parameters at a time instead of all of theirs).

A rank's peak is its own: its stages' model state, the activations its schedule holds for them, its actions'
working memory (``zgraph.inspect.pipeline_estimate``). So the step is estimated with each policy the planner may
choose on every block (None, ``"selective"``, ``"full"``; only the one given where ``Config.remat`` is not None or
``"auto"``), each rank takes the first of them, in that order (less recomputation first), under which its peak fits,
and the blocks of its stages get it (``Config.remat`` as a mapping from block names). Where the ranks chose
differently the mapping is estimated again, and the plan is kept only if every rank still fits (else the one
policy for every block that does). Nothing fits: ``MemoryBudgetError`` naming each rank's smallest peak.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from zgraph.binding.arguments import StepCall
from zgraph.config import Config
from zgraph.errors import MemoryBudgetError
from zgraph.inspect.estimate import Estimate, estimate_step

Policy = str | None
_POLICIES: tuple[Policy, ...] = (None, "selective", "full")


def plan_pipeline(
    call: StepCall,
    config: Config,
    budget: int | str,
    world_size: int | None,
    device: str | torch.device | None,
    free: Callable[[torch.device], int],
) -> tuple[int, dict[str, object], Estimate, int]:
    """The plan for a pipelined step under ``budget`` (bytes per rank, or ``"auto"``: ``free(device)``): the
    budget in bytes, the ``Config`` fields it changes, the estimate with them, and how many estimates it took. At
    ZeRO stage 3, where no remat fits with each stage's parameters gathered once per step, the same search with
    them gathered for each action (``Config.pipeline_regather``)."""

    def estimate(variant: Config, remat: object) -> Estimate:
        changed = dataclasses.replace(variant, memory_budget=None, remat=remat)
        return estimate_step(call, changed, world_size, device=device)

    try:
        return _plan(config, estimate, budget, free)
    except MemoryBudgetError:
        if config.stage != 3 or config.pipeline_regather:
            raise
    regathered = dataclasses.replace(config, pipeline_regather=True)
    nbytes, changes, planned, considered = _plan(regathered, estimate, budget, free)
    return nbytes, {**changes, "pipeline_regather": True}, planned, considered


def _plan(
    config: Config,
    estimate: Callable[[Config, object], Estimate],
    budget: int | str,
    free: Callable[[torch.device], int],
) -> tuple[int, dict[str, object], Estimate, int]:
    """``plan_pipeline`` at ``config``'s ``pipeline_regather`` (``estimate(config, remat)``: the step's estimate
    with that remat)."""
    policies = _POLICIES if config.remat in (None, "auto") else (config.remat,)
    estimates = {p: estimate(config, p) for p in policies}
    first = next(iter(estimates.values()))
    nbytes = free(torch.device(first.device)) if budget == "auto" else int(budget)
    chosen = {}
    for s in first.stages:
        fitting = [p for p, e in estimates.items() if e.stages[s.stage].peak_bytes <= nbytes]
        if not fitting:
            raise _impossible(nbytes, estimates, config.pipeline_regather)
        chosen[s.rank] = fitting[0]
    if len(set(chosen.values())) == 1:
        policy = next(iter(chosen.values()))
        return nbytes, {"remat": policy}, estimates[policy], len(estimates)
    mapping = {block: chosen[s.rank] for s in first.stages for block in s.blocks}
    planned = estimate(config, mapping)
    if planned.peak_bytes <= nbytes:
        return nbytes, {"remat": mapping}, planned, len(estimates) + 1
    policy = next((p for p, e in estimates.items() if e.peak_bytes <= nbytes), None)
    if policy is None:
        raise _impossible(nbytes, estimates, config.pipeline_regather)
    return nbytes, {"remat": policy}, estimates[policy], len(estimates) + 1


def _impossible(nbytes: int, estimates: dict[Policy, Estimate], regather: bool) -> MemoryBudgetError:
    """The error for a budget some rank fits under no policy: each rank's smallest peak and under which."""
    first = next(iter(estimates.values()))
    ranks = sorted({s.rank for s in first.stages})
    least = []
    for rank in ranks:
        peaks = {p: next(s.peak_bytes for s in e.stages if s.rank == rank) for p, e in estimates.items()}
        policy = min(peaks, key=peaks.__getitem__)
        least.append(
            f"rank {rank} {_size(peaks[policy])} (remat={policy!r}{', pipeline_regather' if regather else ''})"
        )
    return MemoryBudgetError(
        f"Config.memory_budget={_size(nbytes)} per rank cannot be met by the pipeline: the smallest estimated peak of "
        f"each of its ranks: {', '.join(least)}. Raise the budget, cut the model into more stages "
        "(pipeline_parallel, or pipeline_virtual_stages with interleaved_1f1b), use more micro-batches of fewer "
        "rows, or a schedule that holds fewer micro-batches (1f1b rather than gpipe)."
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes:,} bytes"
