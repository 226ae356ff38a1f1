"""The checks ``zgraph.Config`` runs on its fields, each raising ``ValueError`` naming the field and saying why.

They take plain values (never a ``Config``: this module does not import ``zgraph.config``), so each check says
which fields it reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from zgraph.passes import Pass, PassContext
from zgraph.passes.remat import POLICIES as REMAT_POLICIES
from zgraph.runtime.hybrid import check_group_size, check_pipeline_groups
from zgraph.runtime.pipeline_schedule import build_schedule

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BITS = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}
_OFFLOAD_TIERS = (None, "cpu", "nvme")

PassFunction = Callable[[fx.GraphModule, PassContext], fx.GraphModule]
"""A user pass given as a plain function: ``fn(gm, ctx) -> gm``."""


def type_name(value: object) -> str:
    return type(value).__name__


def check_choice(name: str, value: object, allowed: tuple[object, ...], typ: type) -> None:
    """``value`` is a ``typ`` (not a bool) among ``allowed``."""
    if not isinstance(value, typ) or isinstance(value, bool):
        raise ValueError(
            f"Config.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r} ({type_name(value)})"
        )
    if value not in allowed:
        raise ValueError(f"Config.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def check_remat(value: object, memory_budget: object) -> object:
    """``Config.remat``: None, ``"selective"``, ``"full"``, ``"auto"`` (chosen by the planner: needs
    ``memory_budget``), or a mapping from block names to None, ``"selective"`` or ``"full"`` (returned as a dict
    of its own). Returns the value."""
    if value == "auto" and memory_budget is None:
        raise ValueError(
            'Config.remat="auto" lets the memory planner choose what to recompute, and it plans for a budget: set '
            'Config.memory_budget too (bytes per rank, "12GiB", or "auto"), or use None, "selective" or "full"'
        )
    if isinstance(value, Mapping):
        for name, policy in value.items():
            if not isinstance(name, str) or not (policy is None or policy in REMAT_POLICIES):
                raise ValueError(
                    "Config.remat as a mapping takes block names (str) to None, 'selective' or 'full'; got "
                    f"{name!r}: {policy!r}"
                )
        return dict(value)
    if value is not None:
        check_choice("remat", value, (*REMAT_POLICIES, "auto"), str)
    return value


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def budget_bytes(value: object) -> int | str | None:
    """``Config.memory_budget`` as bytes: an int stays, ``"12GiB"`` / ``"500MB"`` / ``"1.5 GB"`` become bytes;
    ``"auto"`` and None stay. Raises ``ValueError`` naming the field for anything else."""
    if value is None or value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        nbytes = value
    elif isinstance(value, str):
        number = value.strip().rstrip("BbIiKkMmGgTt ")
        unit = value.strip()[len(number) :].strip().upper()
        try:
            nbytes = int(float(number) * _UNITS[unit]) if unit in _UNITS else -1
        except ValueError:
            nbytes = -1
    else:
        nbytes = -1
    if nbytes <= 0:
        raise ValueError(
            f'Config.memory_budget must be a positive number of bytes per rank (an int, or a string like "12GiB" or '
            f'"500MB"), "auto" (the device\'s free memory) or None; got {value!r}'
        )
    return nbytes


def check_size(name: str, value: object, allow_auto: bool) -> None:
    """``value`` is a non-negative int (or ``"auto"`` where ``allow_auto``)."""
    allowed = "a non-negative int" + (' or "auto"' if allow_auto else "")
    if allow_auto and value == "auto":
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"Config.{name} must be {allowed}; got {value!r} ({type_name(value)})")
    if value < 0:
        raise ValueError(f"Config.{name} must be {allowed}; got {value}")


def check_float_dtype(name: str, value: object) -> None:
    """``value`` is None or a floating dtype zgraph computes in."""
    if value is not None and value not in FLOAT_DTYPES:
        raise ValueError(
            f"Config.{name} must be None or one of torch.float32, torch.bfloat16, torch.float16; got {value!r}"
        )


def check_bool(name: str, value: object, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        either = "True, False or None" if optional else "True or False"
        raise ValueError(f"Config.{name} must be {either}; got {value!r} ({type_name(value)})")


def check_max_grad_norm(value: object) -> None:
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0):
        raise ValueError(f"Config.max_grad_norm must be None or a positive number; got {value!r}")


def check_timeout(timeout: object) -> None:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < float("inf"):
        raise ValueError(f"Config.collective_timeout must be a positive number of seconds; got {timeout!r}")


def check_precision(
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    master_dtype: torch.dtype | None,
    optimizer_state_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
    loss_scale: object,
) -> None:
    """Reject the precision combinations DeepSpeed rejects, saying why (the fields' values, already checked one
    by one)."""
    dtypes = {param_dtype, reduce_dtype, master_dtype, optimizer_state_dtype, autocast_dtype}
    if autocast_dtype == torch.float32:
        raise ValueError(
            "Config.autocast_dtype must be None, torch.bfloat16 or torch.float16 (torch.autocast's lower-precision "
            "dtypes); got torch.float32"
        )
    if optimizer_state_dtype == torch.float16:
        raise ValueError(
            "Config.optimizer_state_dtype=torch.float16 is rejected (as DeepSpeed rejects fp16 optimizer states): "
            "Adam's second moment squares gradients and leaves fp16's range; use torch.bfloat16 or torch.float32"
        )
    if torch.float16 in dtypes and torch.bfloat16 in dtypes:
        raise ValueError(
            "Config mixes torch.float16 and torch.bfloat16 (param/reduce/master/optimizer-state dtypes); DeepSpeed "
            "enables fp16 or bf16, not both: pick one 16-bit format"
        )
    fp16 = torch.float16 in dtypes
    if fp16 and loss_scale is None:
        raise ValueError(
            "Config uses torch.float16 without loss_scale: fp16's 5-bit exponent flushes small gradients to zero; "
            'set loss_scale="dynamic" (as DeepSpeed does for fp16) or a float'
        )
    if loss_scale is not None and torch.bfloat16 in dtypes:
        raise ValueError(
            "Config.loss_scale is set with a torch.bfloat16 dtype: loss scaling is fp16's (DeepSpeed enables fp16 or "
            "bf16, not both), and bf16 has float32's exponent range, so it needs none"
        )
    master, compute = master_dtype, param_dtype
    if master is not None and compute is not None and _BITS[master] < _BITS[compute]:
        raise ValueError(
            f"Config.master_dtype={master} is less precise than param_dtype={compute}: the master weights would lose "
            "what the updates add; use a master dtype at least as wide as the compute dtype"
        )


def check_offload(
    *,
    stage: int,
    offload_optimizer: object,
    offload_params: object,
    offload_dir: object,
    offload_fraction: object,
) -> None:
    """Offload options: known tiers, a fraction in [0, 1], a directory for "nvme", the ZeRO stage they need."""
    for name, value in (("offload_optimizer", offload_optimizer), ("offload_params", offload_params)):
        if value not in _OFFLOAD_TIERS or isinstance(value, bool):
            raise ValueError(f'Config.{name} must be None, "cpu" or "nvme"; got {value!r}')
    fraction = offload_fraction
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Config.offload_fraction must be a number in [0, 1] (a share of the bytes); got {fraction!r}")
    directory = offload_dir
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"Config.offload_dir must be None or a directory path; got {directory!r}")
    tiers = {offload_optimizer, offload_params}
    if "nvme" in tiers and directory is None:
        raise ValueError('Config offload to "nvme" needs offload_dir: the directory its files are written in')
    if tiers != {None} and stage == 0:
        raise ValueError(
            "Config offload_optimizer / offload_params at stage 0: offload needs ZeRO stage >= 1 (DeepSpeed "
            "requires ZeRO >= 1 for offload too); set stage=1, 2 or 3"
        )
    if offload_params is not None and stage < 3:
        raise ValueError(
            f"Config.offload_params={offload_params!r} at stage {stage}: parameters are offloaded "
            "only when they are sharded, at stage 3 (as DeepSpeed's offload_param); set stage=3 or use "
            "offload_optimizer"
        )


def check_host_update(
    *, offload_optimizer: object, offload_fraction: object, offload_update: object, offload_overlap: object
) -> None:
    """``Config.offload_update`` (``"auto"``, ``"host"``, ``"device"``) and ``Config.offload_overlap`` (None,
    ``"one_step"``): ``"host"`` needs ``offload_optimizer="cpu"`` with every state offloaded; an overlap needs the
    update on the host."""
    check_choice("offload_update", offload_update, ("auto", "host", "device"), str)
    if offload_overlap is not None:
        check_choice("offload_overlap", offload_overlap, ("one_step",), str)
    if offload_update == "host" and offload_optimizer != "cpu":
        raise ValueError(
            f'Config.offload_update="host" needs offload_optimizer="cpu" (got {offload_optimizer!r}): the host '
            "updates the states that host memory keeps"
        )
    if offload_update == "host" and offload_fraction != 1.0:
        raise ValueError(
            f'Config.offload_update="host" with offload_fraction={offload_fraction}: the host updates a parameter '
            'only when all of its states live there; use offload_fraction=1.0, or offload_update="device"'
        )
    if offload_overlap is not None and (offload_optimizer != "cpu" or offload_update == "device"):
        raise ValueError(
            f"Config.offload_overlap={offload_overlap!r} overlaps the host update with the next step: it needs "
            f'offload_optimizer="cpu" with the update on the host (offload_update "auto" or "host"); got '
            f"offload_optimizer={offload_optimizer!r}, offload_update={offload_update!r}"
        )


def check_offload_activations(tier: object, offload_dir: object) -> None:
    """``Config.offload_activations``: None, ``"cpu"`` or ``"nvme"`` (which needs ``offload_dir``); any stage."""
    if tier not in _OFFLOAD_TIERS or isinstance(tier, bool):
        raise ValueError(f'Config.offload_activations must be None, "cpu" or "nvme"; got {tier!r}')
    if tier == "nvme" and offload_dir is None:
        raise ValueError(
            'Config.offload_activations="nvme" needs offload_dir: the directory the saved activations\' files are '
            "written in"
        )


def module_classes(name: str, value: object) -> tuple[type[nn.Module], ...]:
    """``value`` as a tuple of ``nn.Module`` subclasses (a list or a single class accepted), else a ValueError."""
    classes = (value,) if isinstance(value, type) else value
    if isinstance(classes, (tuple, list)) and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        return tuple(classes)
    raise ValueError(
        f"Config.{name} must be a tuple of nn.Module subclasses (e.g. (nn.BatchNorm2d, nn.LayerNorm)); got {value!r}"
    )


def as_str_tuple(name: str, value: object) -> tuple[str, ...]:
    """``value`` (a list, tuple or set of pass names) as a tuple of str, else a ValueError."""
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise ValueError(f"Config.{name} must be a list of pass names; got {value!r} ({type_name(value)})")
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"Config.{name} must contain pass names (str); got {item!r} ({type_name(item)})")
    return items


def as_pass_tuple(value: object) -> tuple[Pass, ...]:
    """``extra_passes`` as ``Pass`` objects: a plain ``fn(gm, ctx) -> gm`` becomes a pass named after it."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"Config.extra_passes must be a list of zgraph.passes.Pass or fn(gm, ctx) -> gm; got {value!r}"
        )
    passes: list[Pass] = []
    for item in value:
        if isinstance(item, Pass):
            passes.append(item)
        elif isinstance(item, Callable):
            passes.append(Pass(name=getattr(item, "__name__", repr(item)), fn=item))
        else:
            raise ValueError(
                "Config.extra_passes must contain zgraph.passes.Pass objects or callables fn(gm, ctx) -> gm; "
                f"got {item!r} ({type_name(item)})"
            )
    return tuple(passes)


def check_groups(stage: int, shard: object, secondary: object, cross_dtype: object) -> None:
    """``shard_group_size`` / ``secondary_shard_group_size`` (positive ints or None; hpZ needs stage 3 and not
    both), ``cross_group_dtype`` (a 16-bit float dtype, with one of them); each group size must divide the
    world size where it is known already (torchrun's ``WORLD_SIZE``, or a started default group). Checked again
    against the step's group on its first call."""
    for name, value in (("shard_group_size", shard), ("secondary_shard_group_size", secondary)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"Config.{name} must be None or a positive int (ranks per group); got {value!r}")
    if secondary is not None and stage != 3:
        raise ValueError(
            f"Config.secondary_shard_group_size={secondary} (DeepSpeed's zero_hpz_partition_size) needs stage=3 "
            f"(hpZ keeps a secondary shard of the parameters stage 3 shards); got stage={stage}"
        )
    if secondary is not None and shard is not None:
        raise ValueError(
            "Config.secondary_shard_group_size (hpZ) and Config.shard_group_size (hybrid sharding) cannot be "
            "combined: hpZ shards parameters across every rank, hybrid sharding within groups; pick one"
        )
    if cross_dtype is not None:
        if cross_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"Config.cross_group_dtype must be torch.bfloat16 or torch.float16; got {cross_dtype!r}")
        if shard is None and secondary is None:
            raise ValueError(
                "Config.cross_group_dtype needs groups to cross: set shard_group_size or secondary_shard_group_size"
            )
    world = known_world_size()
    if world is not None:
        check_group_size("shard_group_size", shard, world)
        check_group_size("secondary_shard_group_size", secondary, world)


def known_world_size() -> int | None:
    """The world size, where known before any step runs: a started default group's, else torchrun's
    ``WORLD_SIZE``; None otherwise."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def check_pipeline(config: Any) -> None:
    """``Config``'s pipeline fields: counts, the schedule (``zgraph.runtime.pipeline_schedule.build_schedule``
    checks it against them), the split's length, and what pipelines do not combine with yet."""
    p, v = config.pipeline_parallel, config.pipeline_virtual_stages
    if p is None:
        defaults = {"microbatches": None, "schedule": "1f1b", "pipeline_virtual_stages": 1, "pipeline_split": ()}
        changed = [n for n, d in {**defaults, "pipeline_regather": False}.items() if getattr(config, n) != d]
        if changed:
            raise ValueError(f"Config.{changed[0]} is a pipeline parallelism option: set Config.pipeline_parallel")
        return
    for name in ("pipeline_parallel", "pipeline_virtual_stages", "microbatches"):
        value = getattr(config, name)
        if not (value is None and name == "microbatches") and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"Config.{name} must be a positive int; got {value!r}")
    build_schedule(config.schedule, p, config.microbatches or p, v)
    if config.pipeline_split and len(config.pipeline_split) != p * v - 1:
        raise ValueError(
            f"Config.pipeline_split names the first block of each stage after the first, {p * v - 1} for {p} x {v} "
            f"stages; got {len(config.pipeline_split)}"
        )
    unsupported = {
        "secondary_shard_group_size": config.secondary_shard_group_size is not None,
        "offload_optimizer": config.offload_optimizer is not None,
        "offload_params": config.offload_params is not None,
        "offload_activations": config.offload_activations is not None,
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise ValueError(
            f"Config.pipeline_parallel does not combine with {named[0]}={getattr(config, named[0])!r} yet: pipelines "
            "run at ZeRO 0-3 within each stage's data-parallel group (with hybrid sharding and sequence parallelism), "
            "without offload or hpZ (a stage gathers its parameters once a step, or with pipeline_regather before each "
            "action from the primary shards: no secondary copy to serve)"
        )
    if config.pipeline_regather and config.stage != 3:
        raise ValueError(
            f"Config.pipeline_regather re-gathers ZeRO 3's parameter shards: set stage=3 (got {config.stage})"
        )
    world = known_world_size()
    if world is not None and world % (p * (config.sequence_parallel or 1)):
        raise ValueError(pipeline_world_error(p, world, config.sequence_parallel))
    check_pipeline_groups(config.shard_group_size, p, world)


def pipeline_world_error(p: int, world: int, sequence_parallel: int | None = None) -> str:
    if sequence_parallel is None or sequence_parallel == 1:
        return (
            f"Config.pipeline_parallel={p} must divide the world size ({world}): the ranks form world / P pipelines "
            "of P consecutive ranks each (zgraph.pipeline_batch gives each its rows)"
        )
    sp = sequence_parallel
    return (
        f"Config.pipeline_parallel={p} x sequence_parallel={sp} = {p * sp} must divide the world size ({world}): "
        f"the ranks form world / {p * sp} pipelines of {p} stages, each stage run by {sp} consecutive ranks holding "
        "a slice of every sequence each (zgraph.pipeline_batch gives each rank its rows and slice)"
    )


def check_sequence_parallel(value: object) -> None:
    """``Config.sequence_parallel``: None or a positive int dividing the world size where it is known."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"Config.sequence_parallel must be None or a positive int (ranks per sequence); got {value!r}")
    world = known_world_size()
    if world is not None:
        check_group_size("sequence_parallel", value, world)
