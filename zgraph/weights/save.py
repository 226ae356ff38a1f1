"""``zgraph.save_pretrained``: a model written as Hugging Face sharded safetensors without a whole copy anywhere —
each tensor gathered to rank 0 alone when its turn comes, appended to a file whose header was written up front
(``safetensors_stream``), and freed before the next."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from zgraph.checkpoint.gather import entry_on_host
from zgraph.checkpoint.ranks import gather_results, rank_and_world
from zgraph.runtime.agreement import world_channel
from zgraph.runtime.offload import materialize
from zgraph.weights.safetensors_stream import Entry, StreamWriter, check_dtype, file_order

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # huggingface_hub's (decimal) units
METADATA = {"format": "pt"}


def save_pretrained(model: nn.Module, out_dir: str | os.PathLike, *, max_shard_size: int | str = "5GB") -> None:
    """Write ``model``'s weights to ``out_dir`` as Hugging Face safetensors, as transformers'
    ``model.save_pretrained(out_dir, max_shard_size=...)`` would for the eager model — also while zgraph holds
    its parameters sharded (ZeRO-3) or offloaded — so that ``from_pretrained(out_dir)`` loads them with no zgraph.

    What is written: ``model.safetensors`` when every tensor fits in ``max_shard_size`` (bytes, or a string such
    as ``"5GB"``/``"500MB"``, decimal units as transformers reads them), else ``model-00001-of-0000N.safetensors``
    ... and ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``),
    split in ``state_dict()`` order as transformers splits; each file with ``{"format": "pt"}`` metadata. Names
    are ``model.state_dict()``'s. A tensor under several names (tied weights) is written once: for a transformers
    model under the name transformers keeps (names matching the model's ``_tied_weights_keys`` are dropped, as
    ``PreTrainedModel.save_pretrained`` does), otherwise under its first name; keys in ``_keys_to_ignore_on_save``
    are left out. Tensors are stored as the model holds them (no weight-format conversion). A model with a
    Hugging Face ``config`` also gets ``config.json`` (``architectures`` and ``dtype`` set, as transformers does)
    and, where it generates, ``generation_config.json``: a complete model directory. Stale ``model-*-of-*`` shards
    of an earlier save are removed.

    Memory: no rank ever holds the whole model. Rank 0 holds one whole tensor at a time (gathered to it alone,
    written, freed); the other ranks only send their shard of it. Whole (unsharded) tensors are written from
    rank 0's own copy.

    Collective: every rank must call it, with the same ``max_shard_size`` (each sharded tensor is gathered in
    turn). Rank 0 alone writes; if writing fails, every rank raises (the failing rank its own error, the others a
    ``CheckpointError``). Each file is written under a temporary name and renamed into place when complete, and the
    index (which claims the save is whole) is removed first and written last. Without ``torch.distributed`` it
    runs in the one process.
    """
    out_dir = os.fspath(out_dir)
    rank, _ = rank_and_world()
    channel = world_channel()
    label = f"zgraph.save_pretrained({out_dir!r})"
    materialize(model)  # offloaded parameter shards, readable again
    state = model.state_dict()
    names = kept_names(model, state)
    files = split([_entry(name, state[name]) for name in names], _size(max_shard_size))
    error = None
    if rank == 0:
        try:
            _prepare(model, out_dir)
        except Exception as caught:
            error = caught
    gather_results(channel, f"{label}: prepare", {}, error)
    whole = entry_on_host(model, rank0_only=True)
    for filename, entries in files.items():
        error = _write_file(os.path.join(out_dir, filename), entries, state, whole, rank == 0)
        gather_results(channel, f"{label}: {filename}", {}, error)
    error = None
    if rank == 0:
        try:
            _finish(model, out_dir, files)
        except Exception as caught:
            error = caught
    gather_results(channel, f"{label}: index", {}, error)


def _entry(name: str, value: Any) -> Entry:
    if not isinstance(value, Tensor):
        raise TypeError(f"zgraph.save_pretrained: state_dict()[{name!r}] is a {type(value).__name__}, not a tensor")
    check_dtype(name, value.dtype)
    return Entry(name, value.dtype, tuple(value.shape))


def _size(max_shard_size: int | str) -> int:
    if isinstance(max_shard_size, int):
        return max_shard_size
    text = max_shard_size.strip()
    unit = text[-2:].upper()
    if unit not in _UNITS:
        raise ValueError(f"max_shard_size={max_shard_size!r}: give bytes, or digits and one of {', '.join(_UNITS)}")
    return int(float(text[:-2].strip()) * _UNITS[unit])


def split(entries: list[Entry], max_bytes: int) -> dict[str, list[Entry]]:
    """``{file name: entries}``: ``entries`` cut in order into files of at most ``max_bytes`` (a larger tensor
    alone in its own), named as transformers names them (``huggingface_hub.split_torch_state_dict_into_shards``)."""
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for entry in entries:
        if entry.nbytes > max_bytes:
            shards.append([entry])
            continue
        if size + entry.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return {WEIGHTS: shards[0]}
    return {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": shard for i, shard in enumerate(shards)}


def kept_names(model: nn.Module, state: dict[str, Any]) -> list[str]:
    """The ``state`` keys to write, in order: each tensor once (aliases found by object identity of the module's
    parameters and buffers, the same on every rank), under transformers' choice of name; ignored keys left out."""
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    objects: dict[str, int] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        objects[name] = id(t)
    groups: dict[int, list[str]] = {}
    for name in state:
        groups.setdefault(objects.get(name, id(state[name])), []).append(name)
    patterns = _tied_patterns(model)
    dropped: set[str] = set()
    for group in groups.values():
        if len(group) < 2:
            continue
        found = 0
        for name in sorted(group):  # PreTrainedModel.save_pretrained's rule (remove_tied_weights_from_state_dict)
            if any(re.search(pattern, name) for pattern in patterns):
                found += 1
                if found < len(group):
                    dropped.add(name)
        rest = [name for name in group if name not in dropped]
        dropped.update(rest[1:])  # names no tied-weights key covers: the first is kept
    return [name for name in state if name not in dropped and name not in ignored]


def _tied_patterns(model: nn.Module) -> list[str]:
    """The tied-weights keys of ``model`` and its submodules, prefixed with the submodule's name."""
    out = []
    for prefix, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        out += [f"{prefix}.{key}" if prefix else key for key in tied]  # a dict's keys, or a list (older models)
    return out


def _prepare(model: nn.Module, out_dir: str) -> None:
    """Rank 0, before any tensor: the directory, the old index (it would claim a half-written save) removed, the
    Hugging Face config files written."""
    os.makedirs(out_dir, exist_ok=True)
    index = os.path.join(out_dir, INDEX)
    if os.path.exists(index):
        os.remove(index)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    can_generate = getattr(model, "can_generate", None)
    generation = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and generation is not None:
        generation.save_pretrained(out_dir)


def _write_file(
    path: str, entries: list[Entry], state: dict[str, Any], whole_of: Callable[[str, Any], Any], writing: bool
) -> BaseException | None:
    """One safetensors file: every rank takes part in each tensor's gather, in the file's order; rank 0
    (``writing``) appends the bytes. A write error stops the writing (the file is removed), never the gathers:
    the other ranks are not left waiting. Returns the error, to be raised on every rank."""
    writer, error = None, None
    if writing:
        try:
            writer = StreamWriter(path, entries, METADATA)
        except Exception as caught:
            error = caught
    for entry in file_order(entries):
        whole = whole_of(entry.name, state[entry.name])
        if writer is not None and error is None:
            try:
                writer.write(entry.name, whole)
            except Exception as caught:
                error = caught
        del whole
    if writer is not None and error is None:
        try:
            writer.close()  # removes the file if it fails
        except Exception as caught:
            error = caught
    elif writer is not None:
        writer.abort()
    return error


def _finish(model: nn.Module, out_dir: str, files: dict[str, list[Entry]]) -> None:
    """Rank 0, after every file is in place: stale weights of an earlier save removed, then the index written
    (sharded saves only), under a temporary name renamed into place."""
    for name in os.listdir(out_dir):
        stale_shard = _SHARD.fullmatch(name) is not None and name not in files
        stale_single = name == WEIGHTS and WEIGHTS not in files
        if stale_shard or stale_single:
            os.remove(os.path.join(out_dir, name))
    if WEIGHTS in files:
        return
    metadata: dict[str, int] = {"total_size": sum(e.nbytes for entries in files.values() for e in entries)}
    count = getattr(model, "num_parameters", None)
    if callable(count):
        metadata["total_parameters"] = int(count())
    index = {"metadata": metadata, "weight_map": {e.name: f for f, entries in files.items() for e in entries}}
    path = os.path.join(out_dir, INDEX)
    temp = f"{path}.tmp-{os.getpid()}"
    with open(temp, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    os.replace(temp, path)
