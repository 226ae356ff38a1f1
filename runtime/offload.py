"""Offload tiers for optimizer states between steps (``Config.offload_optimizer``).

``"nvme"``: after each step that updates them, the optimizer states of ``offload_fraction`` of the bytes (whole
state buffers, in the binding's parameter order) are written to files and their memory is released; before the
next step that reads them they are read back into the same tensors. A *block* is one state buffer (a storage: a
parameter's ``exp_avg``, or a bucket's flat buffer shared by several states), written and read whole with plain
file I/O (``os.pwrite`` / ``readinto`` into the tensor's own memory; no ``torch.load``, no memory map), and the
page cache is told to drop it. Memory is released by resizing the storage to 0 bytes and restored by resizing it
back (the way FSDP frees parameter storage): every tensor, view and ``DTensor`` over it stays the same object,
so ``optimizer.state`` keeps its identity and ``materialize(optimizer)`` (called by ``optimizer.state_dict()``,
``load_state_dict()``, an eager ``step()`` and zgraph's checkpoint code) makes it readable again.

Files live in a new per-process subdirectory of ``offload_dir`` (``zgraph-offload-<pid>-*``; a new run never
reads an old run's files), removed when the store is dropped and at exit. A block is written to a temporary
file and renamed over the previous one only once complete; its memory is released only after that, so a full
disk raises ``OffloadError`` with every state still in memory.

``"cpu"`` with states already in host memory (the compute device is the CPU) is the identity: no store.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import tempfile
import weakref
from typing import Any

from torch import Tensor

from zgraph.errors import ZGraphError


class OffloadError(ZGraphError):
    """The offload directory cannot be used (missing, not writable, full)."""


_LIVE_DIRS: dict[str, None] = {}
_OPTIMIZER_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@atexit.register
def _remove_all() -> None:
    for path in list(_LIVE_DIRS):
        shutil.rmtree(path, ignore_errors=True)
    _LIVE_DIRS.clear()


def _local(t: Tensor) -> Tensor:
    return getattr(t, "_local_tensor", t)


def _buffer(storage: Any) -> memoryview:
    """The storage's bytes as a writable memoryview (no copy)."""
    n = storage.nbytes()
    return memoryview((ctypes.c_char * n).from_address(storage.data_ptr())).cast("B")


class _Block:
    __slots__ = ("storage", "nbytes", "path")

    def __init__(self, storage: Any, path: str):
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.path = path


def _reload(blocks: list[_Block]) -> None:
    """Read every block back into its storage (resized to its size again); the list is emptied."""
    while blocks:
        block = blocks[-1]
        block.storage.resize_(block.nbytes)
        view = _buffer(block.storage)
        with open(block.path, "rb", buffering=0) as f:
            done = 0
            while done < block.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise OffloadError(f"zgraph offload: {block.path} is shorter than the {block.nbytes} bytes written")
                done += n
        blocks.pop()


def _release(blocks: list[_Block], path: str) -> None:
    """When the store is dropped: give the states their memory back, then remove the files."""
    try:
        _reload(blocks)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        _LIVE_DIRS.pop(path, None)


class NvmeStore:
    """Optimizer states of one binding in files under ``directory`` between steps (module docstring)."""

    def __init__(self, directory: str | os.PathLike, fraction: float):
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise OffloadError(f"zgraph offload: Config.offload_dir {directory!r} does not exist or is not a directory")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise OffloadError(f"zgraph offload: Config.offload_dir {directory!r} is not writable by this process")
        try:
            self.path = tempfile.mkdtemp(prefix=f"zgraph-offload-{os.getpid()}-", dir=directory)
        except OSError as error:
            raise OffloadError(f"zgraph offload: cannot create a directory in {directory!r}: {error}") from error
        _LIVE_DIRS[self.path] = None
        self.fraction = fraction
        self.blocks: list[_Block] = []  # offloaded now (their storages hold 0 bytes)
        self.bytes_offloaded = 0  # of the last offload
        self.bytes_total = 0  # optimizer state bytes the last offload considered
        self._finalizer = weakref.finalize(self, _release, self.blocks, self.path)
        self._finalizer.atexit = False  # at exit _remove_all only removes the files

    def watch(self, optimizers: list) -> None:
        """Make ``optimizer.state_dict()``, ``load_state_dict()`` and an eager ``step()`` see resident states."""
        for opt in optimizers:
            if opt in _OPTIMIZER_STORES:
                _OPTIMIZER_STORES[opt].add(self)
                continue
            _OPTIMIZER_STORES[opt] = weakref.WeakSet([self])
            opt.register_state_dict_pre_hook(materialize)
            opt.register_load_state_dict_pre_hook(lambda o, _sd: materialize(o))
            opt.register_step_pre_hook(lambda o, _a, _k: materialize(o))

    def reload(self) -> None:
        """Read every offloaded block back into its tensors."""
        _reload(self.blocks)

    def offload(self, states: list[Tensor], exclude: list[Tensor]) -> None:
        """Write the storages of ``states`` (in order, ``fraction`` of their bytes) to files and free them;
        storages that also hold a tensor of ``exclude`` (parameters, gradients, buffers) stay."""
        if self.blocks:
            return  # already offloaded: this step did not read them
        kept = {_local(t).untyped_storage()._cdata for t in exclude if isinstance(t, Tensor)}
        storages: dict[int, Any] = {}
        for t in states:
            storage = _local(t).untyped_storage()
            if storage._cdata not in kept and storage.nbytes() and storage.resizable():
                storages.setdefault(storage._cdata, storage)
        self.bytes_total = total = sum(s.nbytes() for s in storages.values())
        budget, done = self.fraction * total, 0
        for n, storage in enumerate(storages.values()):
            if done >= budget:
                break
            block = _Block(storage, os.path.join(self.path, f"block{n}.bin"))
            self._write(block)
            storage.resize_(0)
            self.blocks.append(block)
            done += block.nbytes
        self.bytes_offloaded = done

    def _write(self, block: _Block) -> None:
        tmp = block.path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view, done = _buffer(block.storage), 0
                while done < block.nbytes:
                    done += os.pwrite(fd, view[done:], done)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            os.replace(tmp, block.path)
        except OSError as error:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise OffloadError(
                f"zgraph offload: writing an optimizer state block of {block.nbytes} bytes to {block.path} failed "
                f"({error.strerror or error}); is the disk under offload_dir full? The step's update was applied and "
                "this block and the ones after it stay in memory, so the training state is intact; free space (or "
                "lower offload_fraction) and call the step again"
            ) from error

    def close(self) -> None:
        """Reload every state and remove the files now."""
        self._finalizer()


def materialize(optimizer: Any, *_: Any) -> None:
    """Make every offloaded state of ``optimizer`` resident (readable) again; the next step offloads them anew."""
    for store in list(_OPTIMIZER_STORES.get(optimizer, ())):
        store.reload()


def open_store(config: Any, device: str) -> NvmeStore | None:
    """The store ``config``'s offload fields ask for on ``device`` (a device type), or None for none or the
    identity (``"cpu"`` on the CPU); raises ``OffloadError`` for what this version does not do."""
    optimizer_tier, params_tier = config.offload_optimizer, config.offload_params
    if params_tier == "nvme" or (params_tier == "cpu" and device != "cpu"):
        raise OffloadError(
            f'zgraph: Config.offload_params={params_tier!r} on {device} is not implemented yet (only "cpu" on a CPU '
            "compute device, the identity); use offload_optimizer, or offload_params=None"
        )
    if optimizer_tier is None or (optimizer_tier == "cpu" and device == "cpu"):
        return None
    if device != "cpu":
        raise OffloadError(
            f"zgraph: Config.offload_optimizer={optimizer_tier!r} with states on {device} is not implemented yet "
            "(pinned host buffers and a copy stream); this version offloads from the CPU only"
        )
    return NvmeStore(config.offload_dir, config.offload_fraction)


def describe(optimizer_tier: str | None, params_tier: str | None, store: NvmeStore | None) -> list[str]:
    """``explain()``'s lines about offload."""
    lines = []
    if optimizer_tier == "cpu" and store is None:
        lines.append('offload_optimizer="cpu": the identity here (the states are in host memory already)')
    if params_tier == "cpu":
        lines.append('offload_params="cpu": the identity here (the parameters are in host memory already)')
    if store is not None:
        lines.append(
            f'offload_optimizer="nvme": the runtime writes {store.bytes_offloaded} of {store.bytes_total} optimizer '
            f"state bytes to {len(store.blocks) or 'its'} blocks in {store.path} after each update and reads them "
            "back before the next one (around the graph: the graph itself has no offload nodes yet)"
        )
    return lines


def binding_tensors(binding: Any) -> tuple[list[Tensor], list[Tensor]]:
    """The optimizer state tensors of ``binding`` (in parameter order) and the tensors whose storage must stay."""
    states: list[Tensor] = []
    for o in binding.optimizers:
        for indices in o.group_params:
            for i in indices:
                for value in o.optimizer.state.get(binding.params[i].tensor, {}).values():
                    if isinstance(value, Tensor) and value.dim() > 0:
                        states.append(value)
    exclude = [r.tensor for r in binding.params] + [r.tensor.grad for r in binding.params]
    exclude += [r.get() for r in binding.buffers]
    return states, [t for t in exclude if isinstance(t, Tensor)]
