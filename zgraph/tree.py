"""Walk and rebuild the nested arguments of a training step.

Containers we look into: tuples (named tuples too), lists, dicts, dataclass instances and
``types.SimpleNamespace``. Everything else (tensors, modules, optimizers, numbers, strings, other objects) is a
leaf. Paths are readable (``batch.x``, ``args[0]['ids']``) because they name graph inputs.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator
from typing import Any


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def children(obj: object) -> list[tuple[str, Any]] | None:
    """``[(path suffix, child)]`` of a container, or None for a leaf."""
    if _is_namedtuple(obj):
        return [(f".{name}", getattr(obj, name)) for name in obj._fields]
    if isinstance(obj, (tuple, list)):
        return [(f"[{i}]", item) for i, item in enumerate(obj)]
    if isinstance(obj, dict):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if _is_dataclass_instance(obj):
        return [(f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, types.SimpleNamespace):
        return [(f".{name}", value) for name, value in vars(obj).items()]
    return None


def iter_leaves(obj: object, path: str = "") -> Iterator[tuple[str, Any]]:
    """Depth-first ``(path, leaf)`` pairs of a nested structure."""
    kids = children(obj)
    if kids is None:
        yield path, obj
        return
    for suffix, child in kids:
        yield from iter_leaves(child, path + suffix)


def map_leaves(obj: object, fn: Callable[[str, Any], Any], path: str = "") -> Any:
    """Rebuild ``obj`` with every leaf replaced by ``fn(path, leaf)``. Containers are copied, never mutated."""
    kids = children(obj)
    if kids is None:
        return fn(path, obj)
    values = [map_leaves(child, fn, path + suffix) for suffix, child in kids]
    if _is_namedtuple(obj):
        return type(obj)(*values)
    if isinstance(obj, tuple):
        return tuple(values)
    if isinstance(obj, list):
        return values
    if isinstance(obj, dict):
        return type(obj)(zip(obj.keys(), values)) if type(obj) is not dict else dict(zip(obj.keys(), values))
    if _is_dataclass_instance(obj):
        clone = object.__new__(type(obj))
        clone.__dict__.update(obj.__dict__)
        for f, value in zip(dataclasses.fields(obj), values):
            object.__setattr__(clone, f.name, value)
        return clone
    return types.SimpleNamespace(**dict(zip(vars(obj).keys(), values)))


def structure_key(obj: object) -> tuple:
    """A hashable description of the container structure (types and keys), without the leaves."""
    kids = children(obj)
    if kids is None:
        return ()
    return (type(obj), tuple((suffix, structure_key(child)) for suffix, child in kids))
