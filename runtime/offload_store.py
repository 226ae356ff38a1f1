"""What every offload tier does around a graph: the bookkeeping shared by the NVMe files
(``zgraph.runtime.offload_nvme``) and host memory for state on a device (``zgraph.runtime.offload_host``).

A tier is the graph's ``zgraph.ops.OffloadTier``: the ``offload`` pass rewrote the step graph so that each
offloaded input (an optimizer state, or a parameter's local shard) is read through ``zgraph::reload`` right
before each phase's first read of it and its new value goes to ``zgraph::write_back`` right after it is
computed. ``TierStore`` serves those nodes:

* ``reserve``: each input gets its place in the tier when it is first offloaded (so a full disk, or too little
  host memory, is found at set-up, before anything changed).
* ``prepare`` (before a graph): inputs still in memory (the first step, or after ``materialize``) are copied to
  the tier, then the memory of every storage that offloaded inputs cover entirely is released by resizing it to
  0 bytes (as FSDP frees parameter storage): every tensor, view, ``nn.Parameter`` and ``DTensor`` over it stays
  the same object, so ``optimizer.state`` and the model keep their identity. A storage that cannot be released
  (shared with another input) keeps its memory, updated from the tier after each step.
* ``read`` / ``write``: a reload returns the value (read ahead, in the graph's order, within ``window`` bytes);
  a write-back copies the new value out while the graph goes on (at most ``window`` bytes in flight).
* ``commit`` / ``abort`` (after the graph): the writes are finished and become what the next reads see, or the
  graph failed.
* ``materialize``: reads the released states back into their storages, for anything that reads them outside the
  graph: ``optimizer.state_dict()``, ``load_state_dict()`` and an eager ``step()``; ``module.state_dict()`` and
  ``load_state_dict()`` (of any module of a bound model: hooks), ``zgraph.gather``, ``full_state_dict``,
  ``save`` and ``load``. Code that reads a parameter's local tensor directly between steps calls
  ``materialize(model)`` first.

A subclass says how a block of bytes is kept (``_make``, ``_store``, ``_load``) and moved while the graph runs
(``_read_async``, ``_write_async``, each returning an object with ``result()`` and ``exception()``).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import Tensor

from zgraph.errors import ZGraphError
from zgraph.ops import OffloadTier
from zgraph.runtime.sharded_state import current_parameter

DEFAULT_WINDOW = 64 * 2**20  # read-ahead / write-behind bytes when Config.prefetch_bytes is "auto"

_OWNER_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer or module: its stores
_STORES: weakref.WeakSet = weakref.WeakSet()  # every live store


class OffloadError(ZGraphError):
    """The offload tier cannot be used (a missing or full directory, too little host memory, a device it lacks)."""


def local(t: Tensor) -> Tensor:
    """A DTensor's local tensor; any other tensor itself."""
    return getattr(t, "_local_tensor", t)


class State:
    """One offloaded input (an optimizer state or a parameter shard): its bytes, its place in the tier (the
    subclass's ``block``; ``current`` picks one of two copies where a tier keeps two) and, once a graph read it,
    its tensor (a graph input)."""

    __slots__ = ("key", "tensor", "nbytes", "block", "current")

    def __init__(self, key: tuple, nbytes: int, block: Any):
        self.key = key  # zgraph.graph.state_key: (kind, index, field, optimizer)
        self.tensor: Tensor | None = None
        self.nbytes = nbytes
        self.block = block
        self.current = 0


class TierStore(OffloadTier):
    """Optimizer states and parameter shards of one binding, kept in a tier (module docstring)."""

    def __init__(self, window: int = DEFAULT_WINDOW):
        _STORES.add(self)
        _watch_eager_optimizer_steps()
        self.states: dict[tuple, State] = {}
        self.released: dict[int, tuple[Any, int, list[State]]] = {}  # storage id: storage, bytes, its states
        self.bytes_offloaded = 0  # released by the last prepare
        self.bytes_total = 0  # optimizer state bytes the last graph read (set by the runtime)
        self.param_bytes_total = 0  # parameter shard bytes the last graph read (set by the runtime)
        self.window = window  # bytes of states read ahead of their reload, and of write-backs in flight
        self._slots: dict[int, State] = {}
        self._written: set[int] = set()
        self._order: list[int] = []  # offloaded slots not read ahead yet, in the graph's order
        self._ahead: list[tuple[int, Any]] = []  # (slot, its read in flight), in the graph's order
        self._writes: list[tuple[int, Any]] = []  # (bytes, write) in flight

    # ---------------------------------------------------------------------------------- what a tier provides
    def _make(self, fresh: list[tuple[tuple, int]]) -> list[Any]:
        """The blocks of new inputs (``(key, bytes)``), made together: raise ``OffloadError`` making none."""
        raise NotImplementedError

    def _store(self, state: State, tensor: Tensor) -> None:
        """Copy ``tensor`` into the state's current block, now."""
        raise NotImplementedError

    def _load(self, state: State, into: Tensor) -> None:
        """Copy the state's current block into ``into``, now."""
        raise NotImplementedError

    def _read_async(self, state: State, like: Tensor) -> Any:
        """Start reading the state into a new tensor like ``like``; ``result()`` gives it."""
        raise NotImplementedError

    def _write_async(self, state: State, value: Tensor) -> Any:
        """Start writing the new value of the state (to its next copy where the tier keeps two)."""
        raise NotImplementedError

    def _committed(self, state: State) -> None:
        """The state's write of this graph is finished and what the next graph reads."""

    # ------------------------------------------------------------------------------------------- set-up
    def watch(self, optimizers: list, modules: list) -> None:
        """Make reads of the offloaded state outside the graph see it resident (``watch``)."""
        watch(self, optimizers, modules)

    def reserve(self, sizes: dict[tuple, int]) -> None:
        """Make the blocks of the inputs (``sizes``: state key to bytes) not offloaded yet: the runtime calls it
        when the step is set up, so a tier too small is reported before anything runs."""
        fresh = [(key, nbytes) for key, nbytes in dict(sizes).items() if key not in self.states]
        for (key, nbytes), block in zip(fresh, self._make(fresh)):
            self.states[key] = State(key, nbytes, block)

    def offload_now(self, key: tuple, tensor: Tensor) -> None:
        """Move ``tensor``, the state ``key`` names, to the tier now and release its storage (it must be the
        storage's only tensor): a first optimizer step's states, created one parameter at a time, so that they are
        never all in memory at once. A graph that reads it directly gets its memory back in ``prepare``."""
        storage = tensor.untyped_storage()
        nbytes = tensor.numel() * tensor.element_size()
        self.reserve({key: nbytes})
        state = self.states[key]
        state.tensor = tensor
        self._store(state, tensor.contiguous())
        if storage.nbytes() == nbytes and storage.resizable():
            storage.resize_(0)
            self.released[storage._cdata] = (storage, nbytes, [state])

    def forget(self, tensors: list[Tensor]) -> None:
        """Drop what the tier holds of ``tensors`` (state removed again, e.g. a guessed first step's)."""
        ids = {id(t) for t in tensors}
        for cdata, (_, _, states) in list(self.released.items()):
            if any(id(s.tensor) in ids for s in states):
                del self.released[cdata]
        for key in [k for k, s in self.states.items() if id(s.tensor) in ids]:
            del self.states[key]

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
        kept = {local(t).untyped_storage()._cdata for t in keep if isinstance(t, Tensor)}
        self._restore(only=kept)  # read directly by this graph (no reload node): needed in memory
        for state in self._slots.values():
            if state.tensor.untyped_storage().nbytes():  # in memory: its current copy is written from it
                self._store(state, state.tensor.contiguous())
        self._release_covered(kept)
        self._ahead = []
        self._read_ahead()

    def read(self, slot: int, like: Tensor) -> Tensor:
        """The value of input ``slot``: read ahead (waited for here), or now."""
        found = next((i for i, (s, _) in enumerate(self._ahead) if s == slot), None)
        if found is None:
            if slot in self._order:
                self._order.remove(slot)
            out = self._read_async(self._slots[slot], like).result()
        else:
            out = self._ahead.pop(found)[1].result()
        self._read_ahead()
        return out

    def write(self, slot: int, value: Tensor) -> None:
        """Start writing ``value``, the input's new value, within the window of writes in flight."""
        state = self._slots[slot]
        while self._writes and sum(n for n, _ in self._writes) + state.nbytes > self.window:
            self._writes.pop(0)[1].result()
        self._writes.append((state.nbytes, self._write_async(state, value)))
        self._written.add(slot)

    def commit(self) -> None:
        """The graph ran: once every write-back is finished, the new values become current (and a storage that
        could not be released takes the new value too)."""
        self._drain(raise_error=True)
        released = {id(state) for _, _, states in self.released.values() for state in states}
        for slot in self._written:
            state = self._slots[slot]
            self._committed(state)
            if id(state) not in released and state.tensor.untyped_storage().nbytes():
                with torch.no_grad():
                    self._load(state, state.tensor)
        self._written.clear()

    def abort(self) -> None:
        """The graph failed: what is in flight is finished; the tier's current copies stay current."""
        self._drain(raise_error=False)
        self._written.clear()

    def _read_ahead(self) -> None:
        """Start reading the next reloads in the graph's order while their bytes fit the window (one at least;
        a slot already being read waits for its reload)."""
        while self._order and self._order[0] not in (s for s, _ in self._ahead):
            ahead = sum(self._slots[s].nbytes for s, _ in self._ahead)
            if self._ahead and ahead + self._slots[self._order[0]].nbytes > self.window:
                return
            slot = self._order.pop(0)
            state = self._slots[slot]
            self._ahead.append((slot, self._read_async(state, state.tensor)))

    def _drain(self, raise_error: bool) -> None:
        for pending in [p for _, p in self._ahead] + [p for _, p in self._writes]:
            error = pending.exception()
            if error is not None and raise_error:
                self._ahead.clear()
                self._writes.clear()
                raise error
        self._ahead.clear()
        self._writes.clear()

    # ---------------------------------------------------------------------------------- released storages
    def released_bytes(self, kind: str) -> int:
        """Bytes of released storages that hold inputs of ``kind`` (``"opt_state"`` or ``"param"``)."""
        return sum(nbytes for _, nbytes, states in self.released.values() if states[0].key[0] == kind)

    def materialize(self) -> None:
        """Read every released state back into its storage."""
        self._restore()

    def _release_covered(self, kept: set[int]) -> None:
        """Release every storage the offloaded inputs cover entirely, unless ``kept`` (ids) names it."""
        by_storage: dict[int, tuple[Any, list[State]]] = {}
        for state in self._slots.values():
            storage = state.tensor.untyped_storage()
            by_storage.setdefault(storage._cdata, (storage, []))[1].append(state)
        self.bytes_offloaded = sum(nbytes for _, nbytes, _ in self.released.values())
        for cdata, (storage, states) in by_storage.items():
            nbytes = storage.nbytes()
            distinct = len({s.tensor.data_ptr() for s in states}) == len(states)
            covered = sum(s.nbytes for s in states) == nbytes and distinct
            if nbytes and covered and cdata not in kept and storage.resizable():
                storage.resize_(0)
                self.released[cdata] = (storage, nbytes, states)
                self.bytes_offloaded += nbytes

    def _restore(self, only: set[int] | None = None) -> None:
        """Give every released storage (of ids ``only``, if given) its bytes back, read from the tier."""
        restore(self.released, self._load, only)


def watch(holder: Any, optimizers: list, modules: list) -> None:
    """Call ``holder.materialize()`` before every read of the state it holds outside the graph:
    ``optimizer.state_dict()``, ``load_state_dict()`` and an eager ``step()``; ``state_dict()`` and
    ``load_state_dict()`` of every module of ``modules`` (the bound models) and of their submodules; and
    ``materialize`` of any of them (``zgraph.gather``, ``full_state_dict``, ``save``, ``load``)."""
    for opt in optimizers:
        if _own(holder, opt):
            opt.register_state_dict_pre_hook(materialize)
            opt.register_load_state_dict_pre_hook(lambda o, _sd: materialize(o))
            opt.register_step_pre_hook(lambda o, _a, _k: materialize(o))
    for module in {id(m): m for root in modules for m in root.modules()}.values():
        if _own(holder, module):
            module.register_state_dict_pre_hook(lambda m, *_: materialize(m))
            module.register_load_state_dict_pre_hook(lambda m, *_: materialize(m))


def _own(holder: Any, owner: Any) -> bool:
    """Record ``holder`` as holding state of ``owner``; True the first time any holder does (hook it)."""
    if owner in _OWNER_STORES:
        _OWNER_STORES[owner].add(holder)
        return False
    _OWNER_STORES[owner] = weakref.WeakSet([holder])
    return True


def restore(released: dict[int, tuple[Any, int, list[State]]], load: Any, only: set[int] | None = None) -> None:
    """Give every storage of ``released`` (of ids ``only``, if given) its bytes back, each of its states read by
    ``load(state, tensor)``; a function of its own, for stores' finalizers (which must not hold the store)."""
    for cdata in [c for c in released if only is None or c in only]:
        storage, nbytes, states = released[cdata]
        storage.resize_(nbytes)
        for state in states:
            load(state, state.tensor)
        del released[cdata]


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
    it) over parameters whose shards are offloaded: read every store's inputs back first. The parameters it will
    update are the shards that replaced those it may still hold (``current_parameter``): torch runs global hooks
    in the order they were registered, and the hook that points the optimizer at them
    (``zgraph.runtime.sharded_state``) runs after this one where a store existed before any stage-3 binding."""
    params = (current_parameter(p) for group in optimizer.param_groups for p in group["params"])
    locals_ = (getattr(p, "_local_tensor", None) for p in params)
    if _STORES and any(type(t) is Tensor and t.numel() and not t.untyped_storage().nbytes() for t in locals_):
        for store in list(_STORES):
            store.materialize()
