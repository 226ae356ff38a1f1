"""Walk and rebuild the nested arguments of a training step.

Containers we look into: tuples (named tuples too), lists, dicts and other mappings (``collections.UserDict``,
Hugging Face's ``BatchEncoding``), dataclass instances, ``types.SimpleNamespace``, and *data objects*: instances
of plain Python classes whose attributes hold tensors and no modules or optimizers (a ``Batch(x, y)`` a collate
function returns). Everything else (tensors, modules, optimizers, numbers, strings, a trainer that holds a model)
is a leaf. Paths are readable (``batch.x``, ``args[0]['ids']``) because they name graph inputs.

Rebuilding never mutates the user's containers: it makes new ones of the same type. A ``Slot`` is one settable
place that holds a tensor (an attribute, an item, a closure cell): where capture swaps a traced stand-in in.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


_STATEFUL = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)


def is_data_object(obj: object) -> bool:
    """An instance of a plain Python class that only carries data: some attribute is a tensor, none is a
    module, optimizer or LR scheduler (those make it a trainer-like object, a leaf)."""
    if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType, torch.Tensor, *_STATEFUL)):
        return False
    attrs = getattr(obj, "__dict__", None)
    if type(attrs) is not dict or type(obj).__module__.split(".")[0] == "torch":
        return False
    values = attrs.values()
    return any(isinstance(v, torch.Tensor) for v in values) and not any(isinstance(v, _STATEFUL) for v in values)


def children(obj: object) -> list[tuple[str, Any]] | None:
    """``[(path suffix, child)]`` of a container, or None for a leaf."""
    if _is_namedtuple(obj):
        return [(f".{name}", getattr(obj, name)) for name in obj._fields]
    if isinstance(obj, (tuple, list)):
        return [(f"[{i}]", item) for i, item in enumerate(obj)]
    if isinstance(obj, Mapping):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if _is_dataclass_instance(obj):
        return [(f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, types.SimpleNamespace) or is_data_object(obj):
        return [(f".{name}", value) for name, value in vars(obj).items()]
    return None


def _rebuild_mapping(obj: Mapping, values: list) -> Mapping:
    items = dict(zip(obj.keys(), values))
    if type(obj) is dict:
        return items
    if isinstance(obj, (dict, collections.UserDict)):
        clone = copy.copy(obj)  # a new mapping of the same type (a defaultdict keeps its factory); the original
        for key, value in items.items():  # is untouched. Item by item, the same keys: Hugging Face's ModelOutput
            clone[key] = value  # (a dict and a dataclass) refuses update() and clear(), and sets its field here
        return clone
    try:
        return type(obj)(items)
    except TypeError:
        return items


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
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, values)
    if _is_dataclass_instance(obj):
        clone = object.__new__(type(obj))
        clone.__dict__.update(obj.__dict__)
        for f, value in zip(dataclasses.fields(obj), values):
            object.__setattr__(clone, f.name, value)
        return clone
    if isinstance(obj, types.SimpleNamespace):
        return types.SimpleNamespace(**dict(zip(vars(obj).keys(), values)))
    clone = object.__new__(type(obj))  # a data object: same class, same attributes, new values
    clone.__dict__.update(zip(vars(obj).keys(), values))
    return clone


def structure_key(obj: object) -> tuple:
    """A hashable description of the container structure (types and keys), without the leaves."""
    kids = children(obj)
    if kids is None:
        return ()
    return (type(obj), tuple((suffix, structure_key(child)) for suffix, child in kids))


@dataclass
class Slot:
    """A place that holds a tensor now: ``owner.key`` (``kind`` ``attr``), ``owner[key]`` (``item``), or a
    closure cell's contents (``cell``)."""

    owner: object
    kind: str
    key: str | int | None

    def get(self) -> object:
        if self.kind == "attr":
            return getattr(self.owner, self.key)
        if self.kind == "item":
            return self.owner[self.key]
        return self.owner.cell_contents

    def set(self, value: object) -> None:
        if self.kind == "attr":
            if isinstance(self.owner, torch.nn.Module):
                self.owner.__dict__[self.key] = value  # a plain attribute (not a parameter or buffer)
            else:
                object.__setattr__(self.owner, self.key, value)
        elif self.kind == "item":
            self.owner[self.key] = value
        else:
            self.owner.cell_contents = value
