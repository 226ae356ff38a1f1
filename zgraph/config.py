"""``zgraph.Config``: every option of a distributed step, validated when it is built.

Each field is documented by the docstring right under it; ``Config.__doc__`` lists them all (built from those
docstrings when the module is imported). A field that ``zgraph.passes.default_passes`` takes says so in its
metadata (``PASS_OPTION``), and ``Config.pass_options()`` is derived from that. The checks live in
``zgraph.config_checks``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zgraph.config_checks import (
    PassFunction,
    as_pass_tuple,
    as_str_tuple,
    budget_bytes,
    check_bool,
    check_choice,
    check_float_dtype,
    check_groups,
    check_host_update,
    check_max_grad_norm,
    check_offload,
    check_offload_activations,
    check_pipeline,
    check_precision,
    check_remat,
    check_sequence_parallel,
    check_size,
    check_timeout,
    module_classes,
)
from zgraph.config_deprecated import DeprecatedNames
from zgraph.config_docs import doc_with_attributes, field_docs
from zgraph.config_loss_scale import DynamicLossScale, loss_scale_value
from zgraph.deepspeed.config import config_fields_from_deepspeed
from zgraph.passes import Pass, build_pass_list, default_passes
from zgraph.runtime.agreement import DEFAULT_COLLECTIVE_TIMEOUT

_BACKENDS = ("inductor", "eager")
_STAGES = (0, 1, 2, 3)
# Kept in fp32: their statistics lose too much in 16 bits (_NormBase: every BatchNorm, SyncBatchNorm, InstanceNorm)
NORM_MODULES: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)

PASS_OPTION = "pass_option"
"""Field metadata key: the keyword argument of ``zgraph.passes.default_passes`` the field's value is passed as."""
PASS_OPTION_FALLBACK = "pass_option_fallback"
"""Field metadata key: the field whose value is passed instead when this field is None."""


def _pass_option(keyword: str, *, fallback: str | None = None) -> dict[str, str]:
    """The metadata of a field ``default_passes`` takes as ``keyword`` (``fallback``: the field used if None)."""
    return {PASS_OPTION: keyword} if fallback is None else {PASS_OPTION: keyword, PASS_OPTION_FALLBACK: fallback}


@dataclass(frozen=True, kw_only=True)
class Config(DeprecatedNames):
    """Options of ``@zgraph.distribute``. Frozen; every field is checked when the object is created."""

    # --- Sharding, backend and passes ---

    stage: int = field(default=0, metadata=_pass_option("stage"))
    """ZeRO stage, with DeepSpeed's meaning. 0: data parallel (gradients all-reduced, everything replicated). 1:
    optimizer state sharded across ranks. 2: gradients sharded too (reduce-scattered). 3: parameters sharded too
    (all-gathered around their uses). Default 0."""

    shard_group_size: int | None = None
    """Hybrid sharding (FSDP2's HSDP): ranks per shard group. State is sharded, as the stage says, within groups of
    this many consecutive ranks (a node's, typically), replicated across them: gradients reduce-scattered within a
    group, their shards all-reduced across groups; parameters gathered within it. It must divide the world size; with
    ``pipeline_parallel=P``, ``world / P``: it counts ranks of a stage's data-parallel group (ranks p, p+P, ...)."""

    secondary_shard_group_size: int | None = None
    """Stage 3: ZeRO++'s hierarchical partitioning (hpZ; DeepSpeed's ``zero_hpz_partition_size``). Parameters stay
    sharded across every rank; each forward all-gather leaves a secondary shard cut across groups of this many
    consecutive ranks, which the backward re-gathers within the group (the ``secondary_shards`` pass). It must
    divide the world size; not with ``shard_group_size`` or pipelines (nothing re-gathers there). None: off."""

    cross_group_dtype: torch.dtype | None = field(default=None, metadata=_pass_option("cross_group_dtype"))
    """``torch.bfloat16`` or ``torch.float16``: collectives between groups run in it (ZeRO++'s qgZ / qwZ in spirit):
    with ``shard_group_size`` the all-reduce of gradient shards across groups, with hpZ the forward's parameter
    gathers and the gradients' reduce-scatters. It rounds what crosses. None (default): their own dtype."""

    sequence_parallel: int | None = None
    """Sequence parallelism (DeepSpeed-Ulysses): ranks per sequence group. Each rank of a group of this many
    consecutive ranks gets one slice of every sequence (``zgraph.shard_sequence``); the ``sequence_parallel`` pass
    puts all-to-alls around attention so it runs on whole sequences for a share of the heads (the head count must
    divide by it). ZeRO shards over every rank. It (``P x SP`` with pipelines) must divide the world size. None: off."""

    pipeline_parallel: int | None = None
    """Pipeline parallelism: ranks per pipeline, ``P``. The captured step is cut into ``P * pipeline_virtual_stages``
    stages between the model's repeated blocks (the ``stage_cut`` pass); stage ``s`` runs on rank ``s % P``, which
    holds and updates only its stages' parameters and optimizer state, and activations and their gradients move
    between stages by point-to-point sends. P must divide the world size: ``world / P`` pipelines of P consecutive
    ranks, each on its rows of the batch (``zgraph.pipeline_batch``), a stage's gradients all-reduced over the
    pipelines once per step; ZeRO 1-3 shard within that group (3: parameters gathered once a step). None: off."""

    microbatches: int | None = None
    """Pipeline parallelism: micro-batches per step, ``M``: every tensor argument of the step is cut into M along
    dim 0 (M must divide it), gradients are averaged over them (the whole batch's mean loss), a 0-d result is
    averaged and another concatenated along dim 0. None (default): ``P``."""

    schedule: str = "1f1b"
    """Pipeline parallelism: ``"gpipe"``, ``"1f1b"`` (default), ``"interleaved_1f1b"`` or ``"zb_h1"`` (the backward
    split into input and weight gradients); see ``zgraph.runtime.pipeline_schedule``."""

    pipeline_virtual_stages: int = 1
    """Pipeline parallelism: stages per rank, ``v`` (more than 1 with ``schedule="interleaved_1f1b"``)."""

    pipeline_split: tuple[str, ...] = ()
    """Pipeline parallelism: the first block of each stage after the first (``P * v - 1`` block names, as
    ``explain()`` lists them, or without the step argument's name: ``"layers.16"``). Empty (default): blocks are
    grouped into stages of balanced forward cost."""

    pipeline_regather: bool = False
    """Pipeline parallelism at ZeRO stage 3: a stage gathers its parameters before each of its actions (forward,
    backward, input or weight gradient) and lets them go after it, instead of once per step, kept across the
    micro-batches (False, default; torchtitan's ``reshard_after_forward="never"`` under pipelines): less memory, an
    all-gather per action. ``memory_budget`` turns it on where no remat policy fits without it."""

    backend: str = "inductor"
    """``"inductor"`` compiles the transformed graph with inductor; ``"eager"`` runs the transformed FX GraphModule
    op by op (no compile time, same numbers). Default ``"inductor"``."""

    dynamic: bool | None = None
    """Symbolic argument sizes, as ``torch.compile(dynamic=...)``. None (default): dims whose sizes change become
    symbolic at the second capture. True: every dim of every tensor argument, from the first call (sizes 0 and 1 aside;
    dims the code needs as numbers are fixed silently). False: ``zgraph.mark_dynamic``'s (and ranks' differing) only."""

    disable_passes: tuple[str, ...] = ()
    """Names of passes to skip (see ``zgraph.passes.default_passes``). An unknown name, or a pass another
    enabled pass depends on, is rejected before anything runs."""

    extra_passes: tuple[Pass | PassFunction, ...] = field(default=())
    """User passes, each a ``zgraph.passes.Pass`` or a plain ``fn(gm, ctx) -> gm`` (named after the function,
    appended at the end of the pass list)."""

    # --- Buckets, prefetch and stage 3's gathers ---

    allgather_bucket_bytes: int | str = field(default="auto", metadata=_pass_option("allgather_bucket_bytes"))
    """Largest all-gather the ``bucket`` pass builds by merging parameter gathers, in bytes of the gathered (whole)
    tensors; 0 disables merging; ``"auto"`` (default) sizes buckets from the cost model so that a collective's
    latency is a tenth of its transfer time."""

    reduce_bucket_bytes: int | str = field(default="auto", metadata=_pass_option("reduce_bucket_bytes"))
    """The same for gradient reduce-scatters and all-reduces."""

    prefetch_bytes: int | str = field(default="auto", metadata=_pass_option("prefetch_bytes"))
    """Stage 3: how many bytes of parameters the ``schedule`` pass may have gathered ahead of their first use
    (issued or landed, not yet used); ``"auto"`` (default): two all-gather buckets. With an offload tier in use
    (``"nvme"``, or ``"cpu"`` for a GPU model) also the bytes of optimizer states and parameter shards read ahead of
    their reload (and of write-backs in flight); ``"auto"``: 64 MiB."""

    param_persistence_threshold: int = 100_000
    """Stage 3: parameters with at most this many elements are not sharded; they stay whole on every rank and need
    no all-gather (DeepSpeed's ``stage3_param_persistence_threshold``, same default: 100000)."""

    max_reuse_distance: int = field(default=0, metadata=_pass_option("max_reuse_distance"))
    """Stage 3: a parameter gathered for one use region (the forward's, say) stays gathered for its next one (the
    backward's) instead of being gathered again, when at most this many elements of other parameters are gathered
    in between. 0 (default): gathered again for every region, the least memory (FSDP2's
    ``reshard_after_forward=True``). The number of parameters in the model: gathered once per step (as
    ``reshard_after_forward=False``). DeepSpeed's ``stage3_max_reuse_distance`` (DeepSpeed counts every module's
    parameters it passes, zgraph each other parameter once); ``from_deepspeed`` maps it, and a DeepSpeed config
    that leaves it out gets DeepSpeed's default, 1e9."""

    remat: str | Mapping[str, str | None] | None = field(default=None, metadata=_pass_option("remat_policy"))
    """Activation recomputation (the ``remat`` pass): forward values the backward reads are recomputed in the
    backward instead of being kept from the forward. None (default): none. ``"selective"`` (torchtitan's default
    selective activation checkpointing): outputs of matmul-like ops (``mm``, ``addmm``, ``bmm``, attention,
    convolution) and of random ops are kept, everything else the backward reads (pointwise ops, norms, softmax,
    views, casts) is recomputed. Random draws (dropout masks) are never recomputed, so losses and parameters are
    bitwise those without it. ``"full"`` (``torch.utils.checkpoint`` around each of the model's repeated blocks: the
    children of an ``nn.ModuleList`` / ``nn.Sequential`` of modules of one class): only each block's inputs are kept,
    everything inside a block the backward reads is recomputed; a model without such blocks is refused. ``"auto"``:
    chosen by the planner (needs ``memory_budget``; under a budget, None is chosen by it too). A mapping from block
    names (as ``explain()`` lists them) to None / ``"selective"`` / ``"full"``: each block its own policy, the
    others and values outside blocks kept (what the planner picks to recompute only as many blocks as it must)."""

    memory_budget: int | str | None = None
    """Bytes per rank the step may hold at its peak. On the first call zgraph plans (``zgraph.inspect.budget``):
    of ``remat``, offload of optimizer states and stage-3 parameter shards (where a tier saves memory: pinned host
    memory for a GPU model, NVMe files under ``offload_dir`` for a CPU one) and stage 3's ``max_reuse_distance``,
    each left at its default, it picks the combination predicted fastest (``Estimate.step_seconds``) whose
    estimated peak fits; ``explain()`` shows it. An int, a string with a unit (``"12GiB"``, ``"500MB"``), or
    ``"auto"``: the device's free memory (on the CPU, available host memory shared by the node's ranks), the least
    over the ranks. A budget nothing fits raises ``zgraph.MemoryBudgetError`` before anything changes. Pipelines:
    ``remat`` planned per rank (``zgraph.inspect.pipeline_budget``). None (default): no planning."""

    measure_collectives: bool = True
    """Fit the collective cost model (latency + bytes / bandwidth) by a short measurement on the first call, cached
    per machine and world size; False uses an analytical model."""

    # --- Precision and gradients ---

    param_dtype: torch.dtype | None = None
    """Dtype parameters are used in by forward and backward (the compute dtype); in stage 3 they are gathered in
    it. None (default): the parameters' own dtype. Like FSDP2's ``MixedPrecisionPolicy.param_dtype``; gradients
    flow back to the master parameters."""

    keep_fp32_modules: tuple[type[nn.Module], ...] = NORM_MODULES
    """Module classes whose parameters ``param_dtype`` does not cast: they are read in their own (master) dtype, in
    stage 3 gathered in it — FSDP2's per-module ``MixedPrecisionPolicy``, DeepSpeed's
    ``lower_precision_safe_modules`` the other way round. A parameter is kept when every module holding it is an
    instance of one of these classes or lies inside one. Inputs are not cast: normalization layers take a 16-bit
    input with fp32 weights and return the input's dtype (off the CPU, where CUDA's layer and group norm kernels
    take one dtype, zgraph runs them on the input cast up); another module kept in fp32 should cast its input
    itself.
    Default: the normalization layers (``NORM_MODULES``: every BatchNorm, SyncBatchNorm and InstanceNorm,
    ``LayerNorm``, ``GroupNorm``, ``RMSNorm``); ``()`` casts every parameter. Without ``param_dtype`` it changes
    nothing."""

    reduce_dtype: torch.dtype | None = field(
        default=None, metadata=_pass_option("reduce_dtype", fallback="param_dtype")
    )
    """Dtype gradients are averaged across ranks in. None (default): the dtype backward produces them in."""

    master_dtype: torch.dtype | None = None
    """Dtype the parameters (the master weights) and the gradients left on them are stored in; zgraph converts the
    model on the first call. None (default): as the model is. ``torch.bfloat16`` is DeepSpeed's
    ``bf16_master_weights_and_grads``; ``torch.float16`` its ``fp16_master_weights_and_gradients`` (needs
    ``loss_scale``)."""

    optimizer_state_dtype: torch.dtype | None = None
    """Dtype of optimizer state tensors of a parameter's shape (Adam's moments, SGD's momentum). None (default): the
    master dtype. ``torch.bfloat16`` is DeepSpeed's ``bf16_optimizer_states``; ``torch.float16`` is rejected, as
    DeepSpeed does. With 16-bit master weights or states set here the update is computed in float32 and rounded
    once when stored; a model that is 16-bit itself, without them, is updated as eager PyTorch's optimizer updates
    it."""

    loss_scale: float | str | DynamicLossScale | None = None
    """fp16 loss scaling. None (default): none. A float: a static scale. ``"dynamic"`` or a
    ``zgraph.DynamicLossScale``: DeepSpeed's dynamic scaling — steps whose gradients overflow (on any rank) are
    skipped and the scale backs off; after ``growth_interval`` good steps it grows."""

    max_grad_norm: float | None = None
    """Clip gradients to this global norm (over every rank's shards) before the optimizer step, as
    ``torch.nn.utils.clip_grad_norm_`` would. None (default): no clipping."""

    autocast_dtype: torch.dtype | None = None
    """Run the forward of each model the step uses under ``torch.autocast`` with this dtype (DeepSpeed's
    ``torch_autocast`` section); the loss and the rest of the step are outside it, and an autocast region written
    in the step is honoured as it is. None (default): no autocast added."""

    # --- Host memory and failure handling ---

    keep_host_memory: bool = False
    """Keep freed host memory for the next step instead of returning it to the operating system and faulting it
    back in, as PyTorch's CUDA caching allocator keeps device memory (on glibc: malloc serves every block from its
    heap and never trims it; see ``zgraph.runtime.host_memory``). The resident size then stays at its peak between
    steps. It changes malloc for the whole process, not only zgraph's tensors, so it is opt-in: default False.
    Setting ``GLIBC_TUNABLES`` (see ``zgraph.runtime.host_memory``) before Python starts does the same for any
    program."""

    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    """Seconds a rank waits for the others, at any zgraph synchronisation point and in any collective of the step,
    before it raises ``zgraph.RankFailedError`` naming the rank that failed (and its error) or the call each rank
    was last in. Default 300 (five minutes); it must cover the difference between ranks' compile times on the first
    call."""

    # --- Offload ---

    offload_optimizer: str | None = field(default=None, metadata=_pass_option("offload_optimizer"))
    """Where optimizer states (Adam's moments...) live between steps. None (default): in memory on the compute
    device. ``"cpu"``: host memory — on a CPU machine the identity (they are there already); with the model on a
    GPU, pinned host memory: the ``offload`` pass puts a ``zgraph.reload`` node before each state's first read and
    a ``zgraph.write_back`` node after its update, and the runtime copies states to the GPU ahead of their reload
    and back behind their update on a copy stream, within ``prefetch_bytes`` (the update runs on the GPU: bitwise
    as without offload). ``"nvme"``: files under ``offload_dir`` (model on the CPU only, for now), read ahead and
    written behind on an I/O thread (see ``zgraph.runtime.offload``). Needs stage >= 1 (DeepSpeed's ZeRO-Offload
    does too). DeepSpeed's ``zero_optimization.offload_optimizer``."""

    offload_params: str | None = field(default=None, metadata=_pass_option("offload_params"))
    """Where sharded parameters live between uses (stage 3 only): None (default), ``"cpu"`` (the identity on a CPU
    machine; with the model on a GPU, pinned host memory, as for the optimizer). ``"nvme"``: each rank's parameter
    shards live in files under ``offload_dir`` between steps; the ``offload`` pass reloads a shard right before each
    phase's first read (the forward's all-gather, the backward's re-gather, the optimizer's update) and writes it
    back after its update. Parameters under ``param_persistence_threshold`` (whole on every rank) stay in memory.
    Combines with ``offload_optimizer``. DeepSpeed's ``zero_optimization.offload_param``."""

    offload_dir: str | os.PathLike | None = None
    """Directory the ``"nvme"`` tier writes its files in (each process in its own new subdirectory, removed at exit
    and when the step is dropped). Required with ``"nvme"``; checked at the first call (it must exist and be
    writable). DeepSpeed's ``nvme_path``."""

    offload_fraction: float = field(default=1.0, metadata=_pass_option("offload_fraction"))
    """Share of the optimizer states, by bytes, that ``offload_optimizer`` moves, in whole state tensors, first
    parameters first; 1.0 (default) moves all, 0.0 none. DeepSpeed's ``offload_optimizer.ratio``
    (ZeRO-Offload++)."""

    offload_update: str = "auto"
    """Where the update of ``offload_optimizer="cpu"`` states runs, the model on a device. ``"host"`` (ZeRO-Offload):
    master parameters and states live only in host memory; each gradient goes to the host once reduced and the host
    updates it with torch's CPU kernels while the backward goes on (SGD, Adam, AdamW; ``offload_fraction=1``).
    ``"device"``: the states are copied to the device for the update. ``"auto"`` (default): ``"host"`` where it can
    run, else ``"device"`` (``explain()`` says why). README: "Offload of optimizer states and parameters"."""

    offload_overlap: str | None = None
    """``"one_step"``: each step's host update runs during the next step, which computes with the parameters from
    before it (applied one step late, as ZenFlow / SuperOffload do). None (default): exact."""

    offload_activations: str | None = field(default=None, metadata=_pass_option("offload_activations_tier"))
    """Where saved activations (forward values the backward reads) live between their last forward use and their
    first backward use: None (default), in memory. ``"cpu"``: host memory, for a model on a GPU (pinned, copied on a
    stream of its own; on a CPU machine the identity). ``"nvme"``: files under ``offload_dir``. The
    ``offload_activations`` pass puts a ``zgraph.stash`` node after each one's last forward use and a
    ``zgraph.unstash`` node before its first backward use; the runtime reads them back ahead, within
    ``prefetch_bytes``, and frees them after each step. Bitwise as without offload; combines with ``remat`` (what it
    recomputes is not saved) and any stage. Split mode keeps autograd's saved values (unchanged)."""

    def __post_init__(self) -> None:
        check_choice("stage", self.stage, _STAGES, int)
        check_choice("backend", self.backend, _BACKENDS, str)
        check_bool("dynamic", self.dynamic, optional=True)
        check_groups(self.stage, self.shard_group_size, self.secondary_shard_group_size, self.cross_group_dtype)
        check_sequence_parallel(self.sequence_parallel)
        object.__setattr__(self, "pipeline_split", as_str_tuple("pipeline_split", self.pipeline_split))
        check_pipeline(self)
        for name in ("allgather_bucket_bytes", "reduce_bucket_bytes", "prefetch_bytes"):
            check_size(name, getattr(self, name), allow_auto=True)
        check_size("param_persistence_threshold", self.param_persistence_threshold, allow_auto=False)
        check_size("max_reuse_distance", self.max_reuse_distance, allow_auto=False)
        object.__setattr__(self, "remat", check_remat(self.remat, self.memory_budget))
        object.__setattr__(self, "memory_budget", budget_bytes(self.memory_budget))
        for name in ("param_dtype", "reduce_dtype", "master_dtype", "optimizer_state_dtype", "autocast_dtype"):
            check_float_dtype(name, getattr(self, name))
        object.__setattr__(self, "keep_fp32_modules", module_classes("keep_fp32_modules", self.keep_fp32_modules))
        object.__setattr__(self, "loss_scale", loss_scale_value(self.loss_scale))
        check_max_grad_norm(self.max_grad_norm)
        check_precision(
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            master_dtype=self.master_dtype,
            optimizer_state_dtype=self.optimizer_state_dtype,
            autocast_dtype=self.autocast_dtype,
            loss_scale=self.loss_scale,
        )
        for name in ("measure_collectives", "keep_host_memory", "pipeline_regather"):
            check_bool(name, getattr(self, name))
        check_timeout(self.collective_timeout)
        check_offload(
            stage=self.stage,
            offload_optimizer=self.offload_optimizer,
            offload_params=self.offload_params,
            offload_dir=self.offload_dir,
            offload_fraction=self.offload_fraction,
        )
        check_host_update(
            offload_optimizer=self.offload_optimizer,
            offload_fraction=self.offload_fraction,
            offload_update=self.offload_update,
            offload_overlap=self.offload_overlap,
        )
        check_offload_activations(self.offload_activations, self.offload_dir)
        object.__setattr__(self, "disable_passes", as_str_tuple("disable_passes", self.disable_passes))
        object.__setattr__(self, "extra_passes", as_pass_tuple(self.extra_passes))

    def pass_options(self) -> dict[str, Any]:
        """The options ``zgraph.passes.default_passes`` binds to its passes: each field whose metadata names a
        ``PASS_OPTION``, under that keyword (``reduce_dtype``: ``param_dtype`` when None)."""
        options: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if PASS_OPTION not in f.metadata:
                continue
            value = getattr(self, f.name)
            if value is None and PASS_OPTION_FALLBACK in f.metadata:
                value = getattr(self, f.metadata[PASS_OPTION_FALLBACK])
            options[f.metadata[PASS_OPTION]] = value
        return options

    def passes(self) -> list[Pass]:
        """The passes this Config runs, in order: ``default_passes`` with ``pass_options()`` bound, less
        ``disable_passes``, plus ``extra_passes`` at their places (contracts checked: ``zgraph.PassError``)."""
        return build_pass_list(default_passes(**self.pass_options()), self.disable_passes, self.extra_passes)

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


Config.__doc__ = doc_with_attributes(Config.__doc__ or "", field_docs(Config))
