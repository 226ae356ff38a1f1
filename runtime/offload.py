"""Offload tiers for optimizer states (``Config.offload_optimizer``) and stage-3 parameter shards
(``Config.offload_params``): the store behind the graph's offload nodes.

``"nvme"``: the ``offload`` pass rewrote the step graph so that each offloaded input (an optimizer state, or a
parameter's local shard) is read through ``zgraph::reload`` right before each phase's first read of it (an
optimizer state: its update; a parameter shard: the forward's all-gather, the backward's re-gather and the
update) and its new value goes to ``zgraph::write_back`` right after it is computed. This store serves those nodes
(it is the graph's ``zgraph.ops.OffloadTier``):

* Each offloaded input has two files under a new per-process subdirectory of ``offload_dir``
  (``zgraph-offload-<pid>-*``; a new run never reads an old run's files): the *current* copy, which reloads
  read, and the *next* one, which write-backs write. Both are reserved on disk (``posix_fallocate``) when the
  input is first offloaded, so a full disk is found then, before anything changed (later writes overwrite
  reserved space); the next copies become current only once the whole graph ran (``commit``), so every reload of
  a step reads the value the step started from. A graph that fails midway leaves every current copy as it was
  (``abort``); an I/O error in a write-back, though, comes after the graph may have updated some state in place,
  so the error says to resume from a checkpoint.
* Before a graph runs (``prepare``), inputs still in memory (the first step, or after ``materialize``) are
  written to their current copy, then the memory of every storage that offloaded inputs cover entirely is
  released by resizing it to 0 bytes (as FSDP frees parameter storage): every tensor, view, ``nn.Parameter`` and
  ``DTensor`` over it stays the same object, so ``optimizer.state`` and the model keep their identity. A storage
  that cannot be released (shared with another input) keeps its memory, updated from its file after each step.
* Reading outside the graph sees the real values. ``materialize(owner)`` reads the current copies back into
  the storages of the stores that hold an optimizer's states or a module's parameters (the next graph releases
  them again). It runs on its own for ``optimizer.state_dict()``, ``load_state_dict()`` and an eager ``step()``
  (also of an optimizer no step bound, over offloaded parameters), for ``module.state_dict()`` and
  ``load_state_dict()`` (of any module of a bound model: hooks), and zgraph calls it in ``zgraph.gather``,
  ``zgraph.full_state_dict``, ``zgraph.save`` and ``zgraph.load``. Anything else that reads a parameter's local
  tensor directly between steps (``p._local_tensor``, ``p.to_local()``) calls
  ``zgraph.runtime.offload.materialize(model)`` first.

After each step the store gives the host memory freed by then (the step's reloaded copies) back to the
operating system (``malloc_trim``), so the offloaded bytes leave the resident set between steps too, unless
``Config.keep_host_memory`` asks to keep freed memory.

Blocks are read and written with plain file I/O (``os.pread`` / ``os.pwrite`` on the tensor's own memory; no
``torch.load``, no memory map) and the page cache is told to drop them. Files are removed when the store is
dropped and at exit.

``"cpu"`` with the state already in host memory (the compute device is the CPU) is the identity: no store.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
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
from zgraph.runtime.host_memory import return_freed_host_memory

DEFAULT_WINDOW = 64 * 2**20  # read-ahead / write-behind bytes when Config.prefetch_bytes is "auto"


class OffloadError(ZGraphError):
    """The offload directory cannot be used (missing, not writable, full)."""


_LIVE_DIRS: dict[str, None] = {}
_OWNER_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer or module: its stores
_STORES: weakref.WeakSet = weakref.WeakSet()  # every live store


@atexit.register
def _remove_all() -> None:
    for path in list(_LIVE_DIRS):
        shutil.rmtree(path, ignore_errors=True)
    _LIVE_DIRS.clear()


def _local(t: Tensor) -> Tensor:
    return getattr(t, "_local_tensor", t)


class _State:
    """One offloaded input (an optimizer state or a parameter shard): its bytes, its two files and, once a graph
    read it, its tensor (a graph input)."""

    __slots__ = ("key", "tensor", "nbytes", "paths", "current")

    def __init__(self, key: tuple, nbytes: int, paths: tuple[str, str]):
        self.key = key  # zgraph.graph.state_key: (kind, index, field, optimizer)
        self.tensor: Tensor | None = None
        self.nbytes = nbytes
        self.paths = paths
        self.current = 0


def _bytes_of(t: Tensor) -> memoryview:
    """A contiguous tensor's bytes as a writable memoryview (no copy)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


def _disk_error(what: str, path: str, nbytes: int, error: OSError) -> OffloadError:
    return OffloadError(
        f"zgraph offload: {what} a block of {nbytes} bytes (an optimizer state or parameter shard) at {path} failed "
        f"({error.strerror or error}); is the disk under offload_dir full? Nothing of the step was applied and "
        "every state is where it was, so the training state is intact; free space (or lower offload_fraction) "
        "and call the step again"
    )


class NvmeStore(OffloadTier):
    """Optimizer states and parameter shards of one binding in files under ``directory`` (module docstring)."""

    def __init__(self, directory: str | os.PathLike, window: int = DEFAULT_WINDOW, trim: bool = True):
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
        _STORES.add(self)
        _watch_eager_optimizer_steps()
        self.states: dict[tuple, _State] = {}
        self.released: dict[int, tuple[Any, int, list[_State]]] = {}  # storage id: storage, bytes, its states
        self.bytes_offloaded = 0  # released by the last prepare
        self.bytes_total = 0  # optimizer state bytes the last graph read (set by the runtime)
        self.param_bytes_total = 0  # parameter shard bytes the last graph read (set by the runtime)
        self._slots: dict[int, _State] = {}
        self._written: set[int] = set()
        self._order: list[int] = []  # offloaded slots not read ahead yet, in the graph's order
        self.window = window  # bytes of states read ahead of their reload, and of write-backs in flight
        self.trim = trim  # after each graph, give the freed host memory back (not with Config.keep_host_memory)
        self._ahead: list[tuple[int, Future]] = []  # (slot, its read on the I/O thread), in the graph's order
        self._writes: list[tuple[int, Future]] = []  # (bytes, write) in flight
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zgraph-offload")
        self._finalizer = weakref.finalize(self, _release, self.released, self.path, self._io)
        self._finalizer.atexit = False  # at exit _remove_all only removes the files

    def watch(self, optimizers: list, modules: list) -> None:
        """Make reads of the offloaded state outside the graph see it resident: ``optimizer.state_dict()``,
        ``load_state_dict()`` and an eager ``step()``; ``state_dict()`` and ``load_state_dict()`` of every module
        of ``modules`` (the bound models) and of their submodules."""
        for opt in optimizers:
            if self._own(opt):
                opt.register_state_dict_pre_hook(materialize)
                opt.register_load_state_dict_pre_hook(lambda o, _sd: materialize(o))
                opt.register_step_pre_hook(lambda o, _a, _k: materialize(o))
        for module in {id(m): m for root in modules for m in root.modules()}.values():
            if self._own(module):
                module.register_state_dict_pre_hook(lambda m, *_: materialize(m))
                module.register_load_state_dict_pre_hook(lambda m, *_: materialize(m))

    def _own(self, owner: Any) -> bool:
        """Record this store as holding state of ``owner``; True the first time any store does (hook it)."""
        if owner in _OWNER_STORES:
            _OWNER_STORES[owner].add(self)
            return False
        _OWNER_STORES[owner] = weakref.WeakSet([self])
        return True

    def reserve(self, sizes: dict[tuple, int]) -> None:
        """Create the two files of each input (``sizes``: state key to bytes) not offloaded yet, reserved on disk:
        the runtime calls it when the step is set up, so a full disk is reported before anything runs."""
        fresh = {}
        for key, nbytes in sizes.items():
            if key not in self.states and key not in fresh:
                name = os.path.join(self.path, f"{key[0]}{len(self.states) + len(fresh)}")
                fresh[key] = _State(key, nbytes, (f"{name}.a", f"{name}.b"))
        self._reserve(list(fresh.values()))
        self.states.update(fresh)

    # ---------------------------------------------------------------------------------------- around a graph
    def prepare(self, slots: dict[int, tuple[tuple, Tensor]], keep: list[Tensor], order: list[int]) -> None:
        """Before a graph: ``slots`` maps each offloaded input position to its state key and tensor, ``order``
        lists the slot each of the graph's reloads reads, in graph order (a parameter shard is reloaded once
        per phase); storages holding a tensor of ``keep`` (the other inputs) are in memory while it runs."""
        self._slots, self._written, self._order = {}, set(), list(order)
        self.reserve({key: tensor.numel() * tensor.element_size() for key, tensor in slots.values()})
        for slot, (key, tensor) in slots.items():
            self._slots[slot] = state = self.states[key]
            state.tensor = tensor
        kept = {_local(t).untyped_storage()._cdata for t in keep if isinstance(t, Tensor)}
        _restore(self.released, only=kept)  # read directly by this graph (no reload node): needed in memory
        for state in self._slots.values():
            if state.tensor.untyped_storage().nbytes():  # in memory: its current copy is written from it
                self._write(state.paths[state.current], state.tensor.contiguous(), state.nbytes)
        self._release_covered(kept)
        self._ahead = []
        self._read_ahead()

    def read(self, slot: int, like: Tensor) -> Tensor:
        """The value of input ``slot``: read ahead by the I/O thread (waited for here), or now."""
        found = next((i for i, (s, _) in enumerate(self._ahead) if s == slot), None)
        if found is None:
            if slot in self._order:
                self._order.remove(slot)
            out = self._read_now(self._slots[slot], like)
        else:
            out = self._ahead.pop(found)[1].result()
        self._read_ahead()
        return out

    def write(self, slot: int, value: Tensor) -> None:
        """Write ``value`` (copied: the graph may reuse its memory) to the input's next copy on the I/O thread."""
        state = self._slots[slot]
        while self._writes and sum(n for n, _ in self._writes) + state.nbytes > self.window:
            self._writes.pop(0)[1].result()
        args = (state.paths[1 - state.current], value.clone(), state.nbytes, True)
        self._writes.append((state.nbytes, self._io.submit(self._write, *args)))
        self._written.add(slot)

    def commit(self) -> None:
        """The graph ran: once every write-back is on disk, the new copies become current (and a storage that
        could not be released takes the new value too)."""
        self._drain(raise_error=True)
        released = {id(state) for _, _, states in self.released.values() for state in states}
        for slot in self._written:
            state = self._slots[slot]
            state.current ^= 1
            if id(state) not in released and state.tensor.untyped_storage().nbytes():
                with torch.no_grad():
                    state.tensor.copy_(self._read_now(state, state.tensor))
        self._written.clear()
        if self.trim:  # the reloaded states and shards, freed by now, leave the resident set too
            return_freed_host_memory()

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
        """Start reading the next reloads in the graph's order while their bytes fit the window (one at least;
        a slot already being read waits for its reload)."""
        while self._order and self._order[0] not in (s for s, _ in self._ahead):
            ahead = sum(self._slots[s].nbytes for s, _ in self._ahead)
            if self._ahead and ahead + self._slots[self._order[0]].nbytes > self.window:
                return
            slot = self._order.pop(0)
            state = self._slots[slot]
            self._ahead.append((slot, self._io.submit(self._read_now, state, state.tensor)))

    def _drain(self, raise_error: bool) -> None:
        for future in [f for _, f in self._ahead] + [f for _, f in self._writes]:
            error = future.exception()
            if error is not None and raise_error:
                self._ahead.clear()
                self._writes.clear()
                raise error
        self._ahead.clear()
        self._writes.clear()

    def released_bytes(self, kind: str) -> int:
        """Bytes of released storages that hold inputs of ``kind`` (``"opt_state"`` or ``"param"``)."""
        return sum(nbytes for _, nbytes, states in self.released.values() if states[0].key[0] == kind)

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
                    f"zgraph offload: writing an updated optimizer state or parameter shard ({nbytes} bytes) to {path} "
                    f"failed ({error.strerror or error}) while the step ran; its parameters may be partly updated: "
                    "resume from the last checkpoint"
                ) from error
            raise _disk_error("writing", path, nbytes, error) from error

    def _release_covered(self, kept: set[int]) -> None:
        """Release every storage the offloaded inputs cover entirely, unless ``kept`` (ids) names it."""
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


def _restore(released: dict[int, tuple[Any, int, list[_State]]], only: set[int] | None = None) -> None:
    """Give every released storage (of ids ``only``, if given) its bytes back, read from its inputs' current
    copies."""
    for cdata in [c for c in released if only is None or c in only]:
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


def materialize(owner: Any, *_: Any) -> None:
    """Make the offloaded inputs of the stores holding ``owner``'s state (an optimizer's states, or the parameter
    shards of a module and its submodules) resident, readable, again; the next step offloads them anew."""
    owners = owner.modules() if isinstance(owner, torch.nn.Module) else (owner,)
    stores = {id(s): s for o in owners for s in list(_OWNER_STORES.get(o, ()))}
    for store in stores.values():
        store.materialize()


@functools.cache
def _watch_eager_optimizer_steps() -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_before_eager_optimizer_step)


def _before_eager_optimizer_step(optimizer: Any, *_: Any) -> None:
    """An eager ``step()`` of an optimizer no step bound (a zgraph forward/backward step, ``opt.step()`` outside
    it) over parameters whose shards are in files: read every store's inputs back first."""
    locals_ = (getattr(p, "_local_tensor", None) for group in optimizer.param_groups for p in group["params"])
    if _STORES and any(type(t) is Tensor and t.numel() and not t.untyped_storage().nbytes() for t in locals_):
        for store in list(_STORES):
            store.materialize()


def open_store(config: Any, device: str) -> NvmeStore | None:
    """The store ``config``'s offload fields ask for on ``device`` (a device type), or None for none or the
    identity (``"cpu"`` on the CPU); raises ``OffloadError`` for what this version does not do."""
    tiers = {"offload_optimizer": config.offload_optimizer, "offload_params": config.offload_params}
    for name, tier in tiers.items():
        if tier is not None and device != "cpu":
            raise OffloadError(
                f"zgraph: Config.{name}={tier!r} with the state on {device} is not implemented yet (pinned host "
                "buffers and a copy stream); this version offloads from the CPU only"
            )
    if "nvme" not in tiers.values():
        return None
    window = config.prefetch_bytes if isinstance(config.prefetch_bytes, int) else DEFAULT_WINDOW
    return NvmeStore(config.offload_dir, window, trim=not config.keep_host_memory)


def describe(optimizer_tier: str | None, params_tier: str | None, store: NvmeStore | None) -> list[str]:
    """``explain()``'s lines about offload."""
    lines = []
    if optimizer_tier == "cpu":
        lines.append('offload_optimizer="cpu": the identity here (the states are in host memory already)')
    if params_tier == "cpu":
        lines.append('offload_params="cpu": the identity here (the parameters are in host memory already)')
    if store is None:
        return lines
    count = lambda kind: sum(1 for key in store.states if key[0] == kind)
    if optimizer_tier == "nvme":
        lines.append(
            f'offload_optimizer="nvme": {count("opt_state")} optimizer states ({store.released_bytes("opt_state")} '
            f"of {store.bytes_total} optimizer state bytes) live in files in {store.path}; the graph reloads each "
            "one right before the optimizer reads it and writes it back right after its update (the `offload` "
            "pass's zgraph.reload / zgraph.write_back nodes)"
        )
    if params_tier == "nvme":
        lines.append(
            f'offload_params="nvme": {count("param")} parameter shards ({store.released_bytes("param")} of '
            f"{store.param_bytes_total} sharded parameter bytes) live in files in {store.path}; the graph reloads "
            "each one right before each phase's first read (the forward's all-gather, the backward's re-gather, "
            "the update) and writes it back right after its update (zgraph.reload / zgraph.write_back nodes); "
            "parameters whole on every rank stay in memory"
        )
    return lines
