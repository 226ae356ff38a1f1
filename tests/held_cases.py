"""What a rank holds between steps, measured against ``step.estimate(...).model_state_bytes`` (issue 25, item 4).

Each case builds a small MLP (or a one-layer GPT) and AdamW (none in split mode) on every rank, runs a few steps
(captures, the first step's optimizer state), estimates the next call, runs it, drops what it returned and then counts
the tensor bytes the process holds that it did not hold before the case began — leaving aside the batch the caller
keeps and the rank tables of DTensor's device meshes (``world`` int32s: not state) — two ways:

- ``live``: every tensor storage a Python object refers to (``zgraph.runtime.memory.live_storages``: the model,
  the optimizer, and any cache, closure, store or thread that keeps a tensor);
- ``tracked``: the storages alive before the measured call that ``LiveTensorBytes`` was told of, plus every
  storage an op allocated during the call, still alive after it — what C++ alone keeps (an autograd node's saved
  tensors, a collective's work) is in there too.

Both must equal the estimate's ``model_state_bytes["total"]`` (parameters, master copies, ``.grad`` left, optimizer
state, buffers; the offloaded bytes live in files and are not in it). Split mode runs its forward step, then the
user's backward (an optimizer the step never binds would keep the whole, unsharded parameters at stage 3 until its
first eager ``step()`` re-points it: the user's, not zgraph's).
"""

from __future__ import annotations

import contextlib
import gc
import json
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

import zgraph
from zgraph.demos.models import GPT, GPTConfig, lm_loss
from zgraph.runtime.memory import LiveTensorBytes, live_storages, live_tensors

SHAPE = GPTConfig(vocab=96, d_model=32, layers=1, heads=2, seq=16)  # "gpt"; "mlp" is quicker to trace
STEPS = 3  # before the measured call: capture, the first step's state, a steady step
# seconds to wait before each count after the measured call, the next only while a count is over the estimate: a
# thread outside Python (most likely gloo's, done with a collective) can drop a buffer a moment after the step
# returned — seen as tensors no Python object refers to; the scans' collections of the whole process used to give
# it that moment (``_frozen``). What is still held after the last count is held between steps.
SETTLE = (0.0, 0.25, 0.25, 0.5, 1.0, 2.0)  # 4 s at most, under load (the counts only wait while over)
BF16 = {"param_dtype": torch.bfloat16, "master_dtype": torch.bfloat16, "optimizer_state_dtype": torch.bfloat16}
RECIPES: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": BF16,  # every state in bf16
    "bf16-params": {"param_dtype": torch.bfloat16, "optimizer_state_dtype": torch.bfloat16},  # fp32 masters
    "cpu": {"offload_optimizer": "cpu"},  # the host tier: the identity on the CPU
    "nvme": {"offload_optimizer": "nvme"},
    "nvme-both": {"offload_optimizer": "nvme", "offload_params": "nvme"},
}


def _loss(out: Tensor, tgt: Tensor) -> Tensor:
    return lm_loss(out, tgt) if out.dim() == 3 else F.mse_loss(out, tgt)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: Tensor, tgt: Tensor) -> Tensor:
    loss = _loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def keep_grads_step(model: nn.Module, opt: torch.optim.Optimizer, idx: Tensor, tgt: Tensor) -> Tensor:
    """Zeroes the gradients before the backward: ``.grad`` is held between steps."""
    opt.zero_grad()
    loss = _loss(model(idx), tgt)
    loss.backward()
    opt.step()
    return loss.detach()


def forward(model: nn.Module, idx: Tensor) -> Tensor:
    """Split mode: the logits come back with a ``grad_fn``; the caller runs the backward."""
    return model(idx)


def _meshes() -> dict[int, int]:
    """The rank tables of the ``DeviceMesh``es alive (a DTensor's mesh: ``world`` int32s, not state)."""
    meshes = [obj for obj in gc.get_objects() if issubclass(type(obj), DeviceMesh)]
    return {m.mesh.untyped_storage().data_ptr(): m.mesh.untyped_storage().nbytes() for m in meshes}


def _outside(
    live: dict[int, Tensor], meshes: dict[int, int], before: dict[int, int], aside: list[Tensor]
) -> dict[int, int]:
    """Of the ``live`` tensors (``live_tensors()``), the storages that were not alive in ``before``, are not the
    caller's ``aside`` and not one of the ``meshes``' tables, with their bytes."""
    skip = set(before) | {t.untyped_storage().data_ptr() for t in aside} | set(meshes)
    return {ptr: t.untyped_storage().nbytes() for ptr, t in live.items() if ptr not in skip}


def _model_and_batch(name: str, rank: int) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(rank)
    if name == "gpt":
        batch = torch.randint(0, SHAPE.vocab, (2, SHAPE.seq + 1), generator=g)
        return GPT(SHAPE), batch[:, :-1].clone(), batch[:, 1:].clone()
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 8))
    return model, torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)


def _build(stage: int, recipe: str, grads: str, model_name: str, directory: str, rank: int) -> tuple:
    model, idx, tgt = _model_and_batch(model_name, rank)
    opt = None if grads == "split" else torch.optim.AdamW(model.parameters(), lr=1e-3)  # split: no optimizer
    fields = {**RECIPES[recipe], **({"offload_dir": directory} if recipe.startswith("nvme") else {})}
    config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0, **fields)
    fn = {"none": train_step, "kept": keep_grads_step, "split": forward}[grads]
    return model, opt, zgraph.distribute(config)(fn), idx, tgt


def _call(
    step: Any, model: nn.Module, opt: torch.optim.Optimizer | None, idx: Tensor, tgt: Tensor, split: bool
) -> None:
    """One step as the user makes it, its outputs dropped."""
    if not split:
        step(model, opt, idx, tgt)
        return
    logits = step(model, idx)
    _loss(logits, tgt).backward()


def measure(stage: int, recipe: str, grads: str, model_name: str, rank: int) -> dict:
    """One case on this rank: ``live``, ``tracked`` and the estimate's model state, in bytes."""
    before = live_storages()
    with tempfile.TemporaryDirectory() as directory:
        model, opt, step, idx, tgt = _build(stage, recipe, grads, model_name, directory, rank)
        split = grads == "split"
        for _ in range(STEPS):
            _call(step, model, opt, idx, tgt, split)
        args = (model, idx) if split else (model, opt, idx, tgt)
        estimated = dict(step.estimate(*args).model_state_bytes)
        tracker = LiveTensorBytes()
        _track_new(tracker, before)  # everything held now that the case made, the batch included
        with tracker:
            _call(step, model, opt, idx, tgt, split)
        tensors: dict[int, Tensor] = {}
        for pause in SETTLE:
            tensors.clear()  # the last count's tensors, else found again by this one: a buffer let go since is kept
            time.sleep(pause)
            tensors = live_tensors()  # after a gc.collect(): one scan of the objects for all that follows
            meshes = _meshes()
            made = sum(n for ptr, n in meshes.items() if ptr not in before)  # tracked: made by the case
            aside = sum(t.untyped_storage().nbytes() for t in (idx, tgt)) + made
            live = _outside(tensors, meshes, before, [idx, tgt])
            if max(sum(live.values()), tracker.current - aside) <= estimated["total"]:
                break
        smallest = min(p.untyped_storage().nbytes() for p in _local_tensors(model, opt) if p.untyped_storage().nbytes())
        result = {
            "stage": stage,
            "recipe": recipe,
            "grads": grads,
            "model": model_name,
            "live": sum(live.values()),
            "tracked": tracker.current - aside,
            "estimated": estimated,
            "smallest_state_tensor": smallest,
            "largest_live": sorted(live.values(), reverse=True)[:8],
            "unknown": _unknown(live, tensors, model, opt),
        }
        del model, opt, step, tracker, tensors, args
        gc.collect()  # an offload store is dropped while its files are there
    return result


def _track_new(tracker: LiveTensorBytes, before: dict[int, int]) -> None:
    """Track every live storage not in ``before`` (in a function of its own: no local keeps a tensor alive)."""
    for ptr, t in live_tensors().items():
        if ptr not in before:
            tracker.track(t)


def _unknown(
    live: dict[int, int], tensors: dict[int, Tensor], model: nn.Module, opt: torch.optim.Optimizer | None
) -> list[str]:
    """What each ``live`` storage outside the model and optimizer is (``tensors``: ``live_tensors()``, by data
    pointer), and the types of what refers to it (for the failure message)."""
    known = {t.untyped_storage().data_ptr() for t in _local_tensors(model, opt)}
    unknown = set(live) - known
    if not unknown:
        return []
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()  # gc.get_referrers sees no frozen object (``_frozen``): a cache made before would go unnamed
    try:
        out = []
        for ptr in unknown:
            t = tensors.pop(ptr)  # not held by the dict when its referrers are listed
            refs = sorted({type(r).__name__ for r in gc.get_referrers(t)} - {"frame"})
            out.append(f"{t.dtype} {tuple(t.shape)}, {live[ptr]} bytes, held by {', '.join(refs)}")
        return out
    finally:
        if frozen:
            gc.freeze()


def _local_tensors(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[Tensor]:
    """Every tensor of the model and the optimizer state, a DTensor's local shard for a DTensor."""
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    if opt is not None:
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    return [getattr(t, "_local_tensor", t) for t in tensors]


def ranks(rank: int, world: int, cases: list, out: str) -> None:
    """On each spawned rank: ``measure`` every ``(stage, recipe, grads, model)`` of ``cases``; each rank writes its
    results so far as JSON to ``out.<rank>`` after each."""
    with _frozen():
        results = []
        for case in cases:
            results.append(measure(*case, rank))
            with open(f"{out}.{rank}", "w") as f:
                json.dump(results, f)


@contextlib.contextmanager
def _frozen() -> Iterator[None]:
    """What the process held before these cases (torch, zgraph, earlier jobs: never garbage after a collection)
    frozen (``gc.freeze``): each ``gc.collect`` and object scan of ``measure`` then walks only what the cases made
    (a fifth of a second less each). Reachability is unchanged (a tensor a frozen cache holds is still found: the
    tensor is not frozen); what was made before the freeze is in no scan, so in no ``before`` either."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
