"""Bodies of the checkpoint and ``full_state_dict`` device tests (``tests/test_checkpoint_device.py``): on the
stand-in accelerator of ``tests/standin.py`` (state on ``meta``, a backend serving only it, ``DeviceAudit``) and on
gloo ranks. Each spawned body writes what it saw to ``<out>/<name>.<rank>.json`` (or ``.pt`` for tensors)."""

from __future__ import annotations

import json
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist
from standin import DEVICE, DeviceAudit
from standin_cases import config_of, plain_step
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zgraph
from zgraph.runtime.memory import LiveTensorBytes


def net(device: torch.device | str = DEVICE) -> nn.Module:
    """Twelve tensors, the largest 4 KiB (32 x 32 fp32), 20 KiB in all: the model and its AdamW state are 15 times
    the largest tensor, so "the state and about one tensor" and "the state twice" are far apart."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 32)]
    for _ in range(4):
        layers += [nn.ReLU(), nn.Linear(32, 32)]
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(32, 8)).to(device)


def batch(device: torch.device | str = DEVICE) -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(4, 16, device=device), torch.zeros(4, dtype=torch.long, device=device)


class DeviceBytes(TorchDispatchMode):
    """Live bytes of the ``meta`` (stand-in device) storages allocated under this mode, or handed to ``track``:
    ``current`` and ``peak`` (``zgraph.runtime.memory.LiveTensorBytes``, for the stand-in device's tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def _forget(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def track(self, t: Tensor) -> None:
        t = t._local_tensor if isinstance(t, DTensor) else t
        if t.device != DEVICE or getattr(t, "fake_mode", None) is not None:
            return
        storage = t.untyped_storage()
        if id(storage) in self._live or storage.nbytes() == 0:
            return
        self._live[id(storage)] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._forget, id(storage))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if not any(r.alias_info is not None for r in schema.returns) and not schema.is_mutable:
            for leaf in tree_leaves(out):
                if isinstance(leaf, Tensor):
                    self.track(leaf)
        return out


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[Tensor]:
    """The model's parameters and buffers and the optimizer's state tensors."""
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    return [*model.parameters(), *model.buffers(), *states]


def nbytes(tensors: list[Tensor]) -> int:
    """Bytes of the distinct local tensors' storages (a DTensor by its local tensor)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t._local_tensor if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def largest(model: nn.Module) -> int:
    """Bytes of the model's largest whole tensor."""
    return max(v.numel() * v.element_size() for v in model.state_dict().values())


def devices_of(opt: torch.optim.Optimizer) -> dict[str, list[str]]:
    """The devices of the optimizer's ``step`` tensors and of its other state tensors."""
    out: dict[str, set[str]] = {"step": set(), "other": set()}
    for state in opt.state.values():
        for field, value in state.items():
            if isinstance(value, Tensor):
                local = value._local_tensor if isinstance(value, DTensor) else value
                out["step" if field == "step" else "other"].add(str(local.device))
    return {k: sorted(v) for k, v in out.items()}


def attempt(case: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``case(*args, **kwargs)``'s observations, or ``{"error": ...}``: a failing case is reported by its test,
    the others still run."""
    try:
        return case(*args, **kwargs)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


# ------------------------------------------------------------------------------------------------ a CPU run
def write_cpu_checkpoint(path: str, capturable: bool = False) -> None:
    """One eager AdamW step of ``net`` on the host, saved (one process, no process group). ``capturable``: the
    saved param group says ``capturable=True`` (torch.optim reads the flag from the loaded groups)."""
    model = net("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_step(model, opt, *batch("cpu"))
    for group in opt.param_groups:
        group["capturable"] = capturable
    zgraph.save(path, model, opt, extra={"written": "on the host"})


# ------------------------------------------------------------------------------------------------ load
def measured_load(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``zgraph.load`` under the audit, with the stand-in device's live bytes counted (the model's and optimizer's
    tensors counted from the start): what it saw."""
    with DeviceBytes() as device_bytes, DeviceAudit() as audit:
        for t in state_tensors(model, opt):
            device_bytes.track(t)
        before = device_bytes.current
        extra = zgraph.load(path, model, opt)
    after = state_tensors(model, opt)
    return {
        "extra": extra,
        "devices": devices_of(opt),
        "step_dtypes": sorted({str(s["step"].dtype) for s in opt.state.values()}),
        "before": before,
        "peak": device_bytes.peak,
        "state": nbytes([t for t in after if (t._local_tensor if isinstance(t, DTensor) else t).device == DEVICE]),
        "largest": largest(model),
        "reads": sorted(set(audit.reads)),
    }


def load_on_standin(rank: int, world: int, plain: str, capturable: str, out: str) -> None:
    """Load a checkpoint the host wrote into stand-in models: before any step (default AdamW, and AdamW with
    ``capturable=True``), into state that exists (loaded again), and after a stage-1 and a stage-3 step (into
    zgraph's shards), then one more step (does it retrace?)."""
    seen: dict[str, Any] = {}
    for name, kwargs in (("default", {}), ("capturable", {"capturable": True})):
        model = net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
        path = capturable if kwargs else plain
        seen[f"fresh {name}"] = attempt(measured_load, path, model, opt)
        seen[f"again {name}"] = attempt(measured_load, path, model, opt)

    def after_a_step(stage: int) -> dict[str, Any]:
        model = net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = zgraph.distribute(config_of({"stage": stage}))(plain_step)
        x, y = batch()
        with DeviceAudit():
            step(model, opt, x, y)
        loaded = measured_load(plain, model, opt)
        with DeviceAudit():
            step(model, opt, x, y)
        return dict(loaded, variants=len(step._dispatch.cache), devices_after_step=devices_of(opt))

    for stage in (1, 3):
        seen[f"stage {stage}"] = attempt(after_a_step, stage)
    with open(os.path.join(out, f"load.{rank}.json"), "w") as f:
        json.dump(seen, f)


# ------------------------------------------------------------------------------------------------ save
def save_on_standin(rank: int, world: int, path: str, out: str) -> None:
    """A stage-3 step on the stand-in, saved under the audit (meta tensors read as zeros: the checkpoint's layout
    is what counts), then loaded back. (Not with fp16 loss scaling: its state, on the device, is a value the
    manifest stores, and values refuse meta tensors, which have no data.)"""
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = zgraph.distribute(config_of({"stage": 3}))(plain_step)
    seen: dict[str, Any] = {}
    with DeviceAudit() as audit:
        step(model, opt, *batch())
        audit.reads.clear()
        try:
            zgraph.save(path, model, opt, extra={"step": 1})
            seen["save"] = None
        except Exception as error:
            seen["save"] = f"{type(error).__name__}: {error}"
        seen["save reads"] = sorted(set(audit.reads))
        audit.reads.clear()
        if seen["save"] is None:
            seen["extra"] = zgraph.load(path, model, opt)
            seen["load reads"] = sorted(set(audit.reads))
            seen["devices"] = devices_of(opt)
            seen["param_devices"] = sorted({str(p._local_tensor.device) for p in model.parameters()})
    with open(os.path.join(out, f"save.{rank}.json"), "w") as f:
        json.dump(seen, f)


# ------------------------------------------------------------------------------------------------ full_state_dict
def _shapes(state: dict[str, Any]) -> dict[str, Any]:
    return {str(k): list(v.shape) for k, v in state.items() if isinstance(v, Tensor)}


def _describe(result: Any) -> dict[str, Any]:
    """Keys, shapes and devices of a ``full_state_dict`` result (model only, or with the optimizer)."""
    model_state, optim_state = result if isinstance(result, tuple) else (result, None)
    tensors = [v for v in tree_leaves((model_state, optim_state)) if isinstance(v, Tensor)]
    out = {
        "model": _shapes(model_state),
        "devices": sorted({str(t.device) for t in tensors}),
        "dtensors": sum(isinstance(t, DTensor) for t in tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "optimizer": None,
    }
    if optim_state is not None:
        out["optimizer"] = {str(i): _shapes(s) for i, s in optim_state["state"].items()} if optim_state else optim_state
        out["param_groups"] = len(optim_state.get("param_groups", [])) if optim_state else 0
    return out


def measured_full_state_dict(model: nn.Module, opt: torch.optim.Optimizer | None, **kwargs: Any) -> dict[str, Any]:
    """``zgraph.full_state_dict`` under the audit, counting the live bytes it allocates on the stand-in device
    and on the host."""
    with LiveTensorBytes() as host, DeviceBytes() as device, DeviceAudit() as audit:
        result = zgraph.full_state_dict(model, opt, **kwargs)
    seen = _describe(result)
    seen.update(host_peak=host.peak, device_peak=device.peak, largest=largest(model), reads=sorted(set(audit.reads)))
    return seen


def full_state_dict_on_standin(rank: int, world: int, out: str) -> None:
    """After a stage-3 step on the stand-in: ``full_state_dict`` of the model and optimizer, whole on every rank
    and with ``rank0_only``; the model alone with ``rank0_only``."""
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = zgraph.distribute(config_of({"stage": 3}))(plain_step)
    with DeviceAudit():
        step(model, opt, *batch())
    seen = {
        "every rank": attempt(measured_full_state_dict, model, opt),
        "rank0_only": attempt(measured_full_state_dict, model, opt, rank0_only=True),
        "model rank0_only": attempt(measured_full_state_dict, model, None, rank0_only=True),
        "whole": {k: list(v.shape) for k, v in net().state_dict().items()},
    }
    with open(os.path.join(out, f"full.{rank}.json"), "w") as f:
        json.dump(seen, f)


def full_state_dict_on_gloo(rank: int, world: int, out: str, stage: int) -> None:
    """On host ranks after two steps at ``stage``: ``full_state_dict`` on every rank, then with ``rank0_only``
    (counting the host bytes the call allocates); rank 0 saves both, every rank what ``rank0_only`` returned."""
    model = net("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = zgraph.distribute(config_of({"stage": stage}))(plain_step)
    x, y = batch("cpu")
    for _ in range(2):
        step(model, opt, x[rank::world], y[rank::world])
    everyone = zgraph.full_state_dict(model, opt)
    with LiveTensorBytes() as host:
        only = zgraph.full_state_dict(model, opt, rank0_only=True)
    model_only = zgraph.full_state_dict(model, rank0_only=True)
    result = {
        "rank": dist.get_rank(),
        "only": only,
        "model_only": model_only,
        "host_peak": host.peak,
        "largest": largest(model),
    }
    if rank == 0:
        result["everyone"] = everyone
    torch.save(result, os.path.join(out, f"gloo{stage}.{rank}.pt"))
