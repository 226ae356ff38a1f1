"""A stand-in accelerator for checking zgraph's device path on a machine without a GPU.

Every tensor of the training state lives on the ``meta`` device, which autograd, DTensor and every aten op support
(shapes, dtypes and storages, no data), and the process group's backend is ``standin``: registered for the
``meta`` device only, as NCCL is for ``cuda`` only. So, while the real runtime runs — binding, the initial
broadcast, the graph fingerprints, the executor with its rewrites, loss scaling, clipping, offload, checkpoint
staging —:

- a host tensor handed to a collective fails as on NCCL (``No backend type associated with device type cpu``);
- ``DeviceAudit`` (a dispatch mode) fails an op that mixes host tensors (other than 0-d scalars, which CUDA
  kernels accept too) with device tensors, and any device-to-host read (``.item()``, ``.tolist()``, ``.cpu()``,
  ``copy_`` into a host tensor) outside a region zgraph marks as a deliberate host read
  (``zgraph.runtime.devices.host_read``); inside one, the host receives zeros (meta tensors have no values);
- and a layer or group norm given a 16-bit input with fp32 weights, which CUDA's kernels refuse (the CPU's
  take it).

The collectives themselves do nothing (``FakeProcessGroup``); the c10d store between the ranks is real, so the
ranks' agreement protocol runs. Numbers are not checked here (the CPU tests compare them with eager PyTorch); the
device rules are.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zgraph.capture.environment import traced_tensor
from zgraph.ops import current_host_read

DEVICE = torch.device("meta")
BACKEND = "standin"
aten = torch.ops.aten
_COPIES = (aten._to_copy, aten.to, aten.copy_, aten.copy, aten._copy_from)  # overload packets
_ONE_DTYPE = (aten.native_layer_norm.default, aten.native_group_norm.default)  # one dtype on CUDA (CPU: mixed too)


class DeviceAuditError(AssertionError):
    """zgraph broke a rule of running on an accelerator (see the module docstring)."""


@functools.cache
def install() -> None:
    """Register the ``standin`` backend (meta tensors only) and the meta kernels of the functional collectives
    whose c10d ops have none; once per process."""
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common: Any, options: Any) -> Any:
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)

    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=[DEVICE.type])
    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_gather_into_tensor", _gathered, "Meta")
    lib.impl("reduce_scatter_tensor", _scattered, "Meta")
    install.library = lib  # kept alive: the registrations last as long as the library object


def _gathered(x: Tensor, group_size: int, group_name: str) -> Tensor:
    return x.new_empty((x.shape[0] * group_size, *x.shape[1:]))


def _scattered(x: Tensor, reduce_op: str, group_size: int, group_name: str) -> Tensor:
    return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))


def _bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _target_device(args: tuple, kwargs: dict) -> torch.device:
    """The device an ``aten._to_copy`` / ``aten.to`` call copies to."""
    for value in (kwargs.get("device"), *args[1:]):
        if isinstance(value, (torch.device, str)):
            return torch.device(value)
        if isinstance(value, Tensor):  # to(other)
            return value.device
    return args[0].device


class DeviceAudit(TorchDispatchMode):
    """Fails (``DeviceAuditError``) the device rules of the module docstring for ops on real stand-in tensors
    (fake tensors and the functional tensors over them, as capture traces them, are left to capture). ``reads``:
    the reasons of the host reads seen; ``moved``: the bytes copied each way (``"to_host"``, ``"to_device"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.moved = {"to_host": 0, "to_device": 0}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        if any(traced_tensor(t) for t in tensors):
            return func(*args, **kwargs)
        if getattr(func, "namespace", None) == "zgraph":  # zgraph's own operators: audit the ops they run too
            with self:  # its Python implementation, below this mode's dispatch key, with the mode pushed again
                return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
        if func is aten._local_scalar_dense.default and tensors[0].device == DEVICE:
            self._host_read(func)
            return False if tensors[0].dtype == torch.bool else 0
        if func.overloadpacket in _COPIES:
            return self._copy(func, args, kwargs)
        on_device = any(t.device == DEVICE for t in tensors)
        if on_device and func in _ONE_DTYPE and len({t.dtype for t in tensors}) > 1:
            raise DeviceAuditError(
                f"{func} mixes dtypes {sorted(str(t.dtype) for t in tensors)}: CUDA's kernel takes its input and "
                "weights in one dtype (`expected scalar type BFloat16 but found Float`)"
            )
        host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if on_device and host:
            raise DeviceAuditError(
                f"{func} mixes host tensors {[tuple(t.shape) for t in host]} with device tensors; on a GPU this "
                "op fails (or copies every call)"
            )
        return func(*args, **kwargs)

    def _copy(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func.overloadpacket in (aten._to_copy, aten.to):
            source, target = args[0], _target_device(args, kwargs)
            if source.device == DEVICE and target.type == "cpu":
                self._host_read(func)
                dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), source.dtype)
                out = torch.zeros(source.shape, dtype=dtype)
                self.moved["to_host"] += _bytes(out)
                return out
            out = func(*args, **kwargs)
            if source.device.type == "cpu" and target == DEVICE:
                self.moved["to_device"] += _bytes(out)
            return out
        destination, source = args[0], args[1]
        if source.device == DEVICE and destination.device.type == "cpu":
            self._host_read(func)
            self.moved["to_host"] += _bytes(destination)
            return destination if func is not aten.copy.default else destination.clone()
        if source.device.type == "cpu" and destination.device == DEVICE and source.dim() > 0:
            self.moved["to_device"] += _bytes(destination)
        return func(*args, **kwargs)

    def _host_read(self, func: Any) -> None:
        reason = current_host_read()
        if reason is None:
            raise DeviceAuditError(
                f"{func} reads a device tensor on the host outside a region zgraph marks as a deliberate host read "
                "(zgraph.runtime.devices.host_read): on a GPU a synchronisation, in the step a stall every call"
            )
        self.reads.append(reason)
