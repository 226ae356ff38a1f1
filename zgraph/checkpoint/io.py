"""The on-disk side of zgraph checkpoints: the marker (a JSON manifest with every file's size and sha256), DCP
metadata read with an allow-list unpickler, the merge of the ranks' DCP metadata, checksums, and the temporary
directories of saves in progress.

Layout of a checkpoint directory::

    .zgraph_complete      the marker: {"manifest": {...}, "sha256": <of the manifest's canonical JSON>}
    .metadata             DCP's metadata of the whole checkpoint (merged by zgraph from every rank's)
    r<rank>/__0_*.distcp  the tensors rank ``rank`` wrote (its shards; whole tensors are written by rank 0)

It is a DCP directory: ``torch.distributed.checkpoint.load`` reads it (``FileSystemReader(path)``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import secrets
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType

from zgraph.errors import CheckpointError

MARKER = ".zgraph_complete"
METADATA = ".metadata"
STALE_AGE = 24 * 3600.0  # seconds after which another host's temporary directory counts as abandoned
_CHUNK = 16 << 20

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


# ------------------------------------------------------------------------------------------------ DCP metadata
class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's own metadata classes, ``torch.Size``, torch dtypes and layouts, paths; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


def load_metadata(file: str) -> Any:
    """DCP ``Metadata`` read from ``file`` with the allow-list unpickler, checked for shape."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as error:  # any unpickling failure: truncated, foreign classes, garbage
        raise CheckpointError(f"{file}: not DCP metadata zgraph can read ({type(error).__name__}: {error})") from error
    ok = isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
    ok = ok and isinstance(metadata.storage_data, dict)
    ok = ok and all(isinstance(v, TensorStorageMetadata) for v in metadata.state_dict_metadata.values())
    ok = ok and all(
        isinstance(k, MetadataIndex) and isinstance(v, _StorageInfo) and not v.transform_descriptors
        for k, v in metadata.storage_data.items()
    )
    if not ok:
        raise CheckpointError(f"{file}: not DCP metadata of tensors as zgraph writes it")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with the allow-list unpickler and refusing byte items (which
    DCP would ``torch.load`` with ``weights_only=False``) and stream transforms."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = load_metadata(os.path.join(os.fspath(self.path), METADATA))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"{self.path}: refusing to read a byte item ({item.dest_index.fqn})")
        return super().read_data(plan, planner)


def merge_metadata(parts: list[tuple[str, Any]]) -> Any:
    """One DCP ``Metadata`` from every rank's (``(subdirectory, metadata)``): each tensor's chunks, a chunk
    several ranks wrote (a replicated ``DTensor``) once; storage paths made relative to the checkpoint."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for subdir, metadata in parts:
        for fqn, meta in metadata.state_dict_metadata.items():
            merged = state.get(fqn)
            if merged is None:
                merged = state[fqn] = TensorStorageMetadata(meta.properties, meta.size, [])
            elif merged.size != meta.size or merged.properties.dtype != meta.properties.dtype:
                raise CheckpointError(f"ranks saved {fqn} with different shapes or dtypes")
            for chunk in meta.chunks:
                index = MetadataIndex(fqn, chunk.offsets)
                if index in storage:
                    continue
                info = metadata.storage_data[index]
                storage[index] = dataclasses.replace(info, relative_path=f"{subdir}/{info.relative_path}")
                merged.chunks.append(chunk)
    return Metadata(state_dict_metadata=state, storage_data=storage)


def write_metadata(path: str, metadata: Any) -> None:
    with open(os.path.join(path, METADATA), "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())


def files_read(metadata: Any, state_dict: dict[str, Any]) -> set[str]:
    """The files DCP reads to load ``state_dict`` (its local chunks) from a checkpoint with ``metadata``."""
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    plan = create_default_local_load_plan(state_dict, metadata, strict=False)
    return {metadata.storage_data[item.storage_index].relative_path for item in plan.items}


# ------------------------------------------------------------------------------------------------ checksums
def digest(file: str) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of a file."""
    h = hashlib.sha256()
    size = 0
    with open(file, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            size += len(block)
    return {"size": size, "sha256": h.hexdigest()}


def digests(root: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """``digest`` of each file ``root/name``, computed in threads (hashlib releases the GIL)."""
    with ThreadPoolExecutor(max_workers=min(4, max(1, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda n: digest(os.path.join(root, n)), names)))


def verify(root: str, expected: dict[str, Any], names: set[str] | list[str], sha256: bool = True) -> None:
    """Raise ``CheckpointError`` naming the first file among ``names`` that the manifest does not list, that is
    missing, or whose size or (with ``sha256``) sha256 differs from the manifest's. Sizes are checked first."""
    names = sorted(names)
    for name in names:
        entry = expected.get(name)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{os.path.join(root, name)}: not listed in the checkpoint's manifest")
        file = os.path.join(root, name)
        try:
            size = os.path.getsize(file)
        except OSError as error:
            raise CheckpointError(f"{file}: missing ({error.strerror})") from error
        if size != entry.get("size"):
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {entry.get('size')} (damaged)")
    if not sha256:
        return
    found = digests(root, names)
    for name in names:
        if found[name]["sha256"] != expected[name].get("sha256"):
            raise CheckpointError(f"{os.path.join(root, name)}: sha256 differs from the manifest's (damaged)")


def rank_files(root: str, subdir: str) -> list[str]:
    """The data files a rank wrote into ``root/subdir``, relative to ``root``."""
    return sorted(f"{subdir}/{n}" for n in os.listdir(os.path.join(root, subdir)) if n != METADATA)


# ------------------------------------------------------------------------------------------------ marker
def _canonical(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def write_marker(directory: str, manifest: dict[str, Any]) -> None:
    """Write the marker (last: it says the checkpoint is complete), fsync'd, atomically."""
    marker = os.path.join(directory, MARKER)
    body = {"manifest": manifest, "sha256": hashlib.sha256(_canonical(manifest)).hexdigest()}
    with open(marker + ".tmp", "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker + ".tmp", marker)


def read_marker(directory: str) -> dict[str, Any]:
    """The manifest the marker holds, its own checksum verified. Raises ``CheckpointError``."""
    marker = os.path.join(directory, MARKER)
    try:
        with open(marker, "rb") as f:
            body = json.loads(f.read(64 << 20).decode("utf-8"), parse_constant=_no_constant)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{marker} cannot be read: {error}") from error
    if not isinstance(body, dict) or not isinstance(body.get("manifest"), dict):
        raise CheckpointError(f"{marker} is not a zgraph manifest")
    manifest = body["manifest"]
    if body.get("sha256") != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise CheckpointError(f"{marker}: the manifest's sha256 does not match its contents (damaged)")
    return manifest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON here")


# ------------------------------------------------------------------------------------------------ temporaries
def temp_name(path: str) -> str:
    """A temporary directory name for a save to ``path``, unique to this save: host, process and random."""
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:40] or "host"
    return f"{path}.tmp-{host}-{os.getpid()}-{secrets.token_hex(4)}"


def is_abandoned(temp: str, now: float | None = None) -> bool:
    """True if the save that made ``temp`` is over: its process (on this host) is gone, or ``temp`` is older
    than ``STALE_AGE`` (another host's, or an unparseable name). A live save's directory is never abandoned."""
    now = time.time() if now is None else now
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:40] or "host"
    parts = temp.rsplit(".tmp-", 1)[-1].rsplit("-", 2)
    if len(parts) == 3 and parts[0] == host and parts[1].isdigit():
        pid = int(parts[1])
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    try:
        return now - os.path.getmtime(temp) > STALE_AGE
    except OSError:
        return False


def clean_abandoned(path: str, siblings: list[str]) -> None:
    """Remove the temporary directories of saves to ``path`` that are over (see ``is_abandoned``)."""
    for temp in siblings:
        if is_abandoned(temp):
            shutil.rmtree(temp, ignore_errors=True)


def move_into_place(temp: str, path: str) -> None:
    """Rename the complete ``temp`` to ``path``; an older checkpoint there is moved aside first and deleted
    after. Another save finishing at the same moment may put its checkpoint at ``path`` in between: it is moved
    aside too (the last rename wins)."""
    for _ in range(100):
        old = None
        if os.path.lexists(path):
            old = f"{path}.old-{secrets.token_hex(6)}"
            try:
                os.rename(path, old)
            except FileNotFoundError:
                old = None  # another save moved it aside first
        try:
            os.rename(temp, path)
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            _remove(old)
            continue  # another save renamed its checkpoint to ``path`` in between: move it aside, try again
        _remove(old)
        return
    raise CheckpointError(f"could not rename {temp} to {path}: other saves keep replacing it")


def _remove(old: str | None) -> None:
    if old is None:
        return
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    elif os.path.lexists(old):
        os.remove(old)


def fsync_dir(path: str) -> None:
    """Flush ``path``'s directory entries to disk (best effort: nothing where the system does not allow it)."""
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
