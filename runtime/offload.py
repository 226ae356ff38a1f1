"""Offload tiers for optimizer states (``Config.offload_optimizer``): the store behind the graph's offload nodes.

``"nvme"``: the ``offload`` pass rewrote the step graph so that each offloaded optimizer state is read through
``zgraph::reload`` right before the optimizer needs it and its new value goes to ``zgraph::write_back`` right
after it is computed. This store serves those nodes (it is the graph's ``zgraph.ops.OffloadTier``):

* Each offloaded state has two files under a new per-process subdirectory of ``offload_dir``
  (``zgraph-offload-<pid>-*``; a new run never reads an old run's files): the *current* copy, which reloads
  read, and the *next* one, which write-backs write. Both are reserved on disk (``posix_fallocate``) when the
  state is first offloaded, so a full disk is found then, before anything changed (later writes overwrite
  reserved space); the next copies become current only once the whole graph ran (``commit``). A graph that fails
  midway leaves every current copy as it was (``abort``); an I/O error in a write-back, though, comes after the
  graph may have updated some parameters in place, so the error says to resume from a checkpoint.
* Before a graph runs (``prepare``), states still in memory (the first step, or after ``materialize``) are
  written to their current copy, then the memory of every storage that offloaded states cover entirely is
  released by resizing it to 0 bytes (as FSDP frees parameter storage): every tensor, view and ``DTensor`` over
  it stays the same object, so ``optimizer.state`` keeps its identity.
* ``materialize(optimizer)`` (called by ``optimizer.state_dict()``, ``load_state_dict()``, an eager ``step()`` and
  zgraph's checkpoint code) reads the current copies back into those storages; the next graph releases them again.

Blocks are read and written with plain file I/O (``os.pread`` / ``os.pwrite`` on the tensor's own memory; no
``torch.load``, no memory map) and the page cache is told to drop them. Files are removed when the store is
dropped and at exit.

``"cpu"`` with states already in host memory (the compute device is the CPU) is the identity: no store.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from zgraph.errors import ZGraphError
from zgraph.ops import OffloadTier

DEFAULT_WINDOW = 64 * 2**20  # read-ahead / write-behind bytes when Config.prefetch_bytes is "auto"


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


class _State:
    """One offloaded optimizer state: its tensor (a graph input) and its two files."""

    __slots__ = ("tensor", "nbytes", "paths", "current")

    def __init__(self, tensor: Tensor, paths: tuple[str, str]):
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self.paths = paths
        self.current = 0


def _bytes_of(t: Tensor) -> memoryview:
    """A contiguous tensor's bytes as a writable memoryview (no copy)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


def _disk_error(what: str, path: str, nbytes: int, error: OSError) -> OffloadError:
    return OffloadError(
        f"zgraph offload: {what} an optimizer state block of {nbytes} bytes at {path} failed "
        f"({error.strerror or error}); is the disk under offload_dir full? Nothing of the step was applied and "
        "every state is where it was, so the training state is intact; free space (or lower offload_fraction) "
        "and call the step again"
    )


class NvmeStore(OffloadTier):
    """Optimizer states of one binding in files under ``directory`` (module docstring)."""

    def __init__(self, directory: str | os.PathLike, window: int = DEFAULT_WINDOW):
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
        self.states: dict[tuple, _State] = {}
        self.released: dict[int, tuple[Any, int, list[_State]]] = {}  # storage id: storage, bytes, its states
        self.bytes_offloaded = 0  # released by the last prepare
        self.bytes_total = 0  # optimizer state bytes the last graph read (set by the runtime)
        self._slots: dict[int, _State] = {}
        self._written: set[int] = set()
        self._order: list[int] = []  # offloaded slots not read ahead yet, in the graph's order
        self.window = window  # bytes of states read ahead of their reload, and of write-backs in flight
        self._ahead: dict[int, Future] = {}  # slot: its read on the I/O thread
        self._writes: list[tuple[int, Future]] = []  # (bytes, write) in flight
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zgraph-offload")
        self._finalizer = weakref.finalize(self, _release, self.released, self.path, self._io)
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

    # ---------------------------------------------------------------------------------------- around a graph
    def prepare(self, slots: dict[int, tuple[tuple, Tensor]], keep: list[Tensor]) -> None:
        """Before a graph with offload nodes: ``slots`` maps each offloaded input position (in the order the graph
        reloads them) to its state's key and tensor; storages holding a tensor of ``keep`` stay in memory."""
        self._slots, self._written, self._order = {}, set(), list(slots)
        fresh = []
        for slot, (key, tensor) in slots.items():
            state = self.states.get(key)
            if state is None:
                n = len(self.states) + len(fresh)
                state = _State(tensor, (os.path.join(self.path, f"state{n}.a"), os.path.join(self.path, f"state{n}.b")))
                fresh.append(state)
            state.tensor = tensor
            self._slots[slot] = state
        self._reserve(fresh)
        self.states.update((key, self._slots[slot]) for slot, (key, _) in slots.items())
        for state in self._slots.values():
            if state.tensor.untyped_storage().nbytes():  # in memory: its current copy is written from it
                self._write(state.paths[state.current], state.tensor.contiguous(), state.nbytes)
        self._release_covered(keep)
        self._ahead = {}
        self._read_ahead()

    def read(self, slot: int, like: Tensor) -> Tensor:
        """The state of input ``slot``: read ahead by the I/O thread (waited for here), or now."""
        future = self._ahead.pop(slot, None)
        if future is None:
            if slot in self._order:
                self._order.remove(slot)
            out = self._read_now(self._slots[slot], like)
        else:
            out = future.result()
        self._read_ahead()
        return out

    def write(self, slot: int, value: Tensor) -> None:
        """Write ``value`` (copied: the graph may reuse its memory) to the state's next copy on the I/O thread."""
        state = self._slots[slot]
        while self._writes and sum(n for n, _ in self._writes) + state.nbytes > self.window:
            self._writes.pop(0)[1].result()
        args = (state.paths[1 - state.current], value.clone(), state.nbytes, True)
        self._writes.append((state.nbytes, self._io.submit(self._write, *args)))
        self._written.add(slot)

    def commit(self) -> None:
        """The graph ran: once every write-back is on disk, the new copies become current."""
        self._drain(raise_error=True)
        for slot in self._written:
            self._slots[slot].current ^= 1
        self._written.clear()

    def abort(self) -> None:
        """The graph failed: the current copies stay current."""
        self._drain(raise_error=False)
        self._written.clear()

    # ----------------------------------------------------------------------------------------------- I/O thread
    def _read_now(self, state: _State, like: Tensor) -> Tensor:
        out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        _read_file(state.paths[state.current], _bytes_of(out))
        return out

    def _read_ahead(self) -> None:
        """Start reading the next states in the graph's order while their bytes fit the window (one at least)."""
        while self._order:
            ahead = sum(self._slots[s].nbytes for s in self._ahead)
            if self._ahead and ahead + self._slots[self._order[0]].nbytes > self.window:
                return
            state = self._slots[self._order[0]]
            self._ahead[self._order.pop(0)] = self._io.submit(self._read_now, state, state.tensor)

    def _drain(self, raise_error: bool) -> None:
        for future in [f for f in self._ahead.values()] + [f for _, f in self._writes]:
            error = future.exception()
            if error is not None and raise_error:
                self._ahead.clear()
                self._writes.clear()
                raise error
        self._ahead.clear()
        self._writes.clear()

    def materialize(self) -> None:
        """Read every released state back into its storage."""
        _restore(self.released)

    def close(self) -> None:
        """Restore every state and remove the files now."""
        self._finalizer()

    # ------------------------------------------------------------------------------------------- files
    def _reserve(self, fresh: list[_State]) -> None:
        made: list[str] = []
        try:
            for state in fresh:
                for path in state.paths:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    made.append(path)
                    try:
                        if state.nbytes and hasattr(os, "posix_fallocate"):
                            os.posix_fallocate(fd, 0, state.nbytes)
                        else:
                            os.ftruncate(fd, state.nbytes)
                    finally:
                        os.close(fd)
        except OSError as error:
            for path in made:
                os.unlink(path)
            raise _disk_error("reserving", made[-1] if made else self.path, state.nbytes, error) from error

    def _write(self, path: str, value: Tensor, nbytes: int, during_graph: bool = False) -> None:
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                view, done = _bytes_of(value), 0
                while done < nbytes:
                    done += os.pwrite(fd, view[done:], done)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError as error:
            if during_graph:
                raise OffloadError(
                    f"zgraph offload: writing an updated optimizer state ({nbytes} bytes) to {path} failed "
                    f"({error.strerror or error}) while the step ran; its parameters may be partly updated: resume "
                    "from the last checkpoint"
                ) from error
            raise _disk_error("writing", path, nbytes, error) from error

    def _release_covered(self, keep: list[Tensor]) -> None:
        kept = {_local(t).untyped_storage()._cdata for t in keep if isinstance(t, Tensor)}
        by_storage: dict[int, tuple[Any, list[_State]]] = {}
        for state in self._slots.values():
            storage = state.tensor.untyped_storage()
            by_storage.setdefault(storage._cdata, (storage, []))[1].append(state)
        self.bytes_offloaded = sum(nbytes for _, nbytes, _ in self.released.values())
        for cdata, (storage, states) in by_storage.items():
            nbytes = storage.nbytes()
            covered = sum(s.nbytes for s in states) == nbytes and len({s.tensor.data_ptr() for s in states}) == len(
                states
            )
            if nbytes and covered and cdata not in kept and storage.resizable():
                storage.resize_(0)
                self.released[cdata] = (storage, nbytes, states)
                self.bytes_offloaded += nbytes


def _read_file(path: str, view: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise OffloadError(f"zgraph offload: {path} is shorter than the {len(view)} bytes written")
            done += n


def _restore(released: dict[int, tuple[Any, int, list[_State]]]) -> None:
    """Give every released storage its bytes back, read from its states' current copies."""
    while released:
        cdata = next(iter(released))
        storage, nbytes, states = released[cdata]
        storage.resize_(nbytes)
        for state in states:
            _read_file(state.paths[state.current], _bytes_of(state.tensor))
        del released[cdata]


def _release(released: dict, path: str, io: ThreadPoolExecutor) -> None:
    """When the store is dropped: give the states their memory back, then remove the files."""
    io.shutdown(wait=True)
    try:
        _restore(released)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        _LIVE_DIRS.pop(path, None)


def materialize(optimizer: Any, *_: Any) -> None:
    """Make every offloaded state of ``optimizer`` resident (readable) again; the next step offloads them anew."""
    for store in list(_OPTIMIZER_STORES.get(optimizer, ())):
        store.materialize()


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
    window = config.prefetch_bytes if isinstance(config.prefetch_bytes, int) else DEFAULT_WINDOW
    return NvmeStore(config.offload_dir, window)


def describe(optimizer_tier: str | None, params_tier: str | None, store: NvmeStore | None) -> list[str]:
    """``explain()``'s lines about offload."""
    lines = []
    if optimizer_tier == "cpu" and store is None:
        lines.append('offload_optimizer="cpu": the identity here (the states are in host memory already)')
    if params_tier == "cpu":
        lines.append('offload_params="cpu": the identity here (the parameters are in host memory already)')
    if store is not None:
        lines.append(
            f'offload_optimizer="nvme": {len(store.states)} optimizer states ({store.bytes_offloaded} of '
            f"{store.bytes_total} optimizer state bytes) live in files in {store.path}; the graph reloads each one "
            "right before the optimizer reads it and writes it back right after its update (the `offload` pass's "
            "zgraph.reload / zgraph.write_back nodes)"
        )
    return lines
