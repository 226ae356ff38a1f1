"""Find where the tensors a step reads *outside* its arguments' containers and its modules' parameter and buffer
slots live, so they can be read on every call instead of being frozen into the graph.

A step may read a tensor from a global of its module (``log_alpha``), a closure variable, a plain tensor
attribute of a module (``self.scale = torch.ones(1, requires_grad=True)``) or an attribute of an object among
its arguments (``trainer.class_weights``). The tracer meets such a tensor as a constant. ``locate`` searches
those places for it and returns a ``Locator``: a path from a root (an argument, a global, a closure cell, a
module) through attributes and items. ``Locator.resolve`` turns it, on each call, into the ``Slot`` that holds
the tensor now; capture swaps a traced stand-in into the slot while it traces and puts the tensor back after.

Only settable places are returned (an attribute of an object, an item of a dict or list, a global, a cell): a
tensor inside a tuple is not locatable, and stays a constant (or, if it requires grad, is an error).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from torch import Tensor, nn

from zgraph.tree import Slot

_MAX_DEPTH = 3
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType, Tensor)


@dataclass(frozen=True)
class Locator:
    """Where a tensor lives, as a path: ``root`` is ``("arg", name)``, ``("global", name)``, ``("cell",
    index)`` or ``("object", obj)`` (a module, held by reference); ``steps`` are ``("attr", name)`` /
    ``("item", key)``. ``path`` is the readable name graph inputs get."""

    root: tuple
    steps: tuple[tuple[str, object], ...]
    path: str

    def resolve(self, fn: Callable, arguments: dict[str, object]) -> Slot | None:
        """The slot this path reaches in this call, or None if it no longer exists."""
        kind, key = self.root
        code_fn = _code_function(fn)
        if kind == "arg":
            owner, slot = arguments, Slot(arguments, "item", key)
        elif kind == "global":
            globals_ = getattr(code_fn, "__globals__", {})
            owner, slot = globals_, Slot(globals_, "item", key)
        elif kind == "cell":
            cells = getattr(code_fn, "__closure__", None) or ()
            if key >= len(cells):
                return None
            owner, slot = cells[key], Slot(cells[key], "cell", None)
        else:
            owner, slot = key, None
        for step_kind, step_key in self.steps:
            try:
                owner = slot.get() if slot is not None else owner
            except (AttributeError, KeyError, IndexError, ValueError):
                return None
            slot = Slot(owner, step_kind, step_key)
        try:
            slot.get()
        except (AttributeError, KeyError, IndexError, ValueError):
            return None
        return slot


def _code_function(fn: Callable) -> Callable:
    """The plain function behind ``fn`` (a ``functools.partial``, a bound method)."""
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__
        else:
            return fn


def _walk(obj: object, steps: tuple, path: str, depth: int, seen: set[int]) -> Iterator[tuple[Tensor, tuple, str]]:
    """``(tensor, steps, path)`` of every tensor reachable from ``obj`` through settable places: items of
    dicts and lists, attributes of plain objects and plain (non-parameter, non-buffer) attributes of modules."""
    if id(obj) in seen or depth > _MAX_DEPTH or isinstance(obj, _OPAQUE) or _is_library_object(obj):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = [(("item", k), f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, list):
        items = [(("item", i), f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif isinstance(obj, nn.Module):
        items = [(("attr", k), f"{path}.{k}", v) for k, v in vars(obj).items() if not k.startswith("_")]
    elif isinstance(getattr(obj, "__dict__", None), dict):
        items = [(("attr", k), f"{path}.{k}", v) for k, v in vars(obj).items()]
    else:
        return
    for step, child_path, value in items:
        if isinstance(value, Tensor):
            yield value, (*steps, step), child_path
        elif not isinstance(value, nn.Module):  # modules are searched from their own roots
            yield from _walk(value, (*steps, step), child_path, depth + 1, seen)


def _is_library_object(obj: object) -> bool:
    """Objects of torch itself other than modules (optimizers, schedulers, data loaders...): their tensors are
    not the step's."""
    return not isinstance(obj, nn.Module) and type(obj).__module__.split(".")[0] == "torch"


def locate(
    wanted: Callable[[Tensor], bool], fn: Callable, arguments: dict[str, object], modules: list[tuple[str, nn.Module]]
) -> dict[int, Locator]:
    """``{id(tensor): Locator}`` for the tensors ``wanted`` accepts, searched among the step's arguments (inside
    objects that are leaves of its containers), the globals its code names, its closure, and the plain
    attributes of its modules and their submodules. The first place found wins."""
    roots: list[tuple[tuple, object, str]] = [(("arg", name), value, name) for name, value in arguments.items()]
    code_fn = _code_function(fn)
    code = getattr(code_fn, "__code__", None)
    if code is not None:
        fn_globals = getattr(code_fn, "__globals__", {})
        roots += [(("global", n), fn_globals[n], n) for n in code.co_names if n in fn_globals]
        cells = getattr(code_fn, "__closure__", None) or ()
        for index, (name, cell) in enumerate(zip(code.co_freevars, cells)):
            try:
                roots.append((("cell", index), cell.cell_contents, name))
            except ValueError:  # an empty cell
                continue
    for label, root in modules:
        for name, module in root.named_modules():
            roots.append((("object", module), module, f"{label}.{name}" if name else label))
    found: dict[int, Locator] = {}
    seen: set[int] = set()
    for root, value, path in roots:
        hits: Iterable[tuple[Tensor, tuple, str]]
        if isinstance(value, Tensor):
            hits = [(value, (), path)] if root[0] != "arg" else []  # argument tensors are inputs already
        elif isinstance(value, nn.Module) and root[0] != "object":
            hits = []  # a module is searched from its own root
        else:
            hits = _walk(value, (), path, 1, seen)
        for tensor, steps, child_path in hits:
            if id(tensor) not in found and wanted(tensor):
                found[id(tensor)] = Locator(root, steps, child_path)
    return found
