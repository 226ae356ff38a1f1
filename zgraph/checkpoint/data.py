"""Non-tensor checkpoint state stored as data: JSON trees whose tensors are stored beside them as DCP tensors.

What can be stored (anything else is refused by ``save``, naming where it is and its type):

- ``None``, ``bool``, ``int``, ``float`` (``inf``, ``-inf`` and ``nan`` included, encoded explicitly), ``str``
  (subclasses such as ``IntEnum`` members are stored as the base type);
- ``list`` and ``tuple`` (each restored as itself), ``dict`` with ``str`` keys;
- ``torch.Tensor`` (dense, strided, not a ``DTensor``): stored as a DCP tensor under ``<prefix>.<n>`` and
  referenced from the tree; restored on the CPU, detached.

A tree is JSON: plain values as themselves, a list as a list, a dict as an object. A few one-key objects are
tags: ``{"__z_tuple": [...]}``, ``{"__z_float": "inf" | "-inf" | "nan"}``, ``{"__z_tensor": "<key>"}``, and
``{"__z_dict": {...}}`` for a dict whose own keys start with ``__z_`` (so that it is not read as a tag).
Reading a tree creates only these types: no class is looked up, nothing is called.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from zgraph.errors import CheckpointError
from zgraph.ops import host_read

TUPLE = "__z_tuple"
FLOAT = "__z_float"
TENSOR = "__z_tensor"
DICT = "__z_dict"
_TAG_PREFIX = "__z_"
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
STORABLE = "None, bool, int, float, str, list, tuple, dict with str keys, torch.Tensor"


class Encoder:
    """Encodes values into JSON trees; their tensors go into ``tensors`` under ``<prefix>.<n>``."""

    def __init__(self, prefix: str, tensors: dict[str, Tensor]):
        self.prefix = prefix
        self.tensors = tensors
        self._count = 0

    def encode(self, value: Any, where: str) -> Any:
        """The tree of ``value``; ``where`` names it in errors (``extra['step']``)."""
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            value = float(value)
            if math.isfinite(value):
                return value
            return {FLOAT: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(value, str):
            return str(value)
        if isinstance(value, Tensor):
            return {TENSOR: self._tensor(value, where)}
        if isinstance(value, (list, tuple)):
            items = [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return {TUPLE: items} if isinstance(value, tuple) else items
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    raise CheckpointError(
                        f"cannot save {where}: it has a key {key!r} of type {type(key).__name__}; checkpoints store "
                        f"dicts with str keys only (storable types: {STORABLE})"
                    )
                out[str(key)] = self.encode(item, f"{where}[{key!r}]")
            return {DICT: out} if any(k.startswith(_TAG_PREFIX) for k in out) else out
        raise CheckpointError(
            f"cannot save {where}: a value of type {type(value).__module__}.{type(value).__qualname__} cannot be "
            f"stored as data (storable types: {STORABLE})"
        )

    def _tensor(self, value: Tensor, where: str) -> str:
        if isinstance(value, DTensor) or type(value) not in (Tensor, torch.nn.Parameter):
            raise CheckpointError(f"cannot save {where}: a {type(value).__name__} (only plain tensors) in a value")
        if value.layout != torch.strided or value.is_quantized or value.is_nested or value.device.type == "meta":
            raise CheckpointError(f"cannot save {where}: a {value.layout} / {value.device} tensor (dense only)")
        key = f"{self.prefix}.{self._count}"
        self._count += 1
        with host_read("checkpoint: a tensor in a value copied to the host"):  # e.g. the loss scale, on the device
            self.tensors[key] = value.detach().cpu().contiguous()
        return key


def tensor_refs(tree: Any) -> list[str]:
    """The tensor keys ``tree`` references (tags are checked by ``decode``)."""
    out: list[str] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if len(node) == 1 and TENSOR in node:
                if not isinstance(node[TENSOR], str):
                    raise CheckpointError(f"malformed tensor reference {node!r}")
                out.append(node[TENSOR])
            else:
                stack.extend(node.values())
    return out


def decode(tree: Any, tensors: dict[str, Tensor]) -> Any:
    """The value a tree encodes; its tensors are looked up in ``tensors``. Raises ``CheckpointError`` on a tree
    ``Encoder`` cannot have written."""
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        raise CheckpointError(f"malformed value in the checkpoint: {type(tree).__name__}")
    if len(tree) == 1:
        ((key, inner),) = tree.items()
        if key == TUPLE and isinstance(inner, list):
            return tuple(decode(v, tensors) for v in inner)
        if key == FLOAT and inner in _NON_FINITE:
            return _NON_FINITE[inner]
        if key == TENSOR and isinstance(inner, str):
            if inner not in tensors:
                raise CheckpointError(f"the checkpoint references a tensor {inner!r} it does not hold")
            return tensors[inner]
        if key == DICT and isinstance(inner, dict):
            return {k: decode(v, tensors) for k, v in inner.items()}
    if any(k.startswith(_TAG_PREFIX) for k in tree):
        raise CheckpointError(f"malformed value in the checkpoint: unknown tag among {sorted(tree)[:4]}")
    return {k: decode(v, tensors) for k, v in tree.items()}


# ------------------------------------------------------------------------------------------------ RNG states
def rng_state() -> dict[str, Any]:
    """This process's RNG states as storable data: torch's CPU (and CUDA, when initialised) states as tensors,
    Python's ``random`` state, and NumPy's when NumPy is imported (its key array as a list of ints)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {
            "name": str(name),
            "keys": [int(k) for k in keys.tolist()],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return state


def rng_restorer(state: Any) -> Callable[[], None]:
    """Check a decoded RNG state; returns the function that sets it (raises ``CheckpointError`` now, before
    anything is changed, if it cannot be set). NumPy's state is set only where NumPy is imported."""
    if not isinstance(state, dict) or not isinstance(state.get("torch"), Tensor):
        raise CheckpointError("malformed RNG state in the checkpoint")
    torch_state = state["torch"]
    if torch_state.dtype != torch.uint8 or torch_state.shape != torch.get_rng_state().shape:
        raise CheckpointError(f"malformed torch RNG state: {torch_state.dtype} {tuple(torch_state.shape)}")
    try:
        random.Random().setstate(state["python"])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"malformed Python RNG state in the checkpoint: {error}") from error
    cuda = state.get("cuda")
    if cuda is not None and not (isinstance(cuda, list) and all(isinstance(t, Tensor) for t in cuda)):
        raise CheckpointError("malformed CUDA RNG state in the checkpoint")
    numpy_state = state.get("numpy")
    numpy = sys.modules.get("numpy")
    numpy_args = None
    if numpy is not None and isinstance(numpy_state, dict):
        try:
            numpy_args = (
                numpy_state["name"],
                numpy.array(numpy_state["keys"], dtype=numpy.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
            numpy.random.RandomState().set_state(numpy_args)
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"malformed NumPy RNG state in the checkpoint: {error}") from error

    def restore() -> None:
        torch.set_rng_state(torch_state)
        random.setstate(state["python"])
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
        if numpy_args is not None:
            numpy.random.set_state(numpy_args)

    return restore
