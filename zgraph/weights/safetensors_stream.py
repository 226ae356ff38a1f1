"""The safetensors file format written one tensor at a time: the header is computed up front from every tensor's
name, dtype and shape, then each tensor's bytes are appended as they arrive, so that a file is written without
holding all its tensors in memory (``safetensors.torch.save_file`` needs them all at once).

The layout is safetensors' own, byte for byte: an 8-byte little-endian header length, the JSON header (compact,
``__metadata__`` first, then the tensors in file order with their ``data_offsets``) padded with spaces to a
multiple of 8 bytes, then the tensors' bytes (row-major, little-endian), ordered as safetensors orders them
(wider dtypes first, then by name), which keeps every tensor aligned to its element size.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from dataclasses import dataclass
from types import TracebackType
from typing import BinaryIO

import torch
from torch import Tensor

# safetensors' dtype names, in the order of its ``Dtype`` enum (a file holds the larger ones first)
DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}
_RANK = {dtype: i for i, dtype in enumerate(DTYPES)}


@dataclass(frozen=True)
class Entry:
    """One tensor of a file, known before its bytes are: name, dtype and (whole) shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


def check_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in DTYPES:
        raise TypeError(f"{name}: safetensors cannot store dtype {dtype} (it stores {', '.join(map(str, DTYPES))})")


def file_order(entries: list[Entry]) -> list[Entry]:
    """``entries`` in the order safetensors lays them out in a file: larger dtypes first, then by name."""
    return sorted(entries, key=lambda e: (-_RANK[e.dtype], e.name))


def header(entries: list[Entry], metadata: dict[str, str] | None) -> bytes:
    """The bytes before the first tensor's data: length, JSON header, space padding (``entries`` in file order)."""
    body: dict[str, object] = {}
    if metadata:
        body["__metadata__"] = metadata
    offset = 0
    for e in entries:
        body[e.name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_tensor(file: BinaryIO, t: Tensor) -> None:
    """Append the bytes of a host tensor to ``file``: row-major, little-endian, with no copy of a contiguous
    tensor on a little-endian host."""
    t = t.detach().cpu().contiguous()
    if sys.byteorder == "big" and t.element_size() > 1:
        t = t.view(torch.uint8).view(-1, t.element_size()).flip(1).contiguous()
    n = t.numel() * t.element_size()
    if n:
        file.write(memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())))  # t stays alive meanwhile


class StreamWriter:
    """Writes one safetensors file: ``entries`` (in any order; laid out in ``file_order``) announced up front,
    then ``write(name, tensor)`` for each in ``order`` (checked against the header). The file is written under a
    temporary name in the same directory and renamed into place by ``close()`` once every tensor is in; leaving
    the block by an exception removes it.
    """

    def __init__(self, path: str, entries: list[Entry], metadata: dict[str, str] | None = None):
        for e in entries:
            check_dtype(e.name, e.dtype)
        self.path = path
        self.order = file_order(entries)
        self._next = 0
        self._temp = f"{path}.tmp-{os.getpid()}"
        self._file = open(self._temp, "wb")
        self._file.write(header(self.order, metadata))

    def write(self, name: str, tensor: Tensor) -> None:
        expected = self.order[self._next]
        got = (name, tensor.dtype, tuple(tensor.shape))
        if got != (expected.name, expected.dtype, expected.shape):
            raise ValueError(f"{self.path}: expected {expected} next, got {got}")
        write_tensor(self._file, tensor)
        self._next += 1

    def close(self) -> None:
        """Put the complete file in place; if it is not complete (or cannot be written), remove it and raise."""
        try:
            if self._next != len(self.order):
                raise ValueError(f"{self.path}: {len(self.order) - self._next} tensors were never written")
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._temp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        self._file.close()
        if os.path.exists(self._temp):
            os.remove(self._temp)

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
