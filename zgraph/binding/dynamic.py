"""Which dimensions of a step's tensor arguments are symbolic sizes: marked by the user (``zgraph.mark_dynamic``,
or ``torch._dynamo.mark_dynamic``) from the first call, or found automatically, as torch.compile's "automatic
dynamic shapes" does: when a call misses every compiled variant and the arguments of one of them differ from its
own only in the sizes of some dimensions of tensors (same rank, dtype, device, structure), those dimensions (and
dim 0, the batch, of the same tensors) become symbolic for the step, and the next capture traces them as symbols
(``zgraph.capture.inputs``). That variant then serves every size its size guards (``zgraph.capture.size_guards``)
accept. Dims whose sizes differ between ranks become symbolic in the same way, on every rank
(``DynamicDims.widen_across_ranks``, from each rank's ``argument_sizes``): ranks that pad their batches each to its
own longest row run one graph. Parameters, gradients and optimizer state keep static shapes: only argument tensors'
dims become symbolic.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from torch import Tensor

from zgraph.binding.arguments import StepCall
from zgraph.binding.guards import KEY_PARTS
from zgraph.errors import CaptureError
from zgraph.tree import iter_leaves

_MARK = "_zgraph_dynamic_dims"  # {dim: (min, max)} on a tensor zgraph.mark_dynamic marked
_ARGUMENTS = KEY_PARTS.index("an argument")
_BINDING = KEY_PARTS.index("the modules and optimizers")
_STRUCTURE = KEY_PARTS.index("the structure of the arguments")

Range = tuple[int | None, int | None]


def mark_dynamic(tensor: Tensor, dim: int, *, min: int | None = None, max: int | None = None) -> Tensor:  # noqa: A002
    """Make dimension ``dim`` of ``tensor`` symbolic in the step it is passed to (as an argument, at any nesting):
    the step is captured once with that size a symbol, and the graph serves every size in ``[min, max]`` (a size
    of 0 or 1 still gets a capture of its own, as in torch). A call whose size lies outside the range is refused
    before anything changes. The marking is remembered by the step: later tensors at the same argument path need
    not be marked. Returns ``tensor``."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"zgraph.mark_dynamic marks a tensor's dimension; got {type(tensor).__name__}")
    if not -tensor.dim() <= dim < tensor.dim():
        raise IndexError(f"zgraph.mark_dynamic: dim {dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
    for name, bound in (("min", min), ("max", max)):
        if bound is not None and (not isinstance(bound, int) or bound < 0):
            raise ValueError(f"zgraph.mark_dynamic: {name} must be a non-negative int, got {bound!r}")
    if min is not None and max is not None and min > max:
        raise ValueError(f"zgraph.mark_dynamic: min={min} is larger than max={max}")
    marks = dict(getattr(tensor, _MARK, {}))
    marks[dim % tensor.dim()] = (min, max)
    setattr(tensor, _MARK, marks)
    return tensor


def marked_ranges(t: Tensor) -> dict[int, Range]:
    """The dims marked dynamic on ``t``, with their ranges: zgraph's marks and ``torch._dynamo.mark_dynamic``'s."""
    marks: dict[int, Range] = {d: (None, None) for d in getattr(t, "_dynamo_dynamic_indices", ())}
    for r in getattr(t, "_dynamo_dynamic_range", ()):
        marks[r.dim] = (r.min, r.max)
    marks.update(getattr(t, _MARK, {}))
    return marks


class DynamicDims:
    """A step's symbolic argument dims (path -> dims) and the declared ranges of marked ones. ``mode``:
    ``Config.dynamic`` (None: automatic; True: every dim of every argument tensor; False: marked dims only, and
    those that differ between ranks)."""

    def __init__(self, mode: bool | None = None) -> None:
        self.mode = mode
        self.dims: dict[str, frozenset[int]] = {}
        self.ranges: dict[tuple[str, int], Range] = {}
        self.assumed: set[tuple[str, int]] = set()  # dims made symbolic by mode True alone (fixed without a word)

    def observe(self, call: StepCall) -> None:
        """Take this call's marks (with mode True, every dim of size 2 or more not yet symbolic), then check every
        declared range: a size outside one is refused (nothing has changed yet)."""
        tensors = argument_tensors(call)
        for path, t in tensors:
            for dim, bounds in marked_ranges(t).items():
                self.ranges[(path, dim)] = bounds
                self.add(path, [dim])
                self.assumed.discard((path, dim))
            if self.mode:
                new = [d for d, n in enumerate(t.shape) if n > 1 and d not in self.dims.get(path, ())]
                self.assumed.update((path, d) for d in new)
                self.add(path, new)
        for path, t in tensors:
            for dim in self.dims.get(path, ()):
                self._check(call, path, t, dim)

    def _check(self, call: StepCall, path: str, t: Tensor, dim: int) -> None:
        lo, hi = self.ranges.get((path, dim), (None, None))
        if dim >= t.dim():
            if (path, dim) in self.ranges:
                raise CaptureError(
                    f"argument `{path}` of step `{call.name}` was marked dynamic in dim {dim} "
                    f"(zgraph.mark_dynamic), but this call passes a tensor of shape {tuple(t.shape)}, which has no "
                    f"dim {dim}. Pass a tensor with the same number of dims as the marked one."
                )
            return
        size = t.shape[dim]
        if (lo is not None and size < lo) or (hi is not None and size > hi):
            raise CaptureError(
                f"argument `{path}` of step `{call.name}` has size {size} in dim {dim}, outside the range "
                f"[{'0' if lo is None else lo}, {'inf' if hi is None else hi}] declared with zgraph.mark_dynamic; "
                "nothing was run. Pad or split the batch to a size in that range, or mark the dim with a wider "
                "min / max."
            )

    def add(self, path: str, dims: Iterable[int]) -> None:
        self.dims[path] = self.dims.get(path, frozenset()) | frozenset(dims)

    def widen(self, key: tuple, cached: Iterable[tuple]) -> bool:
        """Automatic dynamic: the argument dims in which ``key`` (a call's guard key) differs from a cached
        variant's key, where that is all their arguments differ in, become symbolic, and with them dim 0 of the same
        tensors (the batch: a sequence that varies now is usually followed by a smaller last batch, which then needs
        no capture of its own; a dim 0 that is not a batch costs nothing, the guards keep what the graph needs).
        Whether any became symbolic (never with mode False)."""
        if self.mode is False:
            return False
        found: dict[str, set[int]] = {}
        for other in cached:
            dims = _size_changes(key, other)
            for path, changed in (dims or {}).items():
                found.setdefault(path, {0}).update(changed)
        new = {path: dims - self.dims.get(path, frozenset()) for path, dims in found.items()}
        for path, dims in new.items():
            self.add(path, dims)
        return any(new.values())

    def widen_across_ranks(self, sizes: Sequence[bytes]) -> bool:
        """Each rank's ``argument_sizes``, in rank order (the same on every rank): the dims in which ranks' argument
        tensors differ, where that is all they differ in (same paths, same number of dims), become symbolic, with
        dim 0 of the same tensors (as ``widen``); ranks that pad their batches each to its own longest row then run
        one graph. Whether any did differ (the same answer on every rank, whatever this rank had already made
        symbolic)."""
        ranks = [r for r in map(_read_sizes, sizes) if r is not None]
        layout = [[(path, len(shape)) for path, shape in r] for r in ranks]
        if not ranks or len(ranks) != len(sizes) or any(other != layout[0] for other in layout):
            return False
        found: dict[str, set[int]] = {}
        for i, (path, shape) in enumerate(ranks[0]):
            dims = {d for r in ranks for d, size in enumerate(r[i][1]) if size != shape[d]}
            if dims:
                found.setdefault(path, {0}).update(dims)
        for path, dims in found.items():
            self.add(path, dims)
        return bool(found)

    def of(self, paths: Sequence[str]) -> dict[str, dict[int, Range]]:
        """The symbolic dims of the tensors at ``paths`` (a call's user tensors), each with its declared range."""
        return {
            path: {d: self.ranges.get((path, d), (None, None)) for d in sorted(self.dims[path])}
            for path in paths
            if path in self.dims
        }


def _size_changes(key: tuple, other: tuple) -> dict[str, set[int]] | None:
    """``path -> dims`` whose sizes differ between two guard keys of the same state whose arguments have the same
    structure and differ in nothing but sizes; None otherwise (or when they do not differ). The keys' other parts
    may differ: a first optimizer step traced as written creates the state the next call's key has (the sizes
    that changed since are still the ones to make symbolic; a symbolic dim is never wrong, its guards hold)."""
    if len(key) != len(other) or key[_BINDING] != other[_BINDING] or key[_STRUCTURE] != other[_STRUCTURE]:
        return None
    leaves, others = key[_ARGUMENTS], other[_ARGUMENTS]
    if len(leaves) != len(others):
        return None
    changes: dict[str, set[int]] = {}
    for (path, a), (other_path, b) in zip(leaves, others):
        if path != other_path:
            return None
        if a == b:
            continue
        dims = _tensor_size_change(a, b)
        if not dims:
            return None
        changes[path] = dims
    return changes or None


def _tensor_size_change(a: object, b: object) -> set[int] | None:
    """The dims two tensor leaf keys (``zgraph.binding.guards._tensor_key``) differ in, when only sizes differ."""
    if not (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and a and isinstance(a[0], tuple)):
        return None
    if a[1:] != b[1:] or not isinstance(b[0], tuple) or len(a[0]) != len(b[0]):
        return None
    return {d for d, (x, y) in enumerate(zip(a[0], b[0])) if x != y}


def argument_tensors(call: StepCall) -> list[tuple[str, Tensor]]:
    """``(path, tensor)`` of the tensors among a call's arguments, at any nesting."""
    leaves = [(path, leaf) for name, v in call.arguments for path, leaf in iter_leaves(v, name)]
    return [(path, t) for path, t in leaves if isinstance(t, Tensor)]


def argument_sizes(tensors: Sequence[tuple[str, Tensor]]) -> bytes:
    """The sizes of a call's argument tensors (``(path, tensor)``: ``argument_tensors``, ``Bound.user_tensors``),
    as JSON, for the other ranks (``DynamicDims.widen_across_ranks``)."""
    return json.dumps([[path, list(t.shape)] for path, t in tensors]).encode()


def _read_sizes(raw: bytes) -> list[tuple[str, list[int]]] | None:
    """Another rank's ``argument_sizes``, checked to be what it sends; None if it is not."""
    try:
        rows = json.loads(raw)
    except ValueError:
        return None
    good = isinstance(rows, list) and all(
        isinstance(row, list) and len(row) == 2 and isinstance(row[0], str) and isinstance(row[1], list)
        and all(isinstance(n, int) for n in row[1])
        for row in rows
    )  # fmt: skip
    return [(path, shape) for path, shape in rows] if good else None
