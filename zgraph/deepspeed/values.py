"""Strict readers for DeepSpeed JSON values: each names the key and the type it expects.

DeepSpeed's pydantic models coerce (``"false"`` to False, ``2.9`` to 2 in some versions, ``true`` to 1); zgraph
does not: a value of the wrong type raises ``ValueError`` naming the key, so a config never means something other
than what it says. Hugging Face's ``"auto"`` is handled by the callers, where it is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def is_auto(value: Any) -> bool:
    """Hugging Face's placeholder: the Trainer fills it from its own arguments; zgraph keeps its default."""
    return isinstance(value, str) and value == "auto"


def fail(key: str, expected: str, value: Any) -> ValueError:
    """The error for ``key``'s ``value``, which is not ``expected`` (raise it: ``raise fail(...)``)."""
    return ValueError(f"DeepSpeed config {key}: expected {expected}, got {value!r} ({type(value).__name__})")


def section(key: str, value: Any) -> dict[str, Any]:
    """A JSON object (``None`` or absent: empty)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise fail(key, "a JSON object", value)
    return dict(value)


def boolean(key: str, value: Any) -> bool:
    """``true`` or ``false`` only: no strings, no numbers."""
    if not isinstance(value, bool):
        raise fail(key, "true or false", value)
    return value


def number(key: str, value: Any, *, minimum: float | None = None, positive: bool = False) -> float:
    """A finite JSON number (not a bool, not a string, not inf/NaN) at least ``minimum`` (above 0 if ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(key, "a number", value)
    if not math.isfinite(value):
        raise fail(key, "a finite number", value)
    if positive and not value > 0:
        raise fail(key, "a number above 0", value)
    if minimum is not None and value < minimum:
        raise fail(key, f"a number of at least {minimum:g}", value)
    return float(value)


def integer(key: str, value: Any, *, minimum: int | None = 0) -> int:
    """A whole JSON number (``5e8`` is fine: it is whole; ``2.9``, ``true`` and ``"3"`` are not), at least
    ``minimum`` (default 0: sizes and counts are never negative)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(key, "an integer", value)
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise fail(key, "an integer", value)
    value = int(value)
    if minimum is not None and value < minimum:
        raise fail(key, f"an integer of at least {minimum}", value)
    return value


def choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of the given strings."""
    if not isinstance(value, str) or value not in choices:
        raise fail(key, "one of " + ", ".join(repr(c) for c in choices), value)
    return value


def dtype(key: str, value: Any) -> torch.dtype:
    """A dtype name as DeepSpeed spells them (``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"``, ``"fp32"``...)."""
    if not isinstance(value, str):
        raise fail(key, f"a dtype name, one of {sorted(_DTYPES)}", value)
    found = _DTYPES.get(value.lower().removeprefix("torch."))
    if found is None:
        raise ValueError(f"DeepSpeed config {key}: unknown dtype {value!r}; expected one of {sorted(_DTYPES)}")
    return found


def unknown(where: str, keys: set[str]) -> None:
    """Raise for keys DeepSpeed 0.19.8 does not have (it rejects them too: its config models forbid extras)."""
    if keys:
        raise ValueError(
            f"DeepSpeed config {where}: unknown key(s) {sorted(keys)} (DeepSpeed 0.19.8 has no such key). zgraph "
            "accounts for every key it reads; remove the key, or map it to a zgraph.Config field yourself"
        )
