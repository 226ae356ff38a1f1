"""The memory plan (``Config.memory_budget``): of the configs a budget may choose between, the one predicted
fastest whose estimated peak fits.

Choices (each only where the user left the field at its default, and where it changes anything):

* ``remat``: None, ``"selective"``, ``"full"`` (``"full"`` only for a model with repeated blocks), then, for the
  fastest combination that fits and recomputes, the same with its policy on only the first k blocks and a lighter
  one (``"selective"`` or None) on the rest, k the fewest that fits (a bisection: peak falls as k grows);
* stage 3: ``max_reuse_distance`` 0 (gather for every use region) or every parameter (gathered once per step);
  and, for the three fastest combinations that do not fit but would beat the fastest that does, parameters gathered
  just before their use (``prefetch_bytes=1``, where it was ``"auto"``);
* where an offload tier saves memory (a GPU model: pinned host memory; a CPU model: NVMe files, when
  ``offload_dir`` is set): optimizer states (``offload_fraction`` 0, 0.5 or 1) at stage >= 1, stage 3's
  parameter shards, and saved activations (``offload_activations``).

The step is captured once, on stand-ins (``zgraph.inspect.estimate.prepare``); every combination runs through its
own passes (those it shares with others, the same pass with the same options in the same place, run once:
``zgraph.inspect.variants``) and is estimated: peak bytes by liveness, time by ``Estimate.step_seconds``
(compute and exposed communication from the cost model, plus the tier's transfers). The fastest that fits wins;
ties go to the smaller peak. Plain search, not a solver: a few dozen estimates of one captured graph, fewer where a
combination without offload fits (offload adds transfers, never saves compute: only combinations whose twin without
offload is faster than the fastest that fits are estimated with it).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zgraph.binding.arguments import StepCall
from zgraph.compile.build import pass_context
from zgraph.config import Config
from zgraph.errors import MemoryBudgetError
from zgraph.inspect.estimate import Estimate, Prepared, estimate_variant, prepare
from zgraph.inspect.pipeline_budget import plan_pipeline
from zgraph.inspect.reuse import HeldCapture
from zgraph.inspect.variants import estimate_variants
from zgraph.passes import run_passes
from zgraph.passes.remat import blocks_in

_NEVER_REGATHER = 2**62  # max_reuse_distance that keeps every gathered parameter for the whole step


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One combination the planner estimated.

    Attributes:
        changes: the ``Config`` fields it sets (``{}``: the config as given).
        estimate: its estimate (``peak_bytes``, ``step_seconds``...).
    """

    changes: dict[str, Any]
    estimate: Estimate

    def describe(self) -> str:
        shown = ", ".join(
            f"{k}={_blocks(v) if isinstance(v, dict) else repr(v)}"
            for k, v in self.changes.items()
            if k != "max_reuse_distance"
        )
        if self.changes.get("max_reuse_distance"):
            shown += (", " if shown else "") + "max_reuse_distance=<all parameters>"
        return shown or "the config as given"


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """What ``Config.memory_budget`` chose for a step.

    Attributes:
        budget: the budget, in bytes per rank.
        chosen: the combination that runs.
        nearest: the two next-fastest combinations that also fit (fewer where fewer fit).
        considered: how many combinations were estimated.
    """

    budget: int
    chosen: Choice
    nearest: tuple[Choice, ...]
    considered: int

    def config(self, base: Config) -> Config:
        """``base`` with the plan's choices, and no budget left to plan for."""
        return dataclasses.replace(base, memory_budget=None, **self.chosen.changes)

    def lines(self) -> list[str]:
        """The plan as ``explain()`` prints it."""
        out = [f"memory plan: budget {_mib(self.budget)} per rank, {self.considered} combinations estimated"]
        for label, choice in [("chosen", self.chosen), *(("next", c) for c in self.nearest)]:
            e = choice.estimate
            out.append(
                f"  {label:<7} peak {_mib(e.peak_bytes):>11}  step {e.step_seconds * 1e3:9.3f} ms  {choice.describe()}"
            )
        return out


def _blocks(policies: dict[str, str | None]) -> str:
    """A per-block remat mapping in short: how many blocks get each policy."""
    counts = collections.Counter(policies.values())
    return "{" + ", ".join(f"{policy!r}: {n} block{'s' if n > 1 else ''}" for policy, n in counts.items()) + "}"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def candidates(config: Config, device_type: str, has_blocks: bool = True) -> list[dict[str, Any]]:
    """The combinations of choices the planner may make for ``config`` (module docstring), as field changes."""
    remats = [None, "selective", "full"] if config.remat in (None, "auto") else [config.remat]
    if not has_blocks:
        remats = [r for r in remats if r != "full"]
    reuse = [0, _NEVER_REGATHER] if config.stage == 3 and config.max_reuse_distance == 0 else [None]
    tier = "cpu" if device_type != "cpu" else ("nvme" if config.offload_dir is not None else None)
    optimizer = [0.0, 0.5, 1.0] if tier and config.stage >= 1 and config.offload_optimizer is None else [None]
    params = [None, tier] if tier and config.stage == 3 and config.offload_params is None else [None]
    activations = [None, tier] if tier and config.offload_activations is None else [None]
    out = []
    for remat, distance, fraction, param_tier, stash in itertools.product(
        remats, reuse, optimizer, params, activations
    ):
        changes: dict[str, Any] = {"remat": remat}
        if stash:
            changes["offload_activations"] = stash
        if distance:
            changes["max_reuse_distance"] = distance
        if fraction:
            changes.update(offload_optimizer=tier, offload_fraction=fraction)
        if param_tier:
            changes["offload_params"] = param_tier
        out.append(changes)
    return out


def plan_memory(
    call: StepCall,
    config: Config,
    budget: int | str,
    world_size: int | None = None,
    device: str | torch.device | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> MemoryPlan:
    """The plan for ``call`` under ``budget`` (bytes per rank, or ``"auto"``). Raises ``MemoryBudgetError``, naming
    the smallest budget that fits and what fills it, when nothing fits. ``"auto"`` takes the least free memory
    over ``process_group`` (None: the default group). A pipelined step is planned per rank of the pipeline
    (``zgraph.inspect.pipeline_budget``)."""
    if config.pipeline_parallel is not None:
        return _pipeline_plan(call, config, budget, world_size, device, process_group)
    prepared = prepare_plan(call, config, world_size, device)
    nbytes = free_bytes(prepared.device, process_group) if budget == "auto" else int(budget)
    return plan_prepared(prepared, config, nbytes)


def plan_for_sizes(
    call: StepCall,
    config: Config,
    budget: int | str,
    sizes: Mapping[str | tuple[str, int], int],
    world_size: int | None = None,
    device: str | torch.device | None = None,
    process_group: dist.ProcessGroup | None = None,
    held: HeldCapture | None = None,
) -> MemoryPlan:
    """``plan_memory`` for a step whose arguments have symbolic sizes (``zgraph.mark_dynamic``, or found varying):
    every combination is estimated at ``sizes`` (by symbol name or ``(argument path, dim)``: the largest the step
    will see, a ``mark_dynamic`` ``max=`` or the largest seen so far; the others at the call's sizes), so the plan
    fits every smaller size too. A larger size later needs a plan of its own (the caller plans again). ``held``: the
    step's own capture of the call, copied where it is the graph the plan would trace (``zgraph.inspect.reuse``)."""
    if config.pipeline_parallel is not None and not sizes:
        return _pipeline_plan(call, config, budget, world_size, device, process_group)
    prepared = dataclasses.replace(prepare_plan(call, config, world_size, device, held), sizes=dict(sizes))
    nbytes = free_bytes(prepared.device, process_group) if budget == "auto" else int(budget)
    return plan_prepared(prepared, config, nbytes)


def prepare_plan(
    call: StepCall,
    config: Config,
    world_size: int | None = None,
    device: str | torch.device | None = None,
    held: HeldCapture | None = None,
) -> Prepared:
    """The step captured once for planning (its repeated blocks marked; or ``held`` copied where it is that graph),
    with the passes every combination shares (those before ``remat``) already run on it. A pipelined step with
    symbolic sizes is refused (``ValueError``)."""
    if config.pipeline_parallel is not None:
        raise ValueError(
            "memory_budget plans a pipelined step (Config.pipeline_parallel) at static sizes only: leave "
            "zgraph.mark_dynamic off, or set Config.remat by hand from Estimate.stages"
        )
    capture_config = dataclasses.replace(config, remat="selective", memory_budget=None)
    prepared = prepare(call, capture_config, world_size, device=device, held=held)
    passes = capture_config.passes()
    shared = next((i for i, p in enumerate(passes) if p.name == "remat"), 0)
    if not shared:
        return prepared
    ctx = pass_context(prepared.binding, split=prepared.captured.split is not None)
    records = run_passes(prepared.captured.gm, ctx, passes[:shared], keep=False)
    captured = dataclasses.replace(prepared.captured, gm=records[-1].gm)
    return dataclasses.replace(prepared, captured=captured, ran=shared)


def _pipeline_plan(
    call: StepCall,
    config: Config,
    budget: int | str,
    world_size: int | None,
    device: str | torch.device | None,
    process_group: dist.ProcessGroup | None,
) -> MemoryPlan:
    """``plan_memory`` of a pipelined step: a remat policy per rank (``zgraph.inspect.pipeline_budget``)."""

    def free(planned: torch.device) -> int:
        return free_bytes(planned, process_group)

    nbytes, changes, estimate, considered = plan_pipeline(call, config, budget, world_size, device, free)
    return MemoryPlan(
        budget=nbytes, chosen=Choice(changes=changes, estimate=estimate), nearest=(), considered=considered
    )


def plan_prepared(prepared: Prepared, config: Config, nbytes: int) -> MemoryPlan:
    """The plan for a step ``prepare_plan`` made ready, under ``nbytes`` per rank (``plan_memory``)."""
    blocks = blocks_in(prepared.captured.gm)
    choices = _estimated(prepared, config, candidates(config, prepared.device.type, bool(blocks)), nbytes)
    if not any(c.estimate.peak_bytes <= nbytes for c in choices):
        raise _impossible(nbytes, choices)
    choices += _less_prefetch(prepared, config, choices, nbytes)
    choices += _fewer_blocks(prepared, config, _fastest(choices, nbytes), blocks, nbytes)
    fits = _fitting(choices, nbytes)
    return MemoryPlan(budget=nbytes, chosen=fits[0], nearest=tuple(fits[1:3]), considered=len(choices))


_OFFLOADS = ("offload_activations", "offload_optimizer", "offload_fraction", "offload_params")


def _estimated(prepared: Prepared, config: Config, combos: list[dict[str, Any]], nbytes: int) -> list[Choice]:
    """``combos`` estimated, those that offload only where they may win: offloading adds transfers and never
    compute, so a combination is estimated only if its twin without offload is faster than the fastest combination
    without offload that fits (all of them where none fits)."""
    twins = {tuple(c.items()): c for c in combos if not any(k in c for k in _OFFLOADS)}
    choices = _choices(prepared, config, list(twins.values()))
    seconds = {tuple(c.changes.items()): c.estimate.step_seconds for c in choices}
    bound = min((c.estimate.step_seconds for c in choices if c.estimate.peak_bytes <= nbytes), default=float("inf"))
    more = [
        changes
        for changes in combos
        if tuple(changes.items()) not in twins
        and seconds[tuple((k, v) for k, v in changes.items() if k not in _OFFLOADS)] < bound
    ]
    return choices + _choices(prepared, config, more)


def _choice(prepared: Prepared, config: Config, changes: dict[str, Any]) -> Choice:
    variant = dataclasses.replace(config, memory_budget=None, **changes)
    return Choice(changes=changes, estimate=estimate_variant(prepared, variant))


def _choices(prepared: Prepared, config: Config, combos: list[dict[str, Any]]) -> list[Choice]:
    """``_choice`` of each of ``combos``, the passes they share run once (``zgraph.inspect.variants``)."""
    variants = [dataclasses.replace(config, memory_budget=None, **changes) for changes in combos]
    return [Choice(changes=c, estimate=e) for c, e in zip(combos, estimate_variants(prepared, variants))]


def _fitting(choices: list[Choice], nbytes: int) -> list[Choice]:
    """The choices that fit, fastest first (ties: the smaller peak)."""
    fits = [c for c in choices if c.estimate.peak_bytes <= nbytes]
    return sorted(fits, key=lambda c: (c.estimate.step_seconds, c.estimate.peak_bytes))


def _fastest(choices: list[Choice], nbytes: int) -> Choice:
    return _fitting(choices, nbytes)[0]


def _less_prefetch(prepared: Prepared, config: Config, choices: list[Choice], nbytes: int) -> list[Choice]:
    """Stage 3 with ``prefetch_bytes`` left at ``"auto"``: the (at most three) fastest combinations that are faster
    than the fastest that fits but do not fit themselves, again with each parameter gathered just before its use
    (``prefetch_bytes=1``): fewer gathered bytes in flight, more exposed communication."""
    if config.stage != 3 or config.prefetch_bytes != "auto" or prepared.group.world_size < 2:
        return []
    best = _fastest(choices, nbytes).estimate.step_seconds
    faster = [c for c in choices if c.estimate.peak_bytes > nbytes and c.estimate.step_seconds < best]
    faster.sort(key=lambda c: c.estimate.step_seconds)
    return _choices(prepared, config, [{**c.changes, "prefetch_bytes": 1} for c in faster[:3]])


def _fewer_blocks(prepared: Prepared, config: Config, best: Choice, blocks: list[str], nbytes: int) -> list[Choice]:
    """``best`` with its remat policy on only the first k blocks and a lighter one on the others, for each lighter
    policy the fewest k that fits (bisection); every combination estimated on the way."""
    policy = best.changes.get("remat")
    if config.remat not in (None, "auto") or policy not in ("full", "selective") or len(blocks) < 2:
        return []
    tried: list[Choice] = []
    for lighter in ("selective", None)[("full", "selective").index(policy) :]:
        low, high = 1, len(blocks) - 1  # the fewest k that fits lies in [low, high + 1]
        while low <= high:
            k = (low + high) // 2
            mapping = {name: policy if i < k else lighter for i, name in enumerate(blocks)}
            tried.append(_choice(prepared, config, {**best.changes, "remat": mapping}))
            if tried[-1].estimate.peak_bytes <= nbytes:
                high = k - 1
            else:
                low = k + 1
    return tried


def _impossible(nbytes: int, choices: list[Choice]) -> MemoryBudgetError:
    """The error for a budget nothing fits: the smallest peak, its combination, and what is alive at it."""
    least = min(choices, key=lambda c: c.estimate.peak_bytes)
    e = least.estimate
    state = ", ".join(f"{k} {_mib(v)}" for k, v in e.model_state_bytes.items() if v and k != "total")
    largest = ", ".join(f"{name} {_mib(b)}" for name, b in e.alive_at_peak[:3])
    return MemoryBudgetError(
        f"Config.memory_budget={_mib(nbytes)} per rank cannot be met: the smallest estimated peak of the "
        f"{len(choices)} combinations zgraph may choose is {_mib(e.peak_bytes)} ({least.describe()}), at node "
        f"{e.peak_node}. Model state held between steps: {state or 'none'}; the largest tensors alive at the peak: "
        f"{largest}. Raise the budget to at least {_mib(e.peak_bytes)}, shard more (a higher stage, more ranks), "
        "set offload_dir (NVMe offload on a CPU model), or use a smaller batch."
    )


def free_bytes(device: torch.device, process_group: dist.ProcessGroup | None = None) -> int:
    """``memory_budget="auto"``: the device's free memory — on CUDA what ``cudaMemGetInfo`` calls free plus what
    this process's allocator holds; on the CPU the host's available memory over the node's ranks — the least over
    the ranks of ``process_group`` (None: the default group)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
    else:
        free = _available_host_bytes() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        nccl = dist.get_backend(process_group) == "nccl"
        held = torch.tensor([free], dtype=torch.int64, device=device if nccl else "cpu")
        dist.all_reduce(held, op=dist.ReduceOp.MIN, group=process_group)
        free = int(held.item())
    return free


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
