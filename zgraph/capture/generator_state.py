"""While a step is traced, reading and setting a random generator's state are graph operations.

Why: ``torch.utils.checkpoint`` (reentrant or not) saves ``torch.get_rng_state()`` (and each accelerator's) before
a block's forward; when backward recomputes the block it sets that state back inside ``torch.random.fork_rng``,
which afterwards restores the state of that moment. So eager's recomputation draws the forward's dropout masks
and leaves the generator as if nothing were recomputed. Traced as plain Python calls, these reads and writes
happen once at trace time on the real generator and leave nothing in the graph: the recomputation then drew new
masks (gradients wrong, loss right) and advanced the generator twice.

Here ``torch.get_rng_state`` / ``torch.set_rng_state`` and ``torch.<accelerator>.get_rng_state`` /
``set_rng_state`` record ``zgraph::rng_state`` / ``zgraph::set_rng_state`` (``zgraph.ops``) instead, so the graph
saves, sets and restores the generator exactly where eager does, for the user's own calls as for checkpoint's.
Other generator calls (``manual_seed``, ``Generator`` objects) are left as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from zgraph.ops import RNG_STATE, SET_RNG_STATE

_ACCELERATORS = ("cuda", "xpu")  # device modules whose get_rng_state / set_rng_state checkpoint may call


def _device_name(device_type: str, device: Any) -> str:
    """``device`` as torch's device modules take it (an index, a name, a ``torch.device``) as one string."""
    if isinstance(device, int):
        return f"{device_type}:{device}"
    return str(torch.device(device))


def _cpu_get() -> Tensor:
    return RNG_STATE("cpu")


def _cpu_set(new_state: Tensor) -> None:
    SET_RNG_STATE(new_state, "cpu")


def _device_functions(device_type: str) -> dict[str, Any]:
    def get(device: Any = device_type) -> Tensor:
        return RNG_STATE(_device_name(device_type, device))

    def set_(new_state: Tensor, device: Any = device_type) -> None:
        SET_RNG_STATE(new_state, _device_name(device_type, device))

    return {"get_rng_state": get, "set_rng_state": set_}


def _replacements() -> list[tuple[Any, str, Any]]:
    cpu = {"get_rng_state": _cpu_get, "set_rng_state": _cpu_set}
    found = [(module, name, fn) for module in (torch, torch.random) for name, fn in cpu.items()]
    for device_type in _ACCELERATORS:
        module = getattr(torch, device_type, None)
        if module is not None and hasattr(module, "get_rng_state"):
            found += [(module, name, fn) for name, fn in _device_functions(device_type).items()]
    return found


@contextlib.contextmanager
def generator_state_ops() -> Iterator[None]:
    """Inside the block, generator state reads and writes record graph operations (see module doc)."""
    replacements = _replacements()
    saved = [(module, name, getattr(module, name)) for module, name, _ in replacements]
    try:
        for module, name, fn in replacements:
            setattr(module, name, fn)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
