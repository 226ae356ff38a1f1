"""Where ``load_pretrained`` reads: a Hugging Face safetensors file, a sharded safetensors index, or a DCP directory
(a plain ``torch.distributed.checkpoint.save`` of a state dict, or a ``zgraph.save`` checkpoint's model part).

Each source lists its tensors (name, shape, dtype) from headers and metadata alone, and reads the rows
``[start, stop)`` of dim 0 of the tensors asked for (or whole tensors), nothing else: safetensors through
``safe_open(...).get_slice(name)[start:stop]``, DCP through its own reader with a load plan of those rows, so it
reads only the chunks that overlap them. Nothing is unpickled: the index is JSON, safetensors headers are JSON,
DCP's metadata is read with zgraph's allow-list unpickler (``zgraph.checkpoint.io``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from zgraph.checkpoint import io as cio
from zgraph.checkpoint.read import dcp_errors, read_manifest, read_metadata
from zgraph.checkpoint.state import MODEL
from zgraph.errors import CheckpointError

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Entry:
    """A tensor the checkpoint holds: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Rows:
    """What to read of one tensor: rows ``[start, stop)`` of dim 0 (``None``: the whole tensor), into ``dtype``."""

    start: int | None
    stop: int | None
    dtype: torch.dtype

    def shape(self, entry: Entry) -> tuple[int, ...]:
        if self.start is None or self.stop is None:
            return entry.shape
        return (self.stop - self.start, *entry.shape[1:])


class Source:
    """A checkpoint's tensors by name (``entries``), read by ``read``; ``path`` is what the user gave."""

    path: str
    entries: dict[str, Entry]

    def read(self, wanted: dict[str, Rows], into: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """New host tensors: for each name, the rows asked for, in the dtype asked for; with ``into``, the values
        are copied into those tensors instead, one at a time (nothing staged), and ``{}`` is returned."""
        raise NotImplementedError

    def close(self) -> None:
        """Release open files."""


def open_source(path: str | os.PathLike) -> Source:
    """The checkpoint at ``path``: a ``.safetensors`` file, an index ``.json``, or a directory holding
    ``model.safetensors``, ``model.safetensors.index.json`` or DCP's ``.metadata`` (looked for in that order).

    Raises:
        CheckpointError: nothing zgraph reads is there, or its index, headers or metadata are malformed.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        for name, kind in ((SAFETENSORS, "file"), (INDEX, "index"), (cio.METADATA, "dcp")):
            if os.path.isfile(os.path.join(path, name)):
                return _open(os.path.join(path, name) if kind != "dcp" else path, kind)
        raise CheckpointError(
            f"{path} holds no checkpoint load_pretrained reads: no {SAFETENSORS}, {INDEX} or DCP {cio.METADATA}"
        )
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}")
    if path.endswith(".json"):
        return _open(path, "index")
    if path.endswith(".safetensors"):
        return _open(path, "file")
    raise CheckpointError(f"{path}: not a .safetensors file, a safetensors index (.json) or a DCP directory")


def _open(path: str, kind: str) -> Source:
    if kind == "dcp":
        return DcpSource(path)
    files = {os.path.basename(path): path} if kind == "file" else _index_files(path)
    return SafetensorsSource(path, files)


# ------------------------------------------------------------------------------------------------ safetensors
def _index_files(index: str) -> dict[str, str]:
    """``{file name: path}`` of the shards an index names, each a plain name beside the index, all present."""
    try:
        with open(index, encoding="utf-8") as f:
            body = json.loads(f.read(256 << 20))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{index}: not a safetensors index ({type(error).__name__}: {error})") from error
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: not a safetensors index (no weight_map of names to files)")
    root = os.path.dirname(index)
    files = {}
    for name in sorted(set(weight_map.values())):
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise CheckpointError(f"{index} names a file outside its directory: {name!r}")
        files[name] = os.path.join(root, name)
        if not os.path.isfile(files[name]):
            raise CheckpointError(f"{index} names {name}, which is missing")
    return files


class SafetensorsSource(Source):
    """One safetensors file or the shards of an index; every file's header read when opened."""

    def __init__(self, path: str, files: dict[str, str]):
        from safetensors import safe_open

        self.path = path
        self.entries = {}
        self._where: dict[str, str] = {}
        self._handles: dict[str, Any] = {}
        for name, file in files.items():
            try:
                self._handles[name] = safe_open(file, framework="pt")
                self._add_header(name, file)
            except CheckpointError:
                self.close()
                raise
            except Exception as error:  # safetensors' own errors: a damaged header
                self.close()
                raise CheckpointError(f"{file}: not a safetensors file ({type(error).__name__}: {error})") from error

    def _add_header(self, name: str, file: str) -> None:
        handle = self._handles[name]
        for key in handle.keys():
            piece = handle.get_slice(key)
            dtype = _DTYPES.get(piece.get_dtype())
            if dtype is None:
                raise CheckpointError(f"{file}: {key} has dtype {piece.get_dtype()}, which zgraph does not read")
            if key in self.entries:
                raise CheckpointError(f"{self.path}: {key} is in two files ({self._where[key]} and {name})")
            self.entries[key] = Entry(tuple(piece.get_shape()), dtype)
            self._where[key] = name

    def read(self, wanted: dict[str, Rows], into: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        out = {}
        for key, rows in wanted.items():
            file = self._where[key]
            try:
                handle = self._handles[file]
                if rows.start is None or rows.stop is None:
                    value = handle.get_tensor(key)
                else:
                    value = handle.get_slice(key)[rows.start : rows.stop]
            except Exception as error:
                raise CheckpointError(f"{file}: reading {key} failed ({type(error).__name__}: {error})") from error
            if into is not None:
                with torch.no_grad():
                    into[key].copy_(value)
            else:
                out[key] = value.to(rows.dtype)
        return out

    def close(self) -> None:
        self._handles.clear()  # safe_open's handles unmap their file when freed


# ------------------------------------------------------------------------------------------------ DCP
class DcpSource(Source):
    """A DCP directory: a ``zgraph.save`` checkpoint (its manifest verified; its model's tensors, ``model.``
    stripped) or a plain ``torch.distributed.checkpoint.save`` of a state dict (every tensor)."""

    def __init__(self, path: str):
        self.path = path
        if os.path.isfile(os.path.join(path, cio.MARKER)):
            manifest = read_manifest(path)
            self._metadata = read_metadata(path, manifest, verify=True)
            cio.verify(path, manifest["files"], {i.relative_path for i in self._metadata.storage_data.values()}, False)
            self._prefix = MODEL
        else:
            self._metadata = cio.load_metadata(os.path.join(path, cio.METADATA))
            self._prefix = ""
        self.entries = {
            key[len(self._prefix) :]: Entry(tuple(meta.size), meta.properties.dtype)
            for key, meta in self._metadata.state_dict_metadata.items()
            if key.startswith(self._prefix)
        }

    def read(self, wanted: dict[str, Rows], into: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        import torch.distributed.checkpoint as dcp

        out = into if into is not None else {}
        for key, rows in wanted.items():
            if key not in out:
                out[key] = torch.empty(rows.shape(self.entries[key]), dtype=rows.dtype)
        targets = {self._prefix + key: value for key, value in out.items() if value.numel()}  # no empty reads
        starts = {self._prefix + key: rows.start or 0 for key, rows in wanted.items()}
        if targets:
            with dcp_errors(f"reading {self.path}"):
                dcp.load(targets, storage_reader=cio.SafeReader(self.path), planner=_RowsPlanner(starts), no_dist=True)
        return {} if into is not None else out


class _RowsPlanner(DefaultLoadPlanner):
    """DCP's default planner asked for rows ``[start, start + len)`` of each target (its dim-0 offset in
    ``starts``): DCP reads only the saved chunks that overlap them."""

    def __init__(self, starts: dict[str, int]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.starts = starts

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, target in self.state_dict.items():
            offsets = [self.starts[fqn]] + [0] * (target.dim() - 1) if target.dim() else []
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=target.shape)
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        return self.state_dict[index.fqn]  # the rows' tensor (the read items' destination offsets are within it)
