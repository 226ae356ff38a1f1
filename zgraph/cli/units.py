"""Bytes as ``zgraph estimate`` reads and prints them, and its error for bad input."""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20}
_UNITS.update({"GIB": 2**30, "TIB": 2**40})


class EstimateInputError(ValueError):
    """Bad command-line input: printed as one line, exit status 1."""


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``1.5TiB``, ``1000000`` → bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise EstimateInputError(f"cannot read the budget {text!r}: write a number of bytes like 80GiB or 40GB")
    return int(float(match.group(1)) * _UNITS[unit])


def gib(n: float) -> str:
    """Bytes, readably: GiB from 1 GiB up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
