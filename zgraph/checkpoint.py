"""Checkpoints of a training run: ``zgraph.save``, ``zgraph.load`` and ``zgraph.consolidate``.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory. Every rank writes the shards it holds (the
``DTensor`` shards zgraph exposes, or whole tensors, written once however many ranks hold them), and DCP's
metadata records every tensor's global shape, so a checkpoint loads at any world size and any ZeRO stage — DCP
reads, on each rank, the rows of its new shards.

What a checkpoint holds (DCP keys; ``<fqn>`` a name of ``model.state_dict()`` / ``model.named_parameters()``):

- ``model.<fqn>``: ``model.state_dict()`` — parameters and persistent buffers, in their own dtypes.
- ``optim.<i>.state.<fqn>.<field>``: the state of optimizer ``i`` (``exp_avg``, ``exp_avg_sq``, ``step``,
  ``momentum_buffer``...), keyed by parameter name instead of position, in the state's own dtypes.
- ``optim.<i>.param_groups``: the groups' hyper-parameters (``lr``, ``betas``, ``weight_decay``...).
- ``optim.<i>.loss_scale``: the fp16 loss-scale state (``scale``; ``good_steps`` and ``hysteresis`` of dynamic
  scaling) a zgraph step with ``Config.loss_scale`` carries, which it keeps in ``optimizer._zgraph_loss_scale``.
- ``zgraph.scheduler``: the LR scheduler's ``state_dict()``, if one is given.
- ``zgraph.extra``: the user's ``extra`` dict, if given.
- ``zgraph.rng.<rank>``: each rank's random number generator states (torch CPU, CUDA when initialised,
  Python's ``random``, NumPy's when NumPy is imported).

Gradients are not saved. Non-tensor values are pickled: load only checkpoints you trust.

Atomicity: ``save`` writes into ``<path>.tmp-<random>`` next to ``path``; once every rank's data and DCP's
metadata are written, rank 0 writes the marker ``.zgraph_complete`` (a JSON manifest) and renames the
directory to ``path`` (an older checkpoint there is first moved to ``<path>.old-<random>`` and deleted after the
rename). ``load`` and ``consolidate`` refuse a directory without the marker; the next save to ``path`` removes
what a killed save left (``<path>.tmp-*``). ``save`` never replaces a directory that is not a zgraph checkpoint.
All ranks must see the same file system.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pickle
import random
import secrets
import shutil
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zgraph.errors import CheckpointError
from zgraph.runtime.sharded_state import normalize_state, sharding_of

MARKER = ".zgraph_complete"
FORMAT = "zgraph-checkpoint"
FORMAT_VERSION = 1

MODEL = "model."
SCHEDULER = "zgraph.scheduler"
EXTRA = "zgraph.extra"
RNG = "zgraph.rng."
# The attribute a zgraph step with ``Config.loss_scale`` keeps its loss-scale state in (zgraph/step.py), per optimizer
LOSS_SCALE_ATTR = "_zgraph_loss_scale"

OptimizerArg = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


# ------------------------------------------------------------------------------------------------ public API
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
    ``state_dict()``, every rank's RNG states and ``extra`` (any picklable dict; it must be the same on every
    rank). ``path`` appears complete, or not at all; a checkpoint already at ``path`` is replaced once the new
    one is complete.

    Raises:
        CheckpointError: ``path`` exists and is not a zgraph checkpoint (it is never replaced), or the
            optimizer holds a tensor that is not a parameter of ``model``.
    """
    import torch.distributed.checkpoint as dcp

    path = os.path.abspath(os.fspath(path))
    rank, world = _rank_and_world()
    try:
        state, manifest = _saved_state(model, _as_list(optimizer), scheduler, extra, rank, world)
        error = None
    except Exception as caught:  # raised on every rank below, before any other collective
        error = caught
    _agree(error)

    # Rank 0 checks the destination and names the temporary directory; every rank learns the outcome.
    temp = _rank0(lambda: _prepare(path)) if rank == 0 else None
    temp = _broadcast(temp)
    if isinstance(temp, BaseException):
        raise temp
    try:
        with _quiet_dcp():
            dcp.save(state, storage_writer=_writer(temp), no_dist=not _distributed())
        # dcp.save returns once rank 0 has written DCP's metadata, after every rank's data is written
        outcome = _rank0(lambda: _commit(temp, path, manifest)) if rank == 0 else None
        outcome = _broadcast(outcome)
        if isinstance(outcome, BaseException):
            raise outcome
    except BaseException:
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise


def _saved_state(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    scheduler: Any,
    extra: Mapping[str, Any] | None,
    rank: int,
    world: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The flat DCP state dict ``save`` writes (see the module docstring for its keys) and the manifest."""
    names = _parameter_names(model)
    state: dict[str, Any] = {}
    model_state = model.state_dict()
    for key, value in model_state.items():
        state[MODEL + key] = value if isinstance(value, Tensor) else _pickled(value)
    groups = []
    for i, opt in enumerate(optimizers):
        fqn_groups = _group_names(opt, names, i)
        groups.append({"class": type(opt).__name__, "param_groups": fqn_groups})
        for param, fqn in zip(_optimizer_params(opt), (f for g in fqn_groups for f in g)):
            for field, value in opt.state.get(param, {}).items():
                state[f"optim.{i}.state.{fqn}.{field}"] = value if isinstance(value, Tensor) else _pickled(value)
        state[f"optim.{i}.param_groups"] = _pickled(
            [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
        )
        loss_scale = getattr(opt, LOSS_SCALE_ATTR, None)
        if loss_scale:
            state[f"optim.{i}.loss_scale"] = _pickled({k: _plain(v) for k, v in loss_scale.items()})
    if scheduler is not None:
        state[SCHEDULER] = _pickled(scheduler.state_dict())
    if extra is not None:
        state[EXTRA] = _pickled(dict(extra))
    state[f"{RNG}{rank}"] = _pickled(_rng_state())

    found = sharding_of(model)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "zgraph_version": _zgraph_version(),
        "torch_version": torch.__version__,
        "world_size": world,
        "stage": found[0].stage if found is not None else None,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_keys": list(model_state),
        "optimizers": groups,
        "scheduler": scheduler is not None,
        "extra": extra is not None,
    }
    return state, manifest


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: OptimizerArg = None,
    *,
    scheduler: Any = None,
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

    Raises:
        CheckpointError: ``path`` is not a complete zgraph checkpoint, or its keys or shapes do not match the
            model or optimizer (the message lists missing, unexpected and mis-shaped keys). Raised before
            anything is modified.
    """
    import torch.distributed.checkpoint as dcp

    path = os.path.abspath(os.fspath(path))
    optimizers = _as_list(optimizer)
    names = _parameter_names(model)
    model_state = model.state_dict()
    try:
        manifest = read_manifest(path)
        metadata = _read_metadata(path)
        _check_model(model_state, metadata)
        _check_optimizers(optimizers, names, manifest, metadata)
        if scheduler is not None and SCHEDULER not in metadata:
            raise CheckpointError(f"{path} holds no LR scheduler state (it was saved without scheduler=)")
        error = None
    except Exception as caught:
        error = caught
    _agree(error)  # every rank raises if one does, before any collective of DCP's

    targets: dict[str, Any] = {}
    for key, value in model_state.items():
        targets[MODEL + key] = value if isinstance(value, Tensor) else b""
    new_states = [_state_targets(model, opt, i, names, metadata, targets) for i, opt in enumerate(optimizers)]
    for i in range(len(optimizers)):
        targets[f"optim.{i}.param_groups"] = b""
        if f"optim.{i}.loss_scale" in metadata:
            targets[f"optim.{i}.loss_scale"] = b""
    for key in metadata:
        if (key == SCHEDULER and scheduler is not None) or key == EXTRA or key.startswith(RNG):
            targets[key] = b""
    with _quiet_dcp():
        dcp.load(targets, storage_reader=_reader(path), no_dist=not _distributed())

    # DCP read the tensors in place (model.state_dict() and zgraph's DTensors are views of the live storage)
    if any(not isinstance(v, Tensor) for v in model_state.values()):
        model.load_state_dict(
            {k: v if isinstance(v, Tensor) else pickle.loads(targets[MODEL + k]) for k, v in model_state.items()}
        )
    for i, (opt, new_state) in enumerate(zip(optimizers, new_states)):
        for param in _optimizer_params(opt):
            if param in new_state:
                opt.state[param] = {
                    field: value if isinstance(value, Tensor) else pickle.loads(targets[value])
                    for field, value in new_state[param].items()
                }
            else:
                opt.state.pop(param, None)
        for group, saved in zip(opt.param_groups, pickle.loads(targets[f"optim.{i}.param_groups"])):
            group.update(saved)
        if f"optim.{i}.loss_scale" in targets:
            _restore_loss_scale(opt, pickle.loads(targets[f"optim.{i}.loss_scale"]))
    found = sharding_of(model)
    if found is not None:
        normalize_state(*found)
    if scheduler is not None:
        scheduler.load_state_dict(pickle.loads(targets[SCHEDULER]))
    rank, _ = _rank_and_world()
    if f"{RNG}{rank}" in targets:
        _set_rng_state(pickle.loads(targets[f"{RNG}{rank}"]))
    return pickle.loads(targets[EXTRA]) if EXTRA in targets else {}


def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike) -> dict[str, Tensor]:
    """Write the model of a checkpoint as one plain ``state_dict`` file, ``torch.save``'d to ``out``.

    Runs in one process (no process group needed) whatever world size and stage saved the checkpoint. The file
    holds ``{key: whole tensor}`` with exactly the keys of ``model.state_dict()``; floating-point tensors stored
    in less than 32 bits are cast to float32. It needs nothing but torch to read:
    ``model.load_state_dict(torch.load(out))``. Returns the state dict written.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    checkpoint = os.path.abspath(os.fspath(checkpoint))
    manifest = read_manifest(checkpoint)
    metadata = _read_metadata(checkpoint)
    targets: dict[str, Any] = {}
    for key in manifest["model_keys"]:
        meta = metadata[MODEL + key]
        if isinstance(meta, TensorStorageMetadata):
            targets[MODEL + key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            targets[MODEL + key] = b""
    with _quiet_dcp():
        dcp.load(targets, storage_reader=_reader(checkpoint), no_dist=True)
    state: dict[str, Any] = {}
    for key in manifest["model_keys"]:
        value = targets[MODEL + key]
        if not isinstance(value, Tensor):
            state[key] = pickle.loads(value)
        elif value.is_floating_point() and value.element_size() < 4:
            state[key] = value.float()
        else:
            state[key] = value
    out = os.fspath(out)
    temp = f"{out}.tmp-{secrets.token_hex(4)}"
    try:
        torch.save(state, temp)
        os.replace(temp, out)
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    return state


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint (what its marker file holds: versions, world size, stage, model keys,
    optimizers' parameter groups, time).

    Raises:
        CheckpointError: ``path`` is not a complete zgraph checkpoint.
    """
    path = os.fspath(path)
    marker = os.path.join(path, MARKER)
    if not os.path.isdir(path):
        hint = ""
        olds = _siblings(path, ".old-")
        if olds:
            hint = f"; a save interrupted while replacing it left the previous checkpoint at {olds[0]}"
        raise CheckpointError(f"no checkpoint at {path}{hint}")
    if not os.path.isfile(marker):
        raise CheckpointError(
            f"{path} is not a complete zgraph checkpoint: it has no {MARKER} marker (a save that did not finish, "
            "or a directory zgraph.save did not write)"
        )
    try:
        with open(marker, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{marker} cannot be read: {error}") from error
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format {manifest.get('format')!r} version {manifest.get('format_version')!r}; this zgraph "
            f"reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    return manifest


# ------------------------------------------------------------------------------------------------ naming
def _as_list(optimizer: OptimizerArg) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return list(optimizer)


def _parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` (a tied parameter gets its first name, as ``named_parameters()`` gives)."""
    return {id(p): name for name, p in model.named_parameters()}


def _optimizer_params(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _group_names(opt: torch.optim.Optimizer, names: dict[int, str], index: int) -> list[list[str]]:
    """The names of the optimizer's parameters, group by group."""
    out = []
    for g, group in enumerate(opt.param_groups):
        fqns = []
        for p_index, p in enumerate(group["params"]):
            if id(p) not in names:
                raise CheckpointError(
                    f"optimizer {index} ({type(opt).__name__}) holds a tensor of shape {tuple(p.shape)} (param_groups"
                    f"[{g}]['params'][{p_index}]) that is not a parameter of the model: checkpoints name optimizer "
                    "state after the model's parameters"
                )
            fqns.append(names[id(p)])
        out.append(fqns)
    return out


# ------------------------------------------------------------------------------------------------ checking
def _tensor_meta(meta: Any) -> Any:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return meta if isinstance(meta, TensorStorageMetadata) else None


def _read_metadata(path: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata().state_dict_metadata
    except (OSError, ValueError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{path}: DCP metadata cannot be read: {error}") from error


def _shape_text(meta: Any) -> str:
    tensor = _tensor_meta(meta)
    return str(tuple(tensor.size)) if tensor is not None else "a non-tensor value"


def _check_model(model_state: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Raise ``CheckpointError`` listing every key of the model the checkpoint lacks, every model key of the
    checkpoint the model lacks, and every key whose shape differs."""
    saved = {key[len(MODEL) :]: meta for key, meta in metadata.items() if key.startswith(MODEL)}
    missing = [key for key in model_state if key not in saved]
    unexpected = [key for key in saved if key not in model_state]
    misshaped = []
    for key, value in model_state.items():
        if key not in saved:
            continue
        meta = _tensor_meta(saved[key])
        if isinstance(value, Tensor) != (meta is not None) or (
            meta is not None and tuple(meta.size) != tuple(value.shape)
        ):
            here = str(tuple(value.shape)) if isinstance(value, Tensor) else "a non-tensor value"
            misshaped.append(f"{key}: checkpoint {_shape_text(saved[key])}, model {here}")
    if missing or unexpected or misshaped:
        raise CheckpointError(_mismatch_message("the model", missing, unexpected, misshaped))


def _mismatch_message(what: str, missing: list[str], unexpected: list[str], misshaped: list[str]) -> str:
    lines = [f"the checkpoint does not match {what}; nothing was loaded"]
    if missing:
        lines.append(f"missing in the checkpoint ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        lines.append(f"unexpected (in the checkpoint, not in {what}) ({len(unexpected)}): " + ", ".join(unexpected))
    if misshaped:
        lines.append(f"shape mismatch ({len(misshaped)}):\n  " + "\n  ".join(misshaped))
    return "\n".join(lines)


def _check_optimizers(
    optimizers: list[torch.optim.Optimizer], names: dict[int, str], manifest: dict, metadata: dict[str, Any]
) -> None:
    saved = manifest.get("optimizers", [])
    if len(optimizers) > len(saved):
        raise CheckpointError(f"{len(optimizers)} optimizer(s) given, the checkpoint holds {len(saved)}")
    for i, opt in enumerate(optimizers):
        groups = _group_names(opt, names, i)
        saved_groups = saved[i]["param_groups"]
        if groups != saved_groups:
            here = {f for g in groups for f in g}
            there = {f for g in saved_groups for f in g}
            missing = [f for g in groups for f in g if f not in there]
            unexpected = [f for g in saved_groups for f in g if f not in here]
            detail = _mismatch_message(f"optimizer {i}'s parameters", missing, unexpected, [])
            raise CheckpointError(
                f"{detail}\nparam_groups: checkpoint {[len(g) for g in saved_groups]} parameters per group, "
                f"optimizer {[len(g) for g in groups]}"
            )
        prefix = f"optim.{i}.state."
        fqns = {f for g in groups for f in g}
        unexpected = [
            key for key in metadata if key.startswith(prefix) and _split_state_key(key[len(prefix) :], fqns) is None
        ]
        if unexpected:
            raise CheckpointError(_mismatch_message(f"optimizer {i}'s parameters", [], unexpected, []))


def _split_state_key(rest: str, fqns: set[str]) -> tuple[str, str] | None:
    """``"l1.weight.exp_avg" -> ("l1.weight", "exp_avg")`` for a known parameter name, else None."""
    cut = rest.rfind(".")
    while cut > 0:
        if rest[:cut] in fqns:
            return rest[:cut], rest[cut + 1 :]
        cut = rest.rfind(".", 0, cut)
    return None


# ------------------------------------------------------------------------------------------------ loading
def _state_targets(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    index: int,
    names: dict[int, str],
    metadata: dict[str, Any],
    targets: dict[str, Any],
) -> dict[Tensor, dict[str, Any]]:
    """New optimizer state to load into, per parameter: for each saved field a zero tensor of the saved shape, in
    the dtype of the optimizer's current state (the saved dtype if it has none yet), laid out as zgraph keeps that
    state now (a padded shard when sharded, else whole); or, for a non-tensor value, its DCP key. Registers the
    tensors and keys in ``targets``."""
    found = sharding_of(model)
    bound = found is not None and any(o.optimizer is opt for o in found[1].optimizers)
    prefix = f"optim.{index}.state."
    by_name = {names[id(p)]: p for p in _optimizer_params(opt)}
    fqns = set(by_name)
    new_state: dict[Tensor, dict[str, Any]] = {}
    for key, meta in metadata.items():
        if not key.startswith(prefix):
            continue
        fqn, field = _split_state_key(key[len(prefix) :], fqns)
        param = by_name[fqn]
        tensor = _tensor_meta(meta)
        if tensor is None:
            targets[key] = b""
            new_state.setdefault(param, {})[field] = key
            continue
        target = None
        size, dtype = tuple(tensor.size), tensor.properties.dtype
        live = opt.state[param].get(field) if param in opt.state else None
        if isinstance(live, Tensor) and tuple(live.shape) == size:
            dtype = live.dtype  # the dtype the run keeps this state in (Config.optimizer_state_dtype)
        device = param.device if not isinstance(param, DTensor) else param.to_local().device
        if bound and size == tuple(param.shape):
            plan, binding = found
            p_index = binding.param_index(param)
            spec = plan.specs[p_index] if p_index is not None else None
            if plan.group.distributed and plan.stage >= 1 and spec is not None and spec.shape == size:
                target = plan.wrap(torch.zeros(spec.shard_shape, dtype=dtype, device=device), spec)
        if target is None and isinstance(param, DTensor) and size == tuple(param.shape):
            target = torch.zeros_like(param, dtype=dtype)
        if target is None:
            target = torch.zeros(size, dtype=dtype, device=device)
        targets[key] = target
        new_state.setdefault(param, {})[field] = target
    return new_state


# ------------------------------------------------------------------------------------------------ saving
def _prepare(path: str) -> str:
    """Rank 0: check that ``path`` may be replaced, remove what interrupted saves left, make the temporary
    directory; returns its name."""
    if os.path.lexists(path):
        is_empty_dir = os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)
        if not is_empty_dir and not os.path.isfile(os.path.join(path, MARKER)):
            raise CheckpointError(f"{path} exists and is not a zgraph checkpoint: refusing to replace it")
    for stale in _siblings(path, ".tmp-"):
        shutil.rmtree(stale, ignore_errors=True)
    if os.path.isdir(path):
        for stale in _siblings(path, ".old-"):
            shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temp = f"{path}.tmp-{secrets.token_hex(6)}"
    os.mkdir(temp)
    return temp


def _commit(temp: str, path: str, manifest: dict) -> None:
    """Rank 0, after every rank has written: write the marker last, then move the directory to ``path``."""
    marker = os.path.join(temp, MARKER)
    with open(marker + ".tmp", "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker + ".tmp", marker)
    _fsync_dir(temp)
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{secrets.token_hex(6)}"
        os.rename(path, old)
    os.rename(temp, path)
    _fsync_dir(os.path.dirname(path))
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)


def _siblings(path: str, infix: str) -> list[str]:
    parent, base = os.path.split(os.path.abspath(path))
    try:
        entries = sorted(os.listdir(parent or "."))
    except OSError:
        return []
    return [os.path.join(parent, e) for e in entries if e.startswith(base + infix)]


def _fsync_dir(path: str) -> None:
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


def _writer(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(path, sync_files=True)


def _reader(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path)


# ------------------------------------------------------------------------------------------------ ranks
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_and_world() -> tuple[int, int]:
    if _distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _rank0(fn: Any) -> Any:
    """Run ``fn`` on rank 0; return its result, or the exception it raised (to broadcast, then raise everywhere)."""
    try:
        return fn()
    except Exception as error:  # handed to every rank, raised there
        return error


def _agree(error: Exception | None) -> None:
    """Raise on every rank if ``error`` is set on any rank (a rank's error would otherwise hang the others): the
    error itself where it happened, a ``CheckpointError`` naming the rank elsewhere."""
    if _distributed() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else str(error))
        failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
        if error is None and failed:
            rank, message = failed[0]
            raise CheckpointError(f"rank {rank}: {message}")
    if error is not None:
        raise error


def _broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not _distributed() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group (intended here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ------------------------------------------------------------------------------------------------ odds and ends
def _pickled(value: Any) -> bytes:
    """Non-tensor values are stored as one pickled blob each (DCP would otherwise flatten dicts into keys)."""
    return pickle.dumps(value)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        numpy.random.set_state(state["numpy"])


def _plain(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


def _restore_loss_scale(opt: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """Put the saved loss-scale state into the dict a zgraph step reads it from (in place: the step's binding
    shares it; only the fields the step's ``Config.loss_scale`` has); before any step, leave it on the optimizer
    for the first step to start from."""
    current = getattr(opt, LOSS_SCALE_ATTR, None)
    if isinstance(current, dict):
        current.update((k, v) for k, v in loaded.items() if k in current)
    else:
        setattr(opt, LOSS_SCALE_ATTR, dict(loaded))


def _zgraph_version() -> str:
    import zgraph

    return getattr(zgraph, "__version__", "unknown")
