"""Training state kept in host memory for the update on the host (``Config.offload_update="host"``, ZeRO-Offload).

Which parameters (``host_parameters``): every parameter that requires grad of the bound optimizers, when every
one of those optimizers is one the host can run (zgraph's update rules: SGD, Adam, AdamW) — else none, and the
reason is kept for ``explain()`` (or, with ``"host"`` asked for explicitly, raised before anything changes).

Where (``move_to_host``, at set-up, after the sharding plan is applied): each such parameter's master value (the
whole tensor at stages 1 and 2 on one rank, the padded shard of its ``DTensor`` at stage 3 — which stages 1 and 2 on
several ranks run: ``zgraph.binding.host_layout``), its ``.grad`` and its optimizer
state tensors move to host memory — pinned on CUDA, where the parameter is copied to the device each step — as
FSDP2's ``CPUOffloadPolicy`` keeps them: ``model.parameters()``, ``.grad`` and ``optimizer.state`` are host tensors,
so ``optimizer.state_dict()``, ``zgraph.save`` and ``full_state_dict`` read them where they are. A first step's
optimizer state is made from the host parameter, so it is born there. Each moved tensor records the device it stands
in for (``home_device``): capture traces it as a tensor of that device, and the ``host_update`` pass places it.

Before anything moves, ``check_host_memory`` compares the bytes the host will hold with the memory available (this
rank's share of the machine's): too little is an ``OffloadError`` naming both.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from zgraph.ops import host_read
from zgraph.runtime.devices import HOME
from zgraph.runtime.meta_init import swap_storage
from zgraph.runtime.offload_store import OffloadError
from zgraph.runtime.sharded_state import graph_tensor
from zgraph.runtime.state import Binding

HOST_OPTIMIZERS = "SGD, Adam, AdamW"


def home_device(t: object) -> torch.device | None:
    """The device a host-resident tensor stands in for; None for any other tensor."""
    return getattr(t, HOME, None)


def host_parameters(
    config: object, binding: Binding, device: torch.device, runnable: Callable[[torch.optim.Optimizer], bool]
) -> tuple[frozenset[int], str | None]:
    """The parameters whose update runs on the host — with those another step already keeps there —, and why the
    others' does not (None: nothing to say). ``runnable(optimizer)``: the host can run its update. Raises
    ``OffloadError`` where ``"host"`` was asked for and cannot be honoured."""
    update = getattr(config, "offload_update", "auto")
    already = frozenset(r.index for r in binding.params if home_device(r.tensor) is not None)
    if config.offload_optimizer != "cpu" or update == "device" or (update == "auto" and device.type == "cpu"):
        return already, None
    refused = [o for o in binding.optimizers if not runnable(o.optimizer)]
    if refused:
        names = ", ".join(f"{o.name} ({type(o.optimizer).__name__})" for o in refused)
        why = f"the host runs the update of the optimizers zgraph has update rules for ({HOST_OPTIMIZERS}), not {names}"
        if update == "host":
            raise OffloadError(f'zgraph: Config.offload_update="host": {why}; use offload_update="device"')
        return already, f"{why}: their states are brought to the device for the update"
    if config.offload_fraction != 1.0:
        return already, "offload_fraction < 1 keeps some states on the device: the update runs there"
    indices = {i for o in binding.optimizers for group in o.group_params for i in group}
    return already | frozenset(i for i in indices if binding.params[i].tensor.requires_grad), None


def check_overlap(config: object, binding: Binding, host: frozenset[int]) -> None:
    """Raise ``OffloadError`` (before anything changes) for a ``Config.offload_overlap`` the step cannot honour: a
    step without the optimizer (split mode's forward, a forward/backward step) or nothing updated on the host.
    (Stages 1 and 2 on several ranks run stage 3's layout there: ``zgraph.binding.host_layout``.)"""
    overlap = getattr(config, "offload_overlap", None)
    if overlap is None:
        return
    if not binding.optimizers:
        raise OffloadError(
            f"zgraph: Config.offload_overlap={overlap!r} overlaps a step's update on the host with the next step's "
            "forward, so the step must hold the forward, the backward and the optimizer's update; this one has no "
            "optimizer (split mode's forward step, or a forward/backward step). Use offload_overlap=None"
        )
    if not host:
        raise OffloadError(
            f"zgraph: Config.offload_overlap={overlap!r} overlaps the update on the host with the next step, but no "
            'update runs on the host here (offload_update="auto" keeps the update where the state is on a CPU '
            'machine, or falls back to the device); set offload_update="host", or offload_overlap=None'
        )


def available_host_bytes() -> int:
    """Host memory available to this process: the machine's available memory (``MemAvailable``) shared by the
    ranks on it (``LOCAL_WORLD_SIZE``)."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def check_host_memory(needed: int, what: str) -> None:
    """Raise ``OffloadError`` (before anything moves) when ``needed`` bytes do not fit in the available host
    memory; ``what`` says what they are."""
    available = available_host_bytes()
    if needed > available:
        raise OffloadError(
            f"zgraph: the update on the host needs {needed} bytes of host memory for {what}, and {available} are "
            "available on this rank; nothing was changed. Shard over more ranks (stage 3 keeps a shard of each "
            'parameter), use offload_update="device", or free host memory'
        )


def move_to_host(binding: Binding, indices: frozenset[int], device: torch.device) -> None:
    """Move the master value, ``.grad`` and optimizer state of the parameters ``indices`` to host memory (pinned
    on CUDA), each tensor object kept (its data, or a zgraph DTensor's padded shard, swapped), and mark them
    (``home_device``)."""
    pinned = device.type == "cuda"
    for i in sorted(indices):
        param = binding.params[i].tensor
        grad, param.grad = param.grad, None
        for t in (param, grad, *_states(binding, i)):
            if isinstance(t, Tensor):
                _to_host(binding, i, t, pinned)
                setattr(t, HOME, device)
        param.grad = grad


def mark_state(binding: Binding, index: int, device: torch.device) -> None:
    """Mark the optimizer state of parameter ``index`` (a first step's, made from the host parameter) as host
    state standing in for ``device``."""
    for t in _states(binding, index):
        setattr(t, HOME, device)


def _states(binding: Binding, index: int) -> Iterator[Tensor]:
    for o in binding.optimizers:
        for value in binding.optimizer_state(o.index, index).values():
            if isinstance(value, Tensor) and value.dim() > 0:
                yield value


def _to_host(binding: Binding, index: int, t: Tensor, pinned: bool) -> None:
    """Swap ``t``'s data (a zgraph DTensor's padded shard: ``t`` of parameter ``index``) for a host copy."""
    local = graph_tensor(t)
    if local.device.type == "cpu":
        return
    host = torch.empty(local.shape, dtype=local.dtype, pin_memory=pinned)
    with host_read("host update: state moved to host memory"):
        host.copy_(local.detach())
    if local is t and torch._has_compatible_shallow_copy_type(t, host):
        t.data = host
    elif local is t:  # a stand-in device's tensor (meta): the object takes the host tensor's place
        swap_storage(t, torch.nn.Parameter(host, t.requires_grad) if isinstance(t, torch.nn.Parameter) else host)
    else:  # a zgraph DTensor: one around the host shard takes its place (its device is the shard's)
        plan, param = binding.plan, isinstance(t, torch.nn.Parameter)
        spec = plan.specs[index] if param else plan.state_spec(index, t)
        swap_storage(t, plan.wrap(host, spec, requires_grad=param and t.requires_grad))
        plan.store(t, host, spec)
