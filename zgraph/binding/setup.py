"""Binding a step's state, once per set of modules and optimizers: check, then lay it out — one set-up, for a call
(``bind_state``) and for an estimate (``plan_state``).

``bind_state`` first checks everything that could refuse the state — its device against the group's backend and
the offload tiers, the layout other steps gave its modules, one GPU per rank under NCCL — so that a refusal
leaves the model and optimizers as they were. Only then does it change them: master dtype, loss-scale state (on
the state's device), rank 0's initial parameters and buffers on every rank, the sharding plan applied, the
offload store opened, and the collective cost model fitted (a collective on every rank, before any user code
runs, so a failing capture cannot skip it).

``plan_state`` lays out an estimate's meta stand-ins the same way (device, master dtype, loss-scale state,
sharding plan) for a group that need not exist: nothing is broadcast, applied, opened or measured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zgraph.capture.precision import initial_loss_scale_state
from zgraph.capture.update_rules import kernel_for
from zgraph.config import Config
from zgraph.config_checks import pipeline_world_error
from zgraph.graph import CostModel
from zgraph.runtime.agreement import Channel
from zgraph.runtime.cost_model import fit_cost_model
from zgraph.runtime.devices import allocation_device, check_served, served_backend, state_device
from zgraph.runtime.host_memory import keep_freed_host_memory
from zgraph.runtime.host_state import check_host_memory, check_overlap, home_device, host_parameters, move_to_host
from zgraph.runtime.host_update import HostRunner
from zgraph.runtime.hybrid import check_pipeline_groups, hybrid_group
from zgraph.runtime.meta_init import (
    MetaInitError,
    Routes,
    allocator,
    blank,
    fill,
    fill_routes,
    generator_state,
    has_meta_state,
    release,
    set_generator_state,
    swap_storage,
)
from zgraph.runtime.offload import check_offload_device, open_store
from zgraph.runtime.offload_activations import open_activation_tier
from zgraph.runtime.offload_store import DEFAULT_WINDOW, watch
from zgraph.runtime.pipeline_groups import plan_stage, zero_within_stages
from zgraph.runtime.process_group import ProcessGroupInfo, check_one_device_per_rank
from zgraph.runtime.sharded_state import (
    apply_plan,
    broadcast_initial_state,
    check_owners,
    convert_master_dtype,
    make_plan,
    shard_parameter,
)
from zgraph.runtime.state import Binding, ParamRecord, state_tensors

Modules = list[tuple[str, nn.Module]]
Optimizers = list[tuple[str, torch.optim.Optimizer]]


def bind_state(
    config: Config, group: ProcessGroupInfo, channel: Channel | None, modules: Modules, optimizers: Optimizers
) -> Binding:
    """The binding of ``modules`` and ``optimizers`` for a step of ``config`` on ``group`` (module docstring).
    Collective (every rank of ``group`` calls it at the same point) where ``channel`` is given."""
    binding = lay_out(config, group, channel, Binding(modules, optimizers))
    device = binding.device
    # the update on the host keeps its states in host memory itself: a store only for other state (offload_params)
    binding.offload = open_store(config, device) if not binding.host_params or config.offload_params else None
    if binding.host_params:
        binding.host = HostRunner(device, binding.host_params, config.offload_overlap)
        watch(binding.host, [o.optimizer for o in binding.optimizers], [m for _, m in binding.modules])
    binding.activations = open_activation_tier(config, device)
    binding.activations_window = config.prefetch_bytes if isinstance(config.prefetch_bytes, int) else DEFAULT_WINDOW
    if binding.offload is not None:
        binding.offload.watch([o.optimizer for o in binding.optimizers], [m for _, m in binding.modules])
    if config.keep_host_memory and device.type == "cpu":
        keep_freed_host_memory()
    binding.cost_model = fit_cost_model(group, device, config.measure_collectives, channel)
    return binding


def lay_out(
    config: Config, group: ProcessGroupInfo, channel: Channel | None, binding: Binding, values: str = "init"
) -> Binding:
    """Check, then lay out ``binding``'s state for ``config`` on ``group``: device, master dtype, loss-scale state,
    meta tensors made real (``values``: the model's initialisation, or ``"empty"`` storage for weights about to
    be loaded), rank 0's values everywhere, the sharding plan applied. Collective where ``channel`` is given."""
    device = layout_device(group, binding)
    check_served(group.backend, device)
    check_offload_device(config, device)
    host, binding.host_fallback = host_parameters(config, binding, device, host_runnable)
    moving = frozenset(i for i in host if home_device(binding.params[i].tensor) is None)  # not there already
    if moving and device.type != "cpu":
        check_host_memory(_host_bytes(binding, moving, config, group), f"{len(moving)} parameters' masters and states")
    check_overlap(config, binding, host)
    stage = plan_stage(group, config.pipeline_parallel, config.stage)
    check_owners(stage, group, binding)
    standin = served_backend(group.backend, "meta") is not None  # a test's stand-in accelerator
    source = None if standin else meta_source(binding, group, channel)
    routes = fill_routes(binding, values) if source == "init" else []
    if channel is not None:
        check_one_device_per_rank(channel, group.backend, device)
    optimizers = [(o.name, o.optimizer) for o in binding.optimizers]
    _lay_out(binding, config, device, _loss_scale_state(config, optimizers, device))
    binding.backend = served_backend(group.backend, device.type)
    binding.plan = make_plan(stage, group, binding, config.param_persistence_threshold)
    make_real(binding, channel, source, routes, values)
    apply_plan(binding.plan, binding)  # may replace parameters (stage 3)
    move_to_host(binding, host, device)
    binding.host_params = host
    return binding


def layout_device(group: ProcessGroupInfo, binding: Binding) -> torch.device:
    """The device ``binding``'s state is laid out on over ``group``: where its tensors are; for state on meta, the
    device the group's backend allocates on (a test's stand-in accelerator serves meta: meta is its device)."""
    standin = served_backend(group.backend, "meta") is not None
    device = state_device(state_tensors(binding), meta_is_device=standin)
    return allocation_device(group.backend) if device.type == "meta" and not standin else device


def host_runnable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the host can run ``optimizer``'s update: zgraph has an update rule for its class."""
    return kernel_for(optimizer) is not None


def _host_bytes(binding: Binding, host: frozenset[int], config: Config, group: ProcessGroupInfo) -> int:
    """The host memory the update on the host keeps for the parameters ``host``: their master values (a shard of
    each at stage 3), ``.grad`` and optimizer states (a shard at stage >= 1; a first step's, as its optimizer makes
    them, from meta stand-ins)."""
    ranks = group.shard_axis.size if group.distributed else 1
    total = 0
    for i in host:
        p = binding.params[i].tensor
        master = p.numel() * (config.master_dtype or p.dtype).itemsize
        total += master // ranks if config.stage >= 3 else master
        total += 0 if p.grad is None else p.grad.numel() * p.grad.element_size()
        for o in binding.optimizers:
            state = binding.optimizer_state(o.index, i) or _first_state(o.optimizer, p, config)
            states = [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
            total += sum(v.numel() * v.element_size() for v in states) // ranks
    return total


def _first_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, config: Config) -> dict:
    """The state a first step of ``optimizer`` makes for ``param``, on meta (no memory)."""
    kernel = kernel_for(optimizer)
    group = next((g for g in optimizer.param_groups if any(q is param for q in g["params"])), None)
    if kernel is None or kernel.initial_state is None or group is None:
        return {}
    dtype = config.master_dtype or param.dtype
    meta = torch.empty(param.shape, dtype=dtype, device="meta")
    return kernel.initial_state(meta, group, config.optimizer_state_dtype or config.master_dtype)


def step_groups(group: ProcessGroupInfo, config: Config) -> ProcessGroupInfo:
    """``group`` with the groups ``config`` asks for made (hybrid sharding's, hpZ's, sequence parallelism's, a
    pipelined step's at ZeRO stage >= 1): collective, on every rank of ``group`` at the same point (right after
    ``timed_group``). A pipelined step's ``P x SP`` must divide the group, and its hybrid sharding's group size
    each stage's data-parallel group (``ValueError``, before any group): it makes its hybrid groups within that
    group (``zero_within_stages``)."""
    p, sp = config.pipeline_parallel, config.sequence_parallel
    if p is not None and group.world_size % (p * (sp or 1)):
        raise ValueError(pipeline_world_error(p, group.world_size, sp))
    if p is not None and group.distributed:
        check_pipeline_groups(config.shard_group_size, p, group.world_size)
    shard = config.shard_group_size if p is None else None
    group = hybrid_group(
        group,
        shard_group_size=shard,
        secondary_group_size=config.secondary_shard_group_size,
        timeout=config.collective_timeout,
        sequence_parallel=config.sequence_parallel,
    )
    timeout, sequence = config.collective_timeout, config.sequence_parallel
    return zero_within_stages(group, p, config.stage, timeout, sequence, config.shard_group_size)


def meta_source(binding: Binding, group: ProcessGroupInfo, channel: Channel | None) -> str | None:
    """Where the binding's meta-device tensors get their values, agreed by every rank (collective where
    ``channel`` is given): None (no rank has any), ``"init"`` (every rank built on meta: the model's own
    initialisation), ``"rank0"`` (only rank 0 holds real values: FSDP1's ``sync_module_states`` idiom); any
    other mix is refused on every rank, naming the ranks."""
    meta = has_meta_state(binding)
    if channel is None:
        return "init" if meta else None
    flags = [f == b"1" for f in channel.exchange("zgraph: meta-device state", b"1" if meta else b"0")]
    if not any(flags):
        return None
    if all(flags):
        return "init"
    if not flags[0] and all(flags[1:]):
        return "rank0"
    on_meta = [r for r, f in enumerate(flags) if f]
    raise MetaInitError(
        f"zgraph: ranks {on_meta} hold the model on the meta device and ranks "
        f"{[r for r, f in enumerate(flags) if not f]} do not. Build it on meta on every rank (zgraph initialises "
        "it, or zgraph.load_pretrained fills it), or real on rank 0 only (its values are sent to the others)."
    )


def make_real(binding: Binding, channel: Channel | None, source: str | None, routes: Routes, values: str) -> None:
    """Give the binding's meta tensors storage and values as ``source`` says (``meta_source``), each parameter the
    plan shards cut to this rank's rows as soon as it holds its values; then rank 0's values on every rank."""
    group = binding.plan.group
    if source == "rank0":
        broadcast_initial_state(binding, group, allocator(binding, binding.device))
        return
    if source == "init" and values == "init":
        state = generator_state(binding.device) if group.rank == 0 else None
        if channel is not None:
            state = channel.broadcast("zgraph: rank 0's random state", state)
        if state is not None:
            set_generator_state(binding.device, state)
    if source == "init":  # storage only for "empty": an initialisation that misses a parameter is an error
        empty = storage_only(binding) if values == "empty" else None
        fill(binding, routes, binding.device, finisher(binding), values, empty)
    broadcast_initial_state(binding, group)


def finisher(binding: Binding) -> Callable[[ParamRecord], None]:
    """What becomes of a materialised parameter: cut to this rank's shard where the plan shards it (its whole
    storage released), else kept whole."""
    plan = binding.plan

    def finish(record: ParamRecord) -> None:
        if plan.params_sharded(record.index):
            whole = record.tensor
            shard_parameter(plan, binding, record.index)
            release(whole)

    return finish


def storage_only(binding: Binding) -> Callable[[ParamRecord], None]:
    """Storage for a meta parameter whose values are loaded next, as it will be kept: this rank's padded shard
    (only its padding rows zeroed) where the plan shards it, else the whole tensor; uninitialised."""
    plan = binding.plan

    def allocate(record: ParamRecord) -> None:
        p = record.tensor
        if plan.params_sharded(record.index):
            spec = plan.specs[record.index]
            padded = torch.empty(spec.shard_shape, dtype=p.dtype, device=binding.device)
            padded[spec.local_rows(plan.rank) :].zero_()
            shard_parameter(plan, binding, record.index, padded=padded)
        else:
            swap_storage(p, blank(p, binding.device))

    return allocate


def plan_state(
    config: Config,
    group: ProcessGroupInfo,
    modules: Modules,
    optimizers: Optimizers,
    device: torch.device,
    cost_model: CostModel,
) -> Binding:
    """The binding an estimate plans with (module docstring): ``modules`` and ``optimizers`` hold meta stand-ins
    of state that would live on ``device``; ``cost_model`` prices the collectives."""
    binding = Binding(modules, optimizers)
    _lay_out(binding, config, device, initial_loss_scale_state(config))
    binding.plan = make_plan(config.stage, group, binding, config.param_persistence_threshold, mesh=False)
    binding.cost_model = cost_model
    return binding


def _lay_out(binding: Binding, config: Config, device: torch.device, loss_scale_state: dict) -> None:
    """What a call and an estimate both do to the state: its device, master dtype and loss-scale state."""
    binding.device = device
    convert_master_dtype(binding, config.master_dtype, config.optimizer_state_dtype)
    binding.loss_scale_state = loss_scale_state


def _loss_scale_state(config: Config, optimizers: Optimizers, device: torch.device) -> dict:
    """The loss-scale state the step starts from, on ``device``: the config's initial one, updated from what
    ``zgraph.load`` left on an optimizer before the first step; shared with every optimizer, whose
    ``_zgraph_loss_scale`` ``zgraph.save`` / ``load`` read and write."""
    state = initial_loss_scale_state(config, device)
    for _, opt in optimizers:
        loaded = getattr(opt, "_zgraph_loss_scale", None) or {}
        state.update((k, v.to(device)) for k, v in loaded.items() if k in state)
        opt._zgraph_loss_scale = state
    return state
