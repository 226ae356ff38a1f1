"""Workers for ``test_hybrid.py``: ``zero_cases``'s parity cases under hybrid sharding and hpZ layouts, a step
that clips gradients, the split-backward cases, and checkpoints saved at one layout and loaded at another."""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.nn.functional as F
from zero_cases import CASES, Case, _adamw, _classification_batches, run_case

import zgraph


def clip_step(model, opt, x, y):
    """A step that clips the global gradient norm (0.05: every step clips)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    opt.zero_grad()
    return loss


CLIP = Case("clip_grad_norm", _adamw, clip_step, _classification_batches)
ALL_CASES = {**CASES, CLIP.name: CLIP}


def run_layouts(rank: int, world: int, out_path: str, runs: list[tuple[str, int, str, dict[str, Any]]]) -> None:
    """Run ``(label, stage, case name, Config fields)`` each; rank 0 saves ``{label: result or error}`` (with the
    collectives of the step's lowered graph: kind, ranks of its group, bytes)."""
    results: dict = {}
    for label, stage, name, fields in runs:
        try:
            result = run_case(ALL_CASES[name], stage, rank, world, **fields)
            result["collectives"] = collectives(result.pop("step"))
            results[label] = result
        except Exception:
            results[label] = {"error": traceback.format_exc()}
    if rank == 0:
        torch.save(results, out_path)


def collectives(step: Any) -> list[tuple[str, tuple[int, ...], int]]:
    """(kind, global ranks of its group, bytes) of every collective of the step's lowered graph."""
    import torch.distributed as dist

    from zgraph.graph import COLLECTIVE, collective_bytes, collective_kind

    found = []
    for node in step.graphs["lower_collectives"].graph.nodes:
        if COLLECTIVE in node.meta:
            name = next(a for a in reversed(node.args) if isinstance(a, str))
            ranks = tuple(dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name)))
            found.append((collective_kind(node), ranks, collective_bytes(node)))
    return found


def run_split(rank: int, world: int, out_dir: str, stages: list[int], names: list[str], layouts: dict) -> None:
    """``split_cases.run_split_cases`` at each layout (``{label: Config fields}``): rank 0 saves ``label.pt``."""
    import split_cases

    for label, fields in layouts.items():
        split_cases.run_split_cases(rank, world, os.path.join(out_dir, f"{label}.pt"), stages, names, fields)


# ------------------------------------------------------------------------------------------ checkpoints
def _step(**fields: Any):
    config = zgraph.Config(backend="eager", param_persistence_threshold=0, measure_collectives=False, **fields)
    import checkpoint_cases as cc

    return zgraph.distribute(config)(cc.classify_step)


LAYOUTS = {
    "hsdp": {"stage": 3, "shard_group_size": 2},
    "flat": {"stage": 3},
    "hsdp_s1": {"stage": 1, "shard_group_size": 2},
    "hpz": {"stage": 3, "secondary_shard_group_size": 2},
}


def reshard_worker(rank: int, world: int, out_dir: str, pairs: list[tuple[str, str]], single: str) -> None:
    """For each ``(saved, loaded)`` layout pair: train at ``saved``, save, load into a fresh model, resume at
    ``loaded``; also ``single`` (a checkpoint one process saved) resumed at HSDP. Rank 0 saves the losses per pair
    (``("one", "hsdp")`` for ``single``); the checkpoints stay in ``out_dir``, one per saved layout
    (``saved-<layout>``: the pairs that save at one layout train the same steps, and load the same checkpoint)."""
    import checkpoint_cases as cc

    head, tail = cc.batches()[: cc.BEFORE], cc.batches()[cc.BEFORE :]
    results: dict = {}
    done: set[str] = set()
    fresh = cc.make_state()
    zgraph.load(single, fresh[0], fresh[1], scheduler=fresh[2])
    results[("one", "hsdp")] = cc.train(fresh, _step(**LAYOUTS["hsdp"]), tail, rank, world)
    for saved, loaded in pairs:
        path = os.path.join(out_dir, f"saved-{saved}")
        if saved not in done:
            done.add(saved)
            state = cc.make_state()
            cc.train(state, _step(**LAYOUTS[saved]), head, rank, world)
            zgraph.save(path, state[0], state[1], scheduler=state[2])
        fresh = cc.make_state()
        zgraph.load(path, fresh[0], fresh[1], scheduler=fresh[2])
        results[(saved, loaded)] = cc.train(fresh, _step(**LAYOUTS[loaded]), tail, rank, world)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "reshard.pt"))
