"""Measuring memory on any device, CPU included: live tensor bytes, exactly.

``LiveTensorBytes`` is a ``TorchDispatchMode`` that sees every tensor an op allocates while it is active and
counts its storage until the storage is freed (a weak reference on the storage, so views keep it counted and
it leaves the count when the last view dies). ``current`` and ``peak`` are exact byte counts of what ops under
the mode allocated — the CPU counterpart of ``torch.cuda.memory_allocated`` / ``max_memory_allocated``.

``state_bytes`` counts what a rank holds of a model and optimizer: parameters, ``.grad`` and optimizer state,
each storage once; for a sharded ``DTensor``, its local shard.

``live_storages`` finds every tensor storage the process holds through a Python object (``gc.get_objects()``:
tensors, parameters, a ``DTensor``'s local tensor, wherever they are referenced from — a cache, a closure, a
thread), each storage once, with its bytes: what is held between steps, not only what a model and optimizer
name. Storages only C++ holds (an autograd node's saved tensors) are not seen; ``LiveTensorBytes`` sees those
that ops allocate under it.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(t: Tensor) -> torch.UntypedStorage | None:
    if isinstance(t, DTensor):
        t = t._local_tensor
    if t.device.type == "meta" or getattr(t, "fake_mode", None) is not None:
        return None
    return t.untyped_storage()


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated under this mode that are still alive (``current``), and the most
    at any time (``peak``)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def reset_peak(self) -> None:
        self.peak = self.current

    def _forget(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def track(self, t: Tensor) -> None:
        """Count ``t``'s storage (once), whoever allocated it."""
        storage = _storage(t)
        if storage is None or id(storage) in self._live or storage.nbytes() == 0:
            return
        self._live[id(storage)] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._forget, id(storage))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        aliasing = any(r.alias_info is not None for r in returns)
        # torch.tensor(data) allocates outside the dispatcher, then lifts the new tensor: count it there
        if func is torch.ops.aten.lift_fresh.default or (not aliasing and not func._schema.is_mutable):
            for leaf in tree_leaves(out):
                if isinstance(leaf, Tensor):
                    self.track(leaf)
        return out


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of ``model``'s parameters, their ``.grad``, and ``optimizer``'s state."""
    seen: set[int] = set()

    def count(tensors: list[Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = _storage(t)
            if storage is None or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    params = list({id(p): p for p in model.parameters()}.values())
    out = {
        "params": count(params),
        "grads": count([p.grad for p in params if p.grad is not None]),
        "optimizer": 0,
    }
    if optimizer is not None:
        states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
        out["optimizer"] = count(states)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def live_tensors() -> dict[int, Tensor]:
    """One tensor per non-empty storage alive in this process that a Python tensor object refers to, by data
    pointer (a ``DTensor``'s local tensor for a ``DTensor``; meta and fake tensors, which hold no memory, left
    out); after a ``gc.collect()``."""
    gc.collect()
    found: dict[int, Tensor] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), Tensor):  # not isinstance: that reads __class__, which some objects warn on
            continue
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        try:
            storage = _storage(t)
            if storage is not None and storage.nbytes():
                found.setdefault(storage.data_ptr(), t)
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own
            continue
    return found


def live_storages() -> dict[int, int]:
    """``live_tensors``' storages: data pointer to bytes."""
    return {ptr: t.untyped_storage().nbytes() for ptr, t in live_tensors().items()}
