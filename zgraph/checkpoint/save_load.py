"""Checkpoints of a training run: ``zgraph.save``, ``zgraph.load`` and ``zgraph.consolidate``.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory (layout: ``zgraph.checkpoint.io``). Every
rank writes the shards it holds (the ``DTensor`` shards zgraph exposes) and rank 0 the whole tensors, each rank
with DCP in its own process (no object collectives: nothing is pickled across ranks, numpy is not needed), into
its own subdirectory; rank 0 merges the ranks' DCP metadata into the checkpoint's ``.metadata``, which records
every tensor's global shape, so a checkpoint loads at any world size and any ZeRO stage.

What a checkpoint holds (DCP keys; ``<fqn>`` a name of ``model.state_dict()`` / ``model.named_parameters()``):

- ``model.<fqn>``: the tensors of ``model.state_dict()`` — parameters and persistent buffers, in their dtypes.
- ``optim.<i>.state.<fqn>.<field>``: the tensor state of optimizer ``i`` (``exp_avg``, ``step``...), keyed by
  parameter name instead of position, in the state's own dtypes.
- ``zgraph.data.<n>``: tensors inside the non-tensor values below; ``zgraph.rng.<rank>.<n>``: each rank's RNG
  states (torch CPU, CUDA when initialised).

Non-tensor values are data in the manifest (JSON; the storable types are listed in ``zgraph.checkpoint.data``):
the optimizers' class, parameter names per group and hyper-parameters, non-tensor state fields, the fp16
loss-scale state a zgraph step with ``Config.loss_scale`` keeps in ``optimizer._zgraph_loss_scale``, the LR
scheduler's ``state_dict()``, the user's ``extra``, modules' ``get_extra_state()``, each rank's Python (and
NumPy, when imported) RNG states. Nothing a checkpoint holds is unpickled: DCP's ``.metadata`` is read with an
allow-list unpickler of DCP's own classes. Gradients are not saved.

Integrity: the manifest lists every file with its size and sha256; ``load`` and ``consolidate`` verify the files
they read before anything is changed, read everything into staging tensors, check, and only then change the
model, optimizers, scheduler and RNG states. Every failure raises ``CheckpointError``.

Atomicity: ``save`` writes into ``<path>.tmp-<host>-<pid>-<random>`` next to ``path``; once every rank's data
and the metadata are written, rank 0 writes the marker ``.zgraph_complete`` (the manifest) and renames the
directory to ``path`` (an older checkpoint there is first moved to ``<path>.old-<random>`` and deleted after).
``load`` and ``consolidate`` refuse a directory without the marker. A save removes the temporaries of saves whose
process is gone (or that are older than a day, for other hosts'), never a live one's, so concurrent saves to
one path do not disturb each other: the last to finish wins. ``save`` never replaces a directory that is not a
zgraph checkpoint. All ranks must see the same file system.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zgraph.checkpoint import io as cio
from zgraph.checkpoint.data import decode, rng_restorer
from zgraph.checkpoint.load_optimizers import check_optimizer_values, commit_optimizers
from zgraph.checkpoint.ranks import gather_results, rank_and_world
from zgraph.checkpoint.read import dcp_save, read_into, read_manifest, read_metadata, siblings, tree_targets
from zgraph.checkpoint.state import (
    MODEL,
    OptimizerArg,
    as_list,
    check_model,
    check_optimizers,
    model_targets,
    parameter_names,
    saved_state,
    state_targets,
)
from zgraph.errors import CheckpointError
from zgraph.ops import host_read
from zgraph.runtime.agreement import Channel, world_channel
from zgraph.runtime.offload import materialize
from zgraph.runtime.sharded_state import normalize_state, sharding_of
from zgraph.runtime.stage_state import held_elsewhere

MARKER = cio.MARKER

__all__ = ["consolidate", "load", "read_manifest", "save"]


# ------------------------------------------------------------------------------------------------ save
def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: OptimizerArg = None,
    *,
    scheduler: Any = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Save ``model``, ``optimizer`` (one or a list), ``scheduler`` and ``extra`` as a checkpoint directory.

    Collective: call it on every rank of the process group, with the same arguments. Works with or without a
    process group, before or after a zgraph step has sharded the state. Saves the parameters and buffers, the
    optimizer state (in its own dtypes, keyed by parameter name) and hyper-parameters, the scheduler's
    ``state_dict()``, every rank's RNG states and ``extra`` (a dict of storable data — None, bool, int, float,
    str, list, tuple, dict with str keys, tensors — the same on every rank). ``path`` appears complete, or not at
    all; a checkpoint already at ``path`` is replaced once the new one is complete.

    Raises:
        CheckpointError: ``path`` exists and is not a zgraph checkpoint (it is never replaced), the optimizer
            holds a tensor that is not a parameter of ``model``, or a value (in ``extra``, the scheduler's state,
            a module's extra state...) cannot be stored as data (naming where it is and its type) — all before
            anything is written; or writing failed on some rank.
    """
    path = os.path.abspath(os.fspath(path))
    rank, world = rank_and_world()
    channel = world_channel()
    label = f"zgraph.save({path!r})"
    tensors: dict[str, Tensor] = {}
    manifest: dict[str, Any] = {}
    rng: Any = None
    error = None
    try:
        for owner in (model, *as_list(optimizer)):
            materialize(owner)  # offloaded parameter shards and optimizer states, readable again
        tensors, manifest, rng = saved_state(model, as_list(optimizer), scheduler, extra, rank, world)
        json.dumps(manifest, allow_nan=False)  # storable as JSON: checked before anything is written
    except Exception as caught:  # raised on every rank below, before anything is written
        error = caught
    gather_results(channel, f"{label}: state", {}, error)

    temp, error = None, None
    if rank == 0:
        try:
            temp = _prepare(path)
        except Exception as caught:
            error = caught
    temp = gather_results(channel, f"{label}: prepare", {"temp": temp}, error)[0]["temp"]
    try:
        _write_and_commit(channel, label, temp, path, tensors, manifest, rng, rank)
    except BaseException:
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise


def _write_and_commit(
    channel: Channel | None,
    label: str,
    temp: str,
    path: str,
    tensors: dict[str, Tensor],
    manifest: dict[str, Any],
    rng: Any,
    rank: int,
) -> None:
    """Every rank writes its tensors into ``temp/r<rank>`` and hashes them; rank 0 merges the metadata, writes
    the marker and renames ``temp`` to ``path``."""
    report: dict[str, Any] = {}
    error = None
    try:
        subdir = f"r{rank}"
        os.makedirs(os.path.join(temp, subdir), exist_ok=True)
        with host_read("checkpoint: save copies the state to the host"):  # DCP copies device tensors to write them
            dcp_save(tensors, os.path.join(temp, subdir))
        report = {"files": cio.digests(temp, cio.rank_files(temp, subdir)), "rng": rng}
    except Exception as caught:
        error = caught
    reports = gather_results(channel, f"{label}: write", report, error)
    error = None
    if rank == 0:
        try:
            _finish(temp, path, manifest, reports)
        except Exception as caught:
            error = caught
    gather_results(channel, f"{label}: commit", {}, error)


def _finish(temp: str, path: str, manifest: dict[str, Any], reports: list[dict[str, Any]]) -> None:
    """Rank 0: merge the ranks' DCP metadata into ``.metadata``, complete the manifest, commit."""
    ranks = [f"r{r}" for r in range(len(reports))]
    parts = [(subdir, cio.load_metadata(os.path.join(temp, subdir, cio.METADATA))) for subdir in ranks]
    cio.write_metadata(temp, cio.merge_metadata(parts))
    for subdir in ranks:
        os.remove(os.path.join(temp, subdir, cio.METADATA))
    files = {name: entry for report in reports for name, entry in report["files"].items()}
    files[cio.METADATA] = cio.digest(os.path.join(temp, cio.METADATA))
    rng = {str(r): report["rng"] for r, report in enumerate(reports)}
    _commit(temp, path, dict(manifest, rng=rng, files=files))


def _prepare(path: str) -> str:
    """Rank 0: check that ``path`` may be replaced, remove what finished or killed saves left, make this save's
    temporary directory; returns its name."""
    if os.path.lexists(path):
        is_empty_dir = os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)
        if not is_empty_dir and not os.path.isfile(os.path.join(path, MARKER)):
            raise CheckpointError(f"{path} exists and is not a zgraph checkpoint: refusing to replace it")
    cio.clean_abandoned(path, siblings(path, ".tmp-"))
    if os.path.isdir(path):
        for stale in siblings(path, ".old-"):
            shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temp = cio.temp_name(path)
    os.mkdir(temp)
    return temp


def _commit(temp: str, path: str, manifest: dict) -> None:
    """Rank 0, after every rank has written: write the marker last, then move the directory to ``path``."""
    cio.write_marker(temp, manifest)
    cio.fsync_dir(temp)
    cio.move_into_place(temp, path)
    cio.fsync_dir(os.path.dirname(path))


# ------------------------------------------------------------------------------------------------ load
def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: OptimizerArg = None,
    *,
    scheduler: Any = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by ``zgraph.save`` into ``model`` (and ``optimizer``, ``scheduler``); returns
    the saved ``extra`` dict (empty if none was saved).

    Collective: call it on every rank. The checkpoint may come from any world size and ZeRO stage: tensors are
    read into the layout the model and optimizer have now — whole tensors if no zgraph step has sharded them yet
    (a later step shards them), zgraph's shards otherwise. Parameters and buffers are loaded in place, in their
    current dtypes; optimizer state is replaced by the checkpoint's, in the dtypes of the optimizer's current state
    (the saved dtypes where it has none yet: Adam creates it on its first step); param groups' hyper-parameters,
    the loss-scale state, the scheduler's state and this rank's RNG states are restored (a rank the saving run did
    not have keeps its RNG states). Gradients are left as they are.

    All or nothing: every file read is first checked against the manifest's size and sha256 (``verify=False``
    skips the sha256, not the sizes), everything is read into staging tensors in host memory and checked on every
    rank, and only then is anything changed: the staging tensors are copied into the model's and optimizer's
    tensors on their device one at a time (in place where the optimizer already holds a state tensor of that
    layout), so the device holds the state once plus one tensor. Optimizer state goes where torch.optim keeps
    it: ``step`` on the host (a 0-d CPU tensor) unless the param group is ``capturable`` or ``fused``, every
    other field on its parameter's device.

    Raises:
        CheckpointError: ``path`` is not a complete zgraph checkpoint, a file is damaged or missing (named), its
            keys or shapes do not match the model or optimizer (the message lists missing, unexpected and
            mis-shaped keys), an optimizer is of another class, or another rank failed. Nothing was modified.
    """
    path = os.path.abspath(os.fspath(path))
    channel = world_channel()
    commit: Callable[[], dict[str, Any]] | None = None
    error = None
    try:
        for owner in (model, *as_list(optimizer)):
            materialize(owner)  # offloaded parameter shards and states, resident before they are compared and replaced
        commit = _stage(path, model, as_list(optimizer), scheduler, verify)
    except Exception as caught:
        error = caught
    gather_results(channel, f"zgraph.load({path!r})", {}, error)  # every rank raises if one failed: nothing changed
    return commit()


def _stage(
    path: str, model: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any, verify: bool
) -> Callable[[], dict[str, Any]]:
    """Check, verify and read everything into staging tensors; returns the function that commits it."""
    manifest = read_manifest(path)
    metadata = read_metadata(path, manifest, verify)
    tensor_meta = metadata.state_dict_metadata
    names = parameter_names(model)
    model_state = model.state_dict()
    check_model(model_state, tensor_meta, manifest)
    check_optimizers(optimizers, names, manifest, tensor_meta)
    if scheduler is not None and manifest.get("scheduler") is None:
        raise CheckpointError(f"{path} holds no LR scheduler state (it was saved without scheduler=)")
    rank, _ = rank_and_world()
    elsewhere = held_elsewhere(model)  # a pipelined step's other stages' parameters: their ranks read them
    targets = model_targets(model_state, elsewhere)
    new_states = []
    for i, opt in enumerate(optimizers):
        opt_targets, new_state = state_targets(model, opt, i, names, tensor_meta, {id(p) for p in elsewhere.values()})
        targets.update(opt_targets)
        new_states.append(new_state)
    saved_optimizers = manifest["optimizers"]
    trees = {
        "extra": manifest.get("extra"),
        "scheduler": manifest.get("scheduler") if scheduler is not None else None,
        "rng": manifest.get("rng", {}).get(str(rank)),
        "model": manifest.get("model_values", {}),
        "optimizers": [
            [saved_optimizers[i]["hyper"], saved_optimizers[i]["state_values"], saved_optimizers[i]["loss_scale"]]
            for i in range(len(optimizers))
        ],
    }
    targets.update(tree_targets(trees, tensor_meta))
    read_into(path, metadata, manifest, targets, verify)
    values = decode(trees, targets)
    extra = values["extra"] if values["extra"] is not None else {}
    restore_rng = rng_restorer(values["rng"]) if values["rng"] is not None else None
    optimizer_values = check_optimizer_values(optimizers, names, values["optimizers"], new_states)
    if not isinstance(extra, dict) or not isinstance(values["model"], dict):
        raise CheckpointError(f"{path}: malformed extra or model values in the manifest")

    def commit() -> dict[str, Any]:
        if values["model"]:
            model.load_state_dict(values["model"], strict=False)  # modules' set_extra_state
        if scheduler is not None:
            scheduler.load_state_dict(values["scheduler"])
        with torch.no_grad():
            for key, live in model_state.items():
                if isinstance(live, Tensor) and key not in elsewhere:  # host to device, one at a time
                    _local(live).copy_(_local(targets.pop(MODEL + key)))
        commit_optimizers(optimizers, new_states, optimizer_values)
        found = sharding_of(model)
        if found is not None:
            normalize_state(*found)
        if restore_rng is not None:
            restore_rng()
        return extra

    return commit


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ------------------------------------------------------------------------------------------------ consolidate
def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike, *, verify: bool = True) -> dict[str, Any]:
    """Write the model of a checkpoint as one plain ``state_dict`` file, ``torch.save``'d to ``out``.

    Runs in one process (no process group needed) whatever world size and stage saved the checkpoint. The file
    holds ``{key: whole tensor}`` with exactly the keys of ``model.state_dict()`` (a module's extra state as the
    data it was saved as); floating-point tensors stored in less than 32 bits are cast to float32. It needs
    nothing but torch to read: ``model.load_state_dict(torch.load(out))``. The files read are verified first (see
    ``load``). Returns the state dict written.

    Raises:
        CheckpointError: not a complete checkpoint, a damaged or missing file (named), or ``out`` cannot be
            written.
    """
    checkpoint = os.path.abspath(os.fspath(checkpoint))
    manifest = read_manifest(checkpoint)
    metadata = read_metadata(checkpoint, manifest, verify)
    keys, values = manifest.get("model_keys"), manifest.get("model_values", {})
    if not isinstance(keys, list) or not isinstance(values, dict) or not all(isinstance(k, str) for k in keys):
        raise CheckpointError(f"{checkpoint}: malformed model keys in the manifest")
    targets: dict[str, Tensor] = {}
    for key in keys:
        meta = metadata.state_dict_metadata.get(MODEL + key)
        if key in values:
            continue
        if meta is None:
            raise CheckpointError(f"{checkpoint}: the manifest lists {key!r}, the DCP metadata does not hold it")
        targets[MODEL + key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    trees = {key: values[key] for key in keys if key in values}
    targets.update(tree_targets(trees, metadata.state_dict_metadata))
    read_into(checkpoint, metadata, manifest, targets, verify)
    decoded = decode(trees, targets)
    state: dict[str, Any] = {}
    for key in keys:
        value = decoded[key] if key in values else targets[MODEL + key]
        if isinstance(value, Tensor) and value.is_floating_point() and value.element_size() < 4:
            value = value.float()
        state[key] = value
    out = os.fspath(out)
    temp = f"{out}.tmp-{os.getpid()}"
    try:
        torch.save(state, temp)
        os.replace(temp, out)
    except OSError as error:
        raise CheckpointError(f"cannot write {out}: {error.strerror or error}") from error
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    return state
