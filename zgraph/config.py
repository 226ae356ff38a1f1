"""``zgraph.Config``: every option of a distributed step, validated when it is built."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zgraph.deepspeed.config import config_fields_from_deepspeed
from zgraph.runtime.agreement import DEFAULT_COLLECTIVE_TIMEOUT

_BACKENDS = ("inductor", "eager")
_STAGES = (0, 1, 2, 3)
# Normalization layers: their statistics lose too much in 16 bits, and their kernels take a 16-bit input with
# fp32 weights (and fp32 running statistics). _NormBase is every BatchNorm, SyncBatchNorm and InstanceNorm.
NORM_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
)


@dataclass(frozen=True, kw_only=True)
class Config:
    """Options of ``@zgraph.distribute``. Frozen; every field is checked when the object is created.

    Attributes:
        stage: ZeRO stage, with DeepSpeed's meaning. 0: data parallel (gradients all-reduced, everything
            replicated). 1: optimizer state sharded across ranks. 2: gradients sharded too (reduce-scattered).
            3: parameters sharded too (all-gathered around their uses). Default 0.
        backend: ``"inductor"`` compiles the transformed graph with inductor; ``"eager"`` runs the transformed
            FX GraphModule op by op (no compile time, same numbers). Default ``"inductor"``.
        disable_passes: names of pipeline passes to skip (see ``zgraph.passes.default_pipeline``). An unknown
            name, or a pass another enabled pass depends on, is rejected before anything runs.
        extra_passes: user passes, each a ``zgraph.passes.Pass`` or a plain ``fn(gm, ctx) -> gm`` (named after
            the function, appended at the end of the pipeline).
        allgather_bucket_bytes: largest all-gather the ``bucket`` pass builds by merging parameter gathers, in
            bytes of the gathered (whole) tensors; 0 disables merging; ``"auto"`` (default) sizes buckets from
            the cost model so that a collective's latency is a tenth of its transfer time.
        reduce_bucket_bytes: the same for gradient reduce-scatters and all-reduces.
        prefetch_bytes: stage 3: how many bytes of parameters the ``schedule`` pass may have gathered ahead of
            their first use (issued or landed, not yet used); ``"auto"`` (default): two all-gather buckets. With
            an offload tier in use (``"nvme"``, or ``"cpu"`` for a GPU model) also the bytes of optimizer states
            and parameter shards read ahead of their reload (and of write-backs in flight); ``"auto"``: 64 MiB.
        param_persistence_threshold: stage 3: parameters with at most this many elements are not sharded; they
            stay whole on every rank and need no all-gather (DeepSpeed's
            ``stage3_param_persistence_threshold``, same default: 100000).
        max_reuse_distance: stage 3: a parameter gathered for one use region (the forward's, say) stays gathered
            for its next one (the backward's) instead of being gathered again, when at most this many elements of
            other parameters are gathered in between. 0 (default): gathered again for every region, the least
            memory (FSDP2's ``reshard_after_forward=True``). The number of parameters in the model: gathered once
            per step (as ``reshard_after_forward=False``). DeepSpeed's ``stage3_max_reuse_distance`` (DeepSpeed
            counts every module's parameters it passes, zgraph each other parameter once); ``from_deepspeed``
            maps it, and a DeepSpeed config that leaves it out gets DeepSpeed's default, 1e9.
        measure_collectives: fit the collective cost model (latency + bytes / bandwidth) by a short
            measurement on the first call, cached per machine and world size; False uses an analytical model.
        param_dtype: dtype parameters are used in by forward and backward (the compute dtype); in stage 3 they
            are gathered in it. None (default): the parameters' own dtype. Like FSDP2's
            ``MixedPrecisionPolicy.param_dtype``; gradients flow back to the master parameters.
        keep_fp32_modules: module classes whose parameters ``param_dtype`` does not cast: they are read in their
            own (master) dtype, in stage 3 gathered in it — FSDP2's per-module ``MixedPrecisionPolicy``,
            DeepSpeed's ``lower_precision_safe_modules`` the other way round. A parameter is kept when every
            module holding it is an instance of one of these classes or lies inside one. Inputs are not cast:
            normalization layers take a 16-bit input with fp32 weights and return the input's dtype; another
            module kept in fp32 should cast its input itself. Default: the normalization layers
            (``NORM_MODULES``: every BatchNorm, SyncBatchNorm and InstanceNorm, ``LayerNorm``, ``GroupNorm``,
            ``RMSNorm``); ``()`` casts every parameter. Without ``param_dtype`` it changes nothing.
        reduce_dtype: dtype gradients are averaged across ranks in. None (default): the dtype backward
            produces them in.
        master_dtype: dtype the parameters (the master weights) and the gradients left on them are stored in;
            zgraph converts the model on the first call. None (default): as the model is. ``torch.bfloat16`` is
            DeepSpeed's ``bf16_master_weights_and_grads``; ``torch.float16`` its
            ``fp16_master_weights_and_gradients`` (needs ``loss_scale``).
        optimizer_state_dtype: dtype of optimizer state tensors of a parameter's shape (Adam's moments, SGD's
            momentum). None (default): the master dtype. ``torch.bfloat16`` is DeepSpeed's
            ``bf16_optimizer_states``; ``torch.float16`` is rejected, as DeepSpeed does. With 16-bit master
            weights or states set here the update is computed in float32 and rounded once when stored; a model
            that is 16-bit itself, without them, is updated as eager PyTorch's optimizer updates it.
        loss_scale: fp16 loss scaling. None (default): none. A float: a static scale. ``"dynamic"`` or a
            ``zgraph.DynamicLossScale``: DeepSpeed's dynamic scaling — steps whose gradients overflow (on any
            rank) are skipped and the scale backs off; after ``growth_interval`` good steps it grows.
        max_grad_norm: clip gradients to this global norm (over every rank's shards) before the optimizer
            step, as ``torch.nn.utils.clip_grad_norm_`` would. None (default): no clipping.
        autocast_dtype: run the forward of each model the step uses under ``torch.autocast`` with this dtype
            (DeepSpeed's ``torch_autocast`` section); the loss and the rest of the step are outside it, and an
            autocast region written in the step is honoured as it is. None (default): no autocast added.
        keep_host_memory: keep freed host memory for the next step instead of returning it to the operating
            system and faulting it back in, as PyTorch's CUDA caching allocator keeps device memory (on glibc:
            malloc serves every block from its heap and never trims it; see ``zgraph.runtime.host_memory``).
            The resident size then stays at its peak between steps. It changes malloc for the whole process,
            not only zgraph's tensors, so it is opt-in: default False. Setting ``GLIBC_TUNABLES`` (see
            ``zgraph.runtime.host_memory``) before Python starts does the same for any program.
        collective_timeout: seconds a rank waits for the others, at any zgraph synchronisation point and in any
            collective of the step, before it raises ``zgraph.RankFailedError`` naming the rank that failed (and
            its error) or the call each rank was last in. Default 300 (five minutes); it must cover the
            difference between ranks' compile times on the first call.
        offload_optimizer: where optimizer states (Adam's moments...) live between steps. None (default): in
            memory on the compute device. ``"cpu"``: host memory — on a CPU machine the identity (they are there
            already); with the model on a GPU, pinned host memory: the ``offload`` pass puts a ``zgraph.reload``
            node before each state's first read and a ``zgraph.write_back`` node after its update, and the runtime
            copies states to the GPU ahead of their reload and back behind their update on a copy stream, within
            ``prefetch_bytes`` (the update runs on the GPU: bitwise as without offload). ``"nvme"``: files under
            ``offload_dir`` (model on the CPU only, for now), read ahead and written behind on an I/O thread (see
            ``zgraph.runtime.offload``). Needs stage >= 1 (DeepSpeed's ZeRO-Offload does too). DeepSpeed's
            ``zero_optimization.offload_optimizer``.
        offload_params: where sharded parameters live between uses (stage 3 only): None (default), ``"cpu"``
            (the identity on a CPU machine; with the model on a GPU, pinned host memory, as for the optimizer).
            ``"nvme"``: each rank's parameter shards live in files under ``offload_dir`` between steps; the
            ``offload`` pass reloads a shard right before each phase's first read (the forward's all-gather, the
            backward's re-gather, the optimizer's update) and writes it back after its update. Parameters under
            ``param_persistence_threshold`` (whole on every rank) stay in memory. Combines with
            ``offload_optimizer``. DeepSpeed's ``zero_optimization.offload_param``.
        offload_dir: directory the ``"nvme"`` tier writes its files in (each process in its own new
            subdirectory, removed at exit and when the step is dropped). Required with ``"nvme"``; checked at
            the first call (it must exist and be writable). DeepSpeed's ``nvme_path``.
        offload_fraction: share of the optimizer states, by bytes, that ``offload_optimizer`` moves, in whole
            state tensors, first parameters first; 1.0
            (default) moves all, 0.0 none. DeepSpeed's ``offload_optimizer.ratio`` (ZeRO-Offload++).
    """

    stage: int = 0
    backend: str = "inductor"
    disable_passes: tuple[str, ...] = ()
    extra_passes: tuple[Any, ...] = field(default=())
    allgather_bucket_bytes: int | str = "auto"
    reduce_bucket_bytes: int | str = "auto"
    prefetch_bytes: int | str = "auto"
    param_persistence_threshold: int = 100_000
    max_reuse_distance: int = 0
    measure_collectives: bool = True
    param_dtype: torch.dtype | None = None
    keep_fp32_modules: tuple[type[nn.Module], ...] = NORM_MODULES
    reduce_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None
    optimizer_state_dtype: torch.dtype | None = None
    loss_scale: float | str | DynamicLossScale | None = None
    max_grad_norm: float | None = None
    autocast_dtype: torch.dtype | None = None
    keep_host_memory: bool = False
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    offload_optimizer: str | None = None
    offload_params: str | None = None
    offload_dir: str | os.PathLike | None = None
    offload_fraction: float = 1.0

    def __post_init__(self) -> None:
        _check_choice("stage", self.stage, _STAGES, int)
        _check_choice("backend", self.backend, _BACKENDS, str)
        for name in ("allgather_bucket_bytes", "reduce_bucket_bytes", "prefetch_bytes"):
            _check_size(name, getattr(self, name), allow_auto=True)
        _check_size("param_persistence_threshold", self.param_persistence_threshold, allow_auto=False)
        _check_size("max_reuse_distance", self.max_reuse_distance, allow_auto=False)
        for name in ("param_dtype", "reduce_dtype", "master_dtype", "optimizer_state_dtype", "autocast_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOAT_DTYPES:
                raise ValueError(
                    f"Config.{name} must be None or one of torch.float32, torch.bfloat16, torch.float16; got {value!r}"
                )
        object.__setattr__(self, "keep_fp32_modules", _module_classes("keep_fp32_modules", self.keep_fp32_modules))
        self._check_loss_scale()
        if self.max_grad_norm is not None and (
            not isinstance(self.max_grad_norm, (int, float))
            or isinstance(self.max_grad_norm, bool)
            or not self.max_grad_norm > 0
        ):
            raise ValueError(f"Config.max_grad_norm must be None or a positive number; got {self.max_grad_norm!r}")
        _check_precision(self)
        for name in ("measure_collectives", "keep_host_memory"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"Config.{name} must be True or False; got {value!r} ({_type_name(value)})")
        timeout = self.collective_timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < float("inf"):
            raise ValueError(f"Config.collective_timeout must be a positive number of seconds; got {timeout!r}")
        _check_offload(self)
        object.__setattr__(self, "disable_passes", _as_str_tuple("disable_passes", self.disable_passes))
        object.__setattr__(self, "extra_passes", _as_pass_tuple(self.extra_passes))

    def pipeline_options(self) -> dict[str, Any]:
        """The options ``zgraph.passes.default_pipeline`` binds to its passes."""
        return dict(
            stage=self.stage,
            max_reuse_distance=self.max_reuse_distance,
            allgather_bucket_bytes=self.allgather_bucket_bytes,
            reduce_bucket_bytes=self.reduce_bucket_bytes,
            prefetch_bytes=self.prefetch_bytes,
            reduce_dtype=self.reduce_dtype or self.param_dtype,
            offload_optimizer=self.offload_optimizer,
            offload_fraction=self.offload_fraction,
            offload_params=self.offload_params,
        )

    def _check_loss_scale(self) -> None:
        value = self.loss_scale
        if value is None or isinstance(value, DynamicLossScale):
            return
        if value == "dynamic":
            object.__setattr__(self, "loss_scale", DynamicLossScale())
            return
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            object.__setattr__(self, "loss_scale", float(value))
            return
        raise ValueError(
            f'Config.loss_scale must be None, "dynamic", a zgraph.DynamicLossScale or a positive float; got {value!r}'
        )

    @classmethod
    def from_deepspeed(cls, source: Mapping[str, Any] | str | os.PathLike, **overrides: Any) -> Config:
        """A Config from a DeepSpeed JSON config (a dict, or the path of a JSON file); keywords override fields.
        Every key is mapped, accepted or rejected with a ``ValueError`` that says why (see
        ``zgraph.deepspeed.config`` for the table)."""
        fields = config_fields_from_deepspeed(source)
        scale = fields.get("loss_scale")
        if isinstance(scale, Mapping):  # dynamic scaling, as DynamicLossScale's keyword arguments
            fields["loss_scale"] = DynamicLossScale(**scale)
        return cls(**{**fields, **overrides})

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (validated like a new Config)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic fp16 loss scaling, with DeepSpeed's meaning and defaults.

    Attributes:
        init_scale: first scale (DeepSpeed ``initial_scale_power`` 16: 2**16).
        growth_factor: the scale is multiplied by this after ``growth_interval`` steps without overflow.
        backoff_factor: the scale is multiplied by this when a step overflows (after ``hysteresis`` overflows).
        growth_interval: steps without overflow before the scale grows (DeepSpeed ``loss_scale_window``).
        hysteresis: overflows tolerated before the scale backs off (DeepSpeed ``hysteresis``); every
            overflowing step is skipped regardless.
        min_scale: the scale never goes below this (DeepSpeed ``min_loss_scale``).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        checks = {
            "init_scale": self.init_scale > 0,
            "growth_factor": self.growth_factor >= 1,
            "backoff_factor": 0 < self.backoff_factor <= 1,
            "growth_interval": isinstance(self.growth_interval, int) and self.growth_interval >= 1,
            "hysteresis": isinstance(self.hysteresis, int) and self.hysteresis >= 1,
            "min_scale": 0 < self.min_scale <= self.init_scale,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"DynamicLossScale.{name} is out of range: {getattr(self, name)!r}")


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BITS = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}


def _check_precision(config: Config) -> None:
    """Reject the precision combinations DeepSpeed rejects, saying why."""
    dtypes = {
        config.param_dtype,
        config.reduce_dtype,
        config.master_dtype,
        config.optimizer_state_dtype,
        config.autocast_dtype,
    }
    if config.autocast_dtype == torch.float32:
        raise ValueError(
            "Config.autocast_dtype must be None, torch.bfloat16 or torch.float16 (torch.autocast's lower-precision "
            "dtypes); got torch.float32"
        )
    if config.optimizer_state_dtype == torch.float16:
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
    if fp16 and config.loss_scale is None:
        raise ValueError(
            "Config uses torch.float16 without loss_scale: fp16's 5-bit exponent flushes small gradients to zero; "
            'set loss_scale="dynamic" (as DeepSpeed does for fp16) or a float'
        )
    if config.loss_scale is not None and torch.bfloat16 in dtypes:
        raise ValueError(
            "Config.loss_scale is set with a torch.bfloat16 dtype: loss scaling is fp16's (DeepSpeed enables fp16 or "
            "bf16, not both), and bf16 has float32's exponent range, so it needs none"
        )
    master, compute = config.master_dtype, config.param_dtype
    if master is not None and compute is not None and _BITS[master] < _BITS[compute]:
        raise ValueError(
            f"Config.master_dtype={master} is less precise than param_dtype={compute}: the master weights would lose "
            "what the updates add; use a master dtype at least as wide as the compute dtype"
        )


_OFFLOAD_TIERS = (None, "cpu", "nvme")


def _check_offload(config: Config) -> None:
    """Offload options: known tiers, a fraction in [0, 1], a directory for "nvme", the ZeRO stage they need."""
    for name in ("offload_optimizer", "offload_params"):
        value = getattr(config, name)
        if value not in _OFFLOAD_TIERS or isinstance(value, bool):
            raise ValueError(f'Config.{name} must be None, "cpu" or "nvme"; got {value!r}')
    fraction = config.offload_fraction
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Config.offload_fraction must be a number in [0, 1] (a share of the bytes); got {fraction!r}")
    directory = config.offload_dir
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"Config.offload_dir must be None or a directory path; got {directory!r}")
    tiers = {config.offload_optimizer, config.offload_params}
    if "nvme" in tiers and directory is None:
        raise ValueError('Config offload to "nvme" needs offload_dir: the directory its files are written in')
    if tiers != {None} and config.stage == 0:
        raise ValueError(
            "Config offload_optimizer / offload_params at stage 0: offload needs ZeRO stage >= 1 (DeepSpeed "
            "requires ZeRO >= 1 for offload too); set stage=1, 2 or 3"
        )
    if config.offload_params is not None and config.stage < 3:
        raise ValueError(
            f"Config.offload_params={config.offload_params!r} at stage {config.stage}: parameters are offloaded "
            "only when they are sharded, at stage 3 (as DeepSpeed's offload_param); set stage=3 or use "
            "offload_optimizer"
        )


def _module_classes(name: str, value: Any) -> tuple[type[nn.Module], ...]:
    """``value`` as a tuple of ``nn.Module`` subclasses (a list or a single class accepted), else a ValueError."""
    classes = (value,) if isinstance(value, type) else value
    if isinstance(classes, (tuple, list)) and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        return tuple(classes)
    raise ValueError(
        f"Config.{name} must be a tuple of nn.Module subclasses (e.g. (nn.BatchNorm2d, nn.LayerNorm)); got {value!r}"
    )


def _type_name(value: object) -> str:
    return type(value).__name__


def _check_choice(name: str, value: object, allowed: tuple, typ: type) -> None:
    if not isinstance(value, typ) or isinstance(value, bool):
        raise ValueError(
            f"Config.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r} ({_type_name(value)})"
        )
    if value not in allowed:
        raise ValueError(f"Config.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _check_size(name: str, value: object, allow_auto: bool) -> None:
    allowed = "a non-negative int" + (' or "auto"' if allow_auto else "")
    if allow_auto and value == "auto":
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"Config.{name} must be {allowed}; got {value!r} ({_type_name(value)})")
    if value < 0:
        raise ValueError(f"Config.{name} must be {allowed}; got {value}")


def _as_str_tuple(name: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise ValueError(f"Config.{name} must be a list of pass names; got {value!r} ({_type_name(value)})")
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"Config.{name} must contain pass names (str); got {item!r} ({_type_name(item)})")
    return items


def _as_pass_tuple(value: object) -> tuple[Any, ...]:
    from zgraph.passes import Pass

    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"Config.extra_passes must be a list of zgraph.passes.Pass or fn(gm, ctx) -> gm; got {value!r}"
        )
    passes = []
    for item in value:
        if isinstance(item, Pass):
            passes.append(item)
        elif isinstance(item, Callable):
            passes.append(Pass(name=getattr(item, "__name__", repr(item)), fn=item))
        else:
            raise ValueError(
                "Config.extra_passes must contain zgraph.passes.Pass objects or callables fn(gm, ctx) -> gm; "
                f"got {item!r} ({_type_name(item)})"
            )
    return tuple(passes)
