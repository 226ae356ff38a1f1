"""Reading zgraph checkpoints safely: the manifest, DCP's metadata (allow-list unpickler), the files a load
reads (verified against the manifest first), and DCP's own calls with its errors turned into ``CheckpointError``."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from zgraph.checkpoint import io as cio
from zgraph.checkpoint.data import tensor_refs
from zgraph.checkpoint.state import DATA, FORMAT, FORMAT_VERSION, RNG
from zgraph.errors import CheckpointError

MARKER = cio.MARKER


# ------------------------------------------------------------------------------------------------ reading
def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint (what its marker file holds: versions, world size, stage, model keys,
    optimizers, files with their sizes and sha256, time), its own checksum verified.

    Raises:
        CheckpointError: ``path`` is not a complete zgraph checkpoint of a format this zgraph reads.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        hint = ""
        olds = siblings(path, ".old-")
        if olds:
            hint = f"; a save interrupted while replacing it left the previous checkpoint at {olds[0]}"
        raise CheckpointError(f"no checkpoint at {path}{hint}")
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise CheckpointError(
            f"{path} is not a complete zgraph checkpoint: it has no {MARKER} marker (a save that did not finish, "
            "or a directory zgraph.save did not write)"
        )
    manifest = cio.read_marker(path)
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format {manifest.get('format')!r} version {manifest.get('format_version')!r}; this zgraph "
            f"reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    required = {"files": dict, "model_keys": list, "model_values": dict, "optimizers": list, "rng": dict}
    for key, kind in required.items():
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"{os.path.join(path, MARKER)}: malformed manifest ({key!r})")
    for i, saved in enumerate(manifest["optimizers"]):
        if not isinstance(saved, dict) or not {"class", "param_groups", "hyper", "state_values"} <= saved.keys():
            raise CheckpointError(f"{os.path.join(path, MARKER)}: malformed manifest (optimizer {i})")
        saved.setdefault("loss_scale", None)
    return manifest


def read_metadata(path: str, manifest: dict[str, Any], verify: bool) -> Any:
    """DCP's metadata, its file verified first; every file it names must be one the manifest lists."""
    files = manifest["files"]
    cio.verify(path, files, [cio.METADATA], sha256=verify)
    metadata = cio.load_metadata(os.path.join(path, cio.METADATA))
    for info in metadata.storage_data.values():
        if info.relative_path not in files or info.relative_path == cio.METADATA:
            raise CheckpointError(
                f"{os.path.join(path, cio.METADATA)} names a file the manifest does not list: {info.relative_path!r}"
            )
    return metadata


def tree_targets(trees: Any, tensor_meta: dict[str, Any]) -> dict[str, Tensor]:
    """Empty tensors for the tensors the trees reference, as the metadata describes them."""
    out = {}
    for key in tensor_refs(trees):
        meta = tensor_meta.get(key)
        if meta is None or not (key.startswith(DATA + ".") or key.startswith(RNG)):
            raise CheckpointError(f"the checkpoint's manifest references a tensor {key!r} it does not hold")
        out[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return out


def read_into(path: str, metadata: Any, manifest: dict[str, Any], targets: dict[str, Tensor], verify: bool) -> None:
    """Verify the files DCP reads for ``targets`` against the manifest, then read them into ``targets``."""
    cio.verify(path, manifest["files"], cio.files_read(metadata, targets), sha256=verify)
    dcp_load(targets, path)


# ------------------------------------------------------------------------------------------------ DCP calls
def dcp_save(tensors: dict[str, Tensor], directory: str) -> None:
    import torch.distributed.checkpoint as dcp

    with dcp_errors(f"writing {directory}"):
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory, sync_files=True), no_dist=True)


def dcp_load(targets: dict[str, Tensor], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    with dcp_errors(f"reading {path}"):
        dcp.load(targets, storage_reader=cio.SafeReader(path), no_dist=True)


@contextlib.contextmanager
def dcp_errors(what: str) -> Iterator[None]:
    """DCP's own errors (its ``CheckpointException`` is a ``BaseException``) as ``CheckpointError``, chained;
    DCP's warning that it runs without a process group (intended here) silenced."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            warnings.filterwarnings("ignore", message=".*no_dist.*")
            yield
    except CheckpointError:
        raise
    except CheckpointException as error:
        causes = [f[0] if isinstance(f, tuple) else f for f in error.failures.values()]
        cause = next((c for c in causes if isinstance(c, BaseException)), None)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from error
        text = f"{type(cause).__name__}: {cause}" if cause is not None else "failed"
        raise CheckpointError(f"{what}: {text}".splitlines()[0]) from error
    except Exception as error:
        raise CheckpointError(f"{what}: {type(error).__name__}: {error}".splitlines()[0]) from error


def siblings(path: str, infix: str) -> list[str]:
    parent, base = os.path.split(os.path.abspath(path))
    try:
        entries = sorted(os.listdir(parent or "."))
    except OSError:
        return []
    return [os.path.join(parent, e) for e in entries if e.startswith(base + infix)]
