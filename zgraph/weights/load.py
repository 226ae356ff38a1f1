"""``zgraph.load_pretrained``: pretrained weights read straight into the model's shards, each rank reading only the
rows of its shards (and the tensors it keeps whole), never the whole model."""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from zgraph.checkpoint.ranks import gather_results, rank_and_world
from zgraph.config import Config
from zgraph.errors import CheckpointError
from zgraph.runtime.agreement import world_channel
from zgraph.runtime.offload import materialize as resident
from zgraph.runtime.stage_state import held_elsewhere
from zgraph.weights.materialize import materialize
from zgraph.weights.report import Match, refuse, report
from zgraph.weights.sources import Entry, Rows, open_source


@dataclass
class Target:
    """One tensor of the model and where its checkpoint values go.

    Attributes:
        names: its ``model.state_dict()`` names (several for tied weights), in that order.
        shape: its global shape.
        dest: the tensor written in place: the tensor itself, or a ``DTensor``'s local tensor (for a zgraph
            shard a view of its padded shard, whose padding rows stay zeros).
        rows: the rows ``[start, stop)`` of dim 0 ``dest`` holds when the tensor is sharded, else None.
    """

    names: list[str]
    shape: tuple[int, ...]
    dest: Tensor
    rows: tuple[int, int] | None

    def wanted(self) -> Rows:
        start, stop = self.rows if self.rows is not None else (None, None)
        return Rows(start, stop, self.dest.dtype)


@dataclass
class Loaded:
    """What ``load_pretrained`` did: the model names it filled, and how the checkpoint matched the model."""

    loaded: list[str]
    match: Match


def load_pretrained(
    model: nn.Module, path_or_dir: str | os.PathLike, *, config: Config | None = None, strict: bool = True
) -> Loaded:
    """Read pretrained weights into ``model`` as it is laid out now, each rank reading only what it holds.

    ``path_or_dir``: a Hugging Face checkpoint — ``model.safetensors`` or a sharded ``model.safetensors.index.json``
    (the file, or the directory holding it) — or a DCP directory: a ``torch.distributed.checkpoint.save`` of
    ``model.state_dict()``, or a ``zgraph.save`` checkpoint (its model part). Names are ``model.state_dict()``'s;
    a tied tensor is filled from whichever of its names the checkpoint holds (Hugging Face checkpoints of tied
    models hold ``model.embed_tokens.weight``, not ``lm_head.weight``). Persistent buffers are loaded,
    non-persistent ones are not expected. Values are converted to each tensor's dtype.

    Works on a model no zgraph step has touched (a plain module, whole copies), and after a step's first call:
    at stage 3 each rank reads the rows of its shards only and writes them into the padded shards in place (the
    ``DTensor`` parameters stay the same objects); at stages 0-2 each rank reads whole tensors. Host memory
    while loading: this rank's part of the model staged (views of the mapped files where the dtype already
    matches, a converted copy where it does not) plus one tensor being read.

    All or nothing: names and shapes are compared before anything is read (``strict=True``: a missing or
    unexpected name is refused; ``strict=False``: they are reported as a warning, missing tensors left as they
    are, unexpected ones ignored; a shape mismatch is always refused); then this rank's values are read into
    host staging tensors, every rank's outcome is exchanged (with a process group: call it on every rank, at
    the same point), and only if all succeeded are they copied into the model. Nothing is unpickled.

    A model still on the meta device (built under ``torch.device("meta")``) needs ``config``, the step's
    ``Config``: names and shapes are checked on the meta model, then ``zgraph.materialize(model, config,
    init=not strict)`` lays it out as the step will (each rank allocating only its shards; with ``strict=False``
    the model's own initialisation fills what the checkpoint lacks), then the checkpoint is read into it. A
    failure after that leaves the model materialised (its values undefined where not yet loaded).

    Returns:
        ``Loaded``: the names filled, and the ``Match`` (missing / unexpected names, empty when all matched).

    Raises:
        CheckpointError: nothing readable at ``path_or_dir``, a damaged file, another rank failed, or (its
            subclass ``PretrainedMismatchError``, with the report) names or shapes that do not match. The model
            is unchanged.
    """
    path = os.path.abspath(os.fspath(path_or_dir))
    staged: Staged | None = None
    error = None
    try:
        staged = _stage(model, path, config, strict)
    except Exception as caught:
        error = caught
    # every rank raises if one failed (not naming the path: ranks may read copies at different paths)
    gather_results(world_channel(), "zgraph.load_pretrained", {}, error)
    assert staged is not None
    if staged.match and rank_and_world()[0] == 0:
        missing = "newly initialized by materialize" if staged.meta else "left as they are"
        warnings.warn(report(type(model).__name__, path, staged.match, missing), RuntimeWarning, stacklevel=2)
    return Loaded(_commit(staged), staged.match)


@dataclass
class Staged:
    """This rank's values read into host tensors (``values``, by checkpoint name), not yet in the model."""

    targets: list[Target]
    chosen: list[str | None]
    values: dict[str, Tensor]
    match: Match
    meta: bool


def _stage(model: nn.Module, path: str, config: Config | None, strict: bool) -> Staged:
    """Compare, (lay out a meta model,) and read this rank's values; nothing in the model's values changes."""
    resident(model)  # offloaded parameter shards read back before they are written
    elsewhere = held_elsewhere(model)  # a pipelined step's other stages' parameters: their ranks read them
    meta = _on_meta(model, config, elsewhere)
    source = open_source(path)
    try:
        match = compare(source.entries, targets_of(model))
        refuse(type(model).__name__, path, match, strict)
        if meta:  # names and shapes checked on the meta model; then laid out as the step will, unfilled if strict
            materialize(model, config, init=not strict)
        targets = targets_of(model)
        chosen = [None if set(t.names) & set(elsewhere) else _chosen(t, source.entries) for t in targets]
        wanted = {name: t.wanted() for t, name in zip(targets, chosen) if name is not None}
        # a meta model has no values to keep: read straight into its new shards, one tensor at a time
        into = {name: t.dest for t, name in zip(targets, chosen) if name is not None} if meta else None
        values = source.read(wanted, into)
    finally:
        source.close()
    return Staged(targets, chosen, values, match, meta)


def targets_of(model: nn.Module) -> list[Target]:
    """The model's tensors as ``model.state_dict()`` names them, tied names together, each with the rows this rank
    holds (non-tensor entries, such as extra state, are not read from checkpoints)."""
    by_id: dict[int, Target] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, Tensor):
            continue
        if id(value) in by_id:
            by_id[id(value)].names.append(name)
            continue
        by_id[id(value)] = _target(name, value)
    return list(by_id.values())


def _target(name: str, value: Tensor) -> Target:
    shape = tuple(value.shape)
    if not isinstance(value, DTensor):
        return Target([name], shape, value.detach(), None)
    local = value._local_tensor
    local_shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if tuple(local_shape[1:]) != shape[1:] or any(offset[1:]) or tuple(local.shape) != tuple(local_shape):
        raise CheckpointError(
            f"{name} is a DTensor sharded along a dimension other than 0 ({value.placements}); load_pretrained "
            "reads rows of dim 0 only"
        )
    if tuple(local_shape) == shape:
        return Target([name], shape, local.detach(), None)
    return Target([name], shape, local.detach(), (offset[0], offset[0] + local_shape[0]))


def _chosen(target: Target, entries: dict[str, Entry]) -> str | None:
    """The checkpoint name a target is read from: the first of its names the checkpoint holds."""
    return next((n for n in target.names if n in entries), None)


def compare(entries: dict[str, Entry], targets: list[Target]) -> Match:
    """How the checkpoint's ``entries`` match the model's ``targets``."""
    match = Match()
    known = set()
    for target in targets:
        known.update(target.names)
        present = [n for n in target.names if n in entries]
        if not present:
            match.missing += target.names
        for name in present:
            if entries[name].shape != target.shape:
                match.mismatched.append((name, entries[name].shape, target.shape))
    match.unexpected = [name for name in entries if name not in known]
    return match


def _commit(staged: Staged) -> list[str]:
    """Copy the staged values into the model (each staged tensor freed once copied); the names filled."""
    loaded = []
    with torch.no_grad():
        for target, name in zip(staged.targets, staged.chosen):
            if name is not None:
                value = staged.values.pop(name, None)  # None: read in place (a meta model's new shards)
                if value is not None:
                    target.dest.copy_(value)
                loaded += target.names
    return loaded


def _on_meta(model: nn.Module, config: Config | None, elsewhere: Collection[str] = ()) -> bool:
    """Whether the model has tensors on the meta device (then ``config`` is required, to lay it out as the step
    will: ``zgraph.materialize``), other than ``elsewhere`` (another pipeline stage's, held by its rank)."""
    state = model.state_dict(keep_vars=True)
    meta = [name for name, t in state.items() if isinstance(t, Tensor) and t.is_meta and name not in elsewhere]
    if meta and config is None:
        raise CheckpointError(
            f"load_pretrained: {len(meta)} tensors of the model are on the meta device ({meta[0]}, ...); pass "
            "config=<the step's zgraph.Config> so that they are laid out as the step will lay them out "
            "(zgraph.materialize) before they are filled"
        )
    return bool(meta)
