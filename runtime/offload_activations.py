"""The activation tier (``Config.offload_activations``): where the ``offload_activations`` pass's
``zgraph::stash`` nodes put saved activations and its ``zgraph::unstash`` nodes read them back, within one run of
the graph (activations live only within a step).

* ``"nvme"``: one file per stashed value under a per-process subdirectory of ``offload_dir``
  (``zgraph-activations-<pid>-*``), written behind on an I/O thread of the tier's own (at most ``window`` bytes
  of writes in flight, each from a copy: a compiled graph may reuse a dead value's buffer) and read ahead on the
  same thread. A value on a device is first copied to host memory (synchronously,
  for now). Each file is removed once read back; whatever is left (a step that failed) is removed after the step,
  and the directory when the tier is dropped or at exit.
* ``"cpu"`` for a model on CUDA: a pinned host buffer per value, copied to and from the device on a copy stream of
  the tier's own, from a device copy of the value (the compute stream waits for a read only where ``unstash``
  returns it; ``record_stream`` keeps the device memory for the copies); elsewhere (the tests' stand-in device)
  synchronous copies to host memory. Buffers are dropped once read back, and after the step.

Reads ahead follow the order of the graph's unstash nodes: after each stash and each unstash, the next values to
come back, already stashed, are read while their bytes fit ``window`` (``Config.prefetch_bytes``; one at least).
A value comes back with the shape, strides, dtype and bits it had, so training is bitwise the same. The tier
passes reloads and write-backs of offloaded state (``zgraph.runtime.offload``) on to the state's store.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from zgraph.graph import offload_moves
from zgraph.ops import UNSTASH, OffloadTier, host_read
from zgraph.runtime.offload_nvme import LIVE_DIRS, handed, load_file, write_file
from zgraph.runtime.offload_store import DEFAULT_WINDOW, OffloadError, State


class _Done:
    """An operation finished when it was made: ``result()`` gives its value."""

    def __init__(self, value: Any = None):
        self.value = value

    def result(self) -> Any:
        return self.value


class _Moved:
    """A read in flight (``pending.result()``: a host tensor), then copied to ``device`` when its result is asked."""

    def __init__(self, pending: Any, device: torch.device):
        self.pending, self.device = pending, device

    def result(self) -> Tensor:
        value = self.pending.result()
        return value if self.device.type == "cpu" else value.to(self.device)


class ActivationFiles:
    """The ``"nvme"`` activation tier of one binding: a directory of its own and an I/O thread (module docstring)."""

    def __init__(self, directory: str | os.PathLike):
        directory = os.fspath(directory)
        if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
            raise OffloadError(f"zgraph offload: Config.offload_dir {directory!r} is not a writable directory")
        self.path = tempfile.mkdtemp(prefix=f"zgraph-activations-{os.getpid()}-", dir=directory)
        LIVE_DIRS[self.path] = None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zgraph-activations")
        self._finalizer = weakref.finalize(self, _remove, self.path, self._io)
        self._finalizer.atexit = False  # at exit offload_nvme removes the live directories

    def close(self) -> None:
        self._finalizer()

    def put(self, key: int, value: Tensor) -> Future:
        if value.device.type != "cpu":
            with host_read("offload_activations: a saved activation copied to host memory for its file"):
                value = value.to("cpu")
        else:  # a copy: a compiled graph (inductor) may reuse a dead value's buffer while the thread writes it
            value = value.clone(memory_format=torch.contiguous_format)
        value = value.contiguous()
        nbytes = value.numel() * value.element_size()
        self._reserve(key, nbytes)
        return self._io.submit(write_file, self._file(key), value, nbytes, True)

    def get(self, key: int, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> _Moved:
        return _Moved(handed(self._io, _read_file, self._file(key), shape, dtype), device)

    def clear(self) -> None:
        """Remove the files a step left (the directory stays, for the next step)."""
        for name in os.listdir(self.path):
            os.unlink(os.path.join(self.path, name))

    def _file(self, key: int) -> str:
        return os.path.join(self.path, f"act{key}")

    def _reserve(self, key: int, nbytes: int) -> None:
        try:
            with open(self._file(key), "wb") as f:
                f.truncate(nbytes)
        except OSError as error:
            raise OffloadError(
                f"zgraph offload: cannot create the file of a saved activation ({nbytes} bytes) in {self.path} "
                f"({error.strerror or error}); is the disk under offload_dir full?"
            ) from error


def _read_file(path: str, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    out = torch.empty(shape, dtype=dtype)
    state = State((), out.numel() * out.element_size(), (path,))
    load_file(state, out)
    os.unlink(path)
    return out


def _remove(path: str, io: ThreadPoolExecutor) -> None:
    io.shutdown(wait=True)
    shutil.rmtree(path, ignore_errors=True)
    LIVE_DIRS.pop(path, None)


class _Copied:
    """A copy on the tier's stream: ``result()`` makes the current stream wait for it and gives ``value``."""

    def __init__(self, value: Tensor, event: torch.cuda.Event, source: Tensor):
        self.value, self.event, self.source = value, event, source  # the source is held until the copy is done

    def result(self) -> Tensor:
        torch.cuda.current_stream(self.event.device).wait_event(self.event)
        return self.value


class ActivationHost:
    """The ``"cpu"`` activation tier for a model on ``device``: host memory (module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._blocks: dict[int, Tensor] = {}

    def close(self) -> None:
        self._blocks.clear()

    def put(self, key: int, value: Tensor) -> Any:
        if self.stream is None:
            with host_read("offload_activations: a saved activation copied to host memory"):
                self._blocks[key] = value.to("cpu", copy=True).contiguous()
            return _Done()
        host = self._blocks[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        # from a copy of its own: a compiled graph (inductor) may reuse a dead value's buffer on the compute stream
        return self._copy(host, value.clone(memory_format=torch.contiguous_format), value)

    def get(self, key: int, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Any:
        host = self._blocks.pop(key)
        if self.stream is None:
            return _Done(host.to(device))
        out = torch.empty(shape, dtype=dtype, device=device)
        return self._copy(out, host, out)

    def clear(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._blocks.clear()

    def _copy(self, into: Tensor, source: Tensor, on_device: Tensor) -> _Copied:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the source is computed by then
        with torch.cuda.stream(self.stream):
            into.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        on_device.record_stream(self.stream)
        if source.device.type != "cpu":
            source.record_stream(self.stream)
        return _Copied(into, event, source)


def open_activation_tier(config: Any, device: torch.device) -> ActivationFiles | ActivationHost | None:
    """The activation tier ``Config.offload_activations`` asks for with the model on ``device``, or None (none, or
    ``"cpu"`` on the CPU: the identity)."""
    tier = getattr(config, "offload_activations", None)
    if not offload_moves(tier, device.type):
        return None
    return ActivationFiles(config.offload_dir) if tier == "nvme" else ActivationHost(device)


def unstash_order(gm: torch.fx.GraphModule) -> list[int]:
    """The keys of ``gm``'s unstash nodes, in graph order."""
    return [n.args[1] for n in gm.graph.nodes if n.target is UNSTASH]


class ActivationStash(OffloadTier):
    """One run's saved activations in ``backend`` (``ActivationFiles`` / ``ActivationHost``), read ahead in
    ``order`` (the unstash keys in graph order) within ``window`` bytes; reloads and write-backs go to ``inner``."""

    def __init__(self, backend: Any, order: Sequence[int], window: int = DEFAULT_WINDOW, inner: Any = None):
        self.backend, self.window, self.inner = backend, window, inner
        self._order = list(order)
        self._kept: dict[int, tuple[torch.Size, torch.dtype, torch.device, int]] = {}  # stashed, not read yet
        self._ahead: dict[int, Any] = {}  # key: read in flight
        self._writes: list[tuple[int, Any]] = []  # (bytes, write in flight)

    def read(self, slot: int, like: Tensor) -> Tensor:
        return self.inner.read(slot, like)

    def write(self, slot: int, value: Tensor) -> None:
        self.inner.write(slot, value)

    def stash(self, key: int, value: Tensor) -> None:
        nbytes = value.numel() * value.element_size()
        while self._writes and sum(n for n, _ in self._writes) + nbytes > self.window:
            self._writes.pop(0)[1].result()
        self._writes.append((nbytes, self.backend.put(key, value)))
        self._kept[key] = (value.shape, value.dtype, value.device, nbytes)
        self._read_ahead()

    def unstash(self, key: int, like: Tensor) -> Tensor:
        pending = self._ahead.pop(key, None)
        if pending is None:
            if key in self._order:
                self._order.remove(key)
            shape, dtype, device, _ = self._kept[key]
            pending = self.backend.get(key, shape, dtype, device)
        out = pending.result()
        del self._kept[key]
        self._read_ahead()
        if out.stride() != like.stride() or out.shape != like.shape:
            out = torch.empty_strided(like.shape, like.stride(), dtype=out.dtype, device=out.device).copy_(out)
        return out

    def finish(self, raise_error: bool = True) -> None:
        """After the run (or its failure, without ``raise_error``): every write and read finished, what is left
        freed."""
        try:
            for pending in [p for _, p in self._writes] + list(self._ahead.values()):
                try:
                    pending.result()
                except Exception:
                    if raise_error:
                        raise
        finally:
            self._writes, self._ahead, self._kept = [], {}, {}
            self.backend.clear()

    def _read_ahead(self) -> None:
        while self._order and self._order[0] in self._kept:
            key = self._order[0]
            shape, dtype, device, nbytes = self._kept[key]
            ahead = sum(self._kept[k][3] for k in self._ahead)
            if self._ahead and ahead + nbytes > self.window:
                return
            self._order.pop(0)
            self._ahead[key] = self.backend.get(key, shape, dtype, device)
