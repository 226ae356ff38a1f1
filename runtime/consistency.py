"""All ranks must run the same graph: a cheap check on every call, a clear error instead of a hang.

Before a step's graph runs, each rank contributes a 64-bit digest of the graph it is about to run — the
captured graph, and the sequence of collectives the transformed graph issues — (one tiny all-gather of int64s,
the first collective of the call, on a device the group's backend serves: the host on gloo, the rank's GPU on
NCCL; see ``zgraph.runtime.devices.control_device``). If the digests differ — different batch shapes, different
Python branches, a rank whose capture failed — every rank sends a description of its graph (JSON text through the
c10d store) and raises ``RankMismatchError`` naming the difference. No graph collective has run at that point, so
nothing hangs; a rank that never arrives makes the others raise ``RankFailedError`` after
``Config.collective_timeout``.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.fx as fx

from zgraph.errors import RankMismatchError
from zgraph.graph import PHASE, collective_bytes, collective_kind
from zgraph.ops import host_read
from zgraph.runtime.agreement import Channel


def describe_graph(gm: fx.GraphModule) -> list[str]:
    """One line per node: inputs with shape and dtype, ops with their arguments."""
    lines = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        meta = f" {tuple(val.shape)} {val.dtype}" if isinstance(val, torch.Tensor) else ""
        if node.op == "placeholder":
            lines.append(f"input {node.name}{meta}")
        elif node.op == "call_function":
            lines.append(f"{node.name} = {_target(node.target)}{node.args}{meta}")
        elif node.op == "output":
            lines.append(f"output {node.args}")
    return lines


def _target(target: object) -> str:
    """An op as every rank names it: a Python function (``torch.sym_min`` in an optimizer's step) by its qualified
    name, not its address."""
    if isinstance(target, torch._ops.OpOverload) or not callable(target):
        return str(target)
    return fx.node._get_qualified_name(target)


def describe_collectives(gm: fx.GraphModule) -> list[str]:
    """The collectives a graph issues, in order, with what they move (no rank-specific detail)."""
    lines = []
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is not None:
            val = node.meta.get("val")
            val = val[0] if isinstance(val, (list, tuple)) and val else val
            dtype = val.dtype if isinstance(val, torch.Tensor) else None
            lines.append(f"collective {kind} {collective_bytes(node)} bytes {dtype} ({node.meta.get(PHASE)})")
    return lines


def digest(lines: list[str]) -> int:
    raw = hashlib.sha256("\n".join(lines).encode()).digest()
    return int.from_bytes(raw[:8], "little", signed=True)


def check_same_graph(
    channel: Channel,
    group_name: str,
    label: str,
    digest_value: int,
    lines: list[str],
    error: Exception | None = None,
    device: torch.device | None = None,
) -> None:
    """Compare this rank's graph digest with every other rank's; raise on every rank if they differ.

    The digests travel as one int64 pair per rank in an all-gather on ``group_name`` (zgraph's group, whose
    timeout is ``Config.collective_timeout``); descriptions, only when something differs, as JSON through
    ``channel``. ``error``: this rank failed to build its graph; the other ranks are told so (they raise
    ``RankMismatchError`` naming it, read from the failure record it made first), then it is re-raised here.
    ``device``: where the digests travel (``zgraph.runtime.devices.control_device``; default the host).
    """
    if not same_digests(channel, group_name, label, digest_value, error, device):
        raise_different_graphs(channel, label, lines)


def same_digests(
    channel: Channel,
    group_name: str,
    label: str,
    digest_value: int,
    error: Exception | None = None,
    device: torch.device | None = None,
) -> bool:
    """``check_same_graph``'s all-gather: whether every rank's digest is this rank's (the same answer on every
    rank). Raises as ``check_same_graph`` does where a rank failed to build its graph."""
    world = channel.world_size
    mine = torch.tensor([digest_value, 0 if error is None else 1], dtype=torch.int64, device=device)
    c10d = torch.ops._c10d_functional
    try:
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(mine, world, group_name))
        with host_read("graph fingerprints"):
            everyone = gathered.view(world, 2).tolist()
    except RuntimeError as failure:
        raise channel.peer_failure(label, failure) from failure
    if error is not None:
        raise error
    failed = [r for r in range(world) if everyone[r][1]]
    if failed:  # their failure records are in the store already (recorded before this all-gather)
        records = channel.failures(wait=2.0)
        notes = [(records.get(r, "no record of the error") if r in failed else None, []) for r in range(world)]
        raise RankMismatchError(_explain(notes, channel.rank))
    return all(row[0] == everyone[0][0] for row in everyone)


def raise_different_graphs(channel: Channel, label: str, lines: list[str]) -> None:
    """After ``same_digests`` said the graphs differ (every rank calls it): the ranks exchange their graphs'
    descriptions and raise ``RankMismatchError`` naming the first difference."""
    payload = json.dumps({"note": "", "lines": lines}).encode()
    descriptions = [_description(raw) for raw in channel.exchange(f"{label} (comparing graphs)", payload)]
    raise RankMismatchError(_explain(descriptions, channel.rank))


def _description(raw: bytes) -> tuple[str | None, list[str]]:
    """Another rank's ``(note, lines)``, checked to be what ``check_same_graph`` sends."""
    try:
        data = json.loads(raw)
        note, lines = data["note"], data["lines"]
        if isinstance(note, str) and isinstance(lines, list) and all(isinstance(line, str) for line in lines):
            return note or None, lines
    except (ValueError, KeyError, TypeError):
        pass
    return "it sent an unreadable graph description", []


def _explain(descriptions: list, rank: int) -> str:
    head = "zgraph: the ranks would run different step graphs, so their collectives would not match. "
    for other, (note, _) in enumerate(descriptions):
        if note is not None:
            return head + f"Rank {other} could not build its graph ({note})."
    base_lines = descriptions[0][1]
    for other, (_, lines) in enumerate(descriptions):
        if lines == base_lines:
            continue
        base_inputs = [line for line in base_lines if line.startswith("input ")]
        inputs = [line for line in lines if line.startswith("input ")]
        for a, b in zip(base_inputs, inputs):
            if a != b:
                return head + (
                    f"Rank 0 has `{a}`, rank {other} has `{b}`. Sizes that differ between ranks are symbolic "
                    "(one graph serves every rank's), but not a size 0 or 1, nor sizes equal to each other on one "
                    "rank only (they share a symbol there), nor dtypes or the arguments' structure: make those the "
                    "same on every rank (pad, or drop the last uneven batch)."
                )
        if len(base_inputs) != len(inputs):
            return head + f"Rank 0's graph has {len(base_inputs)} inputs, rank {other}'s has {len(inputs)}."
        for a, b in zip(base_lines, lines):
            if a != b:
                why = (
                    "the same graph was planned differently: is the Config the same on every rank?"
                    if a.startswith("collective ")
                    else "Python in the step that takes different paths on different ranks?"
                )
                return head + f"First difference between rank 0 and rank {other}: `{a}` vs `{b}` ({why})."
        return head + f"Rank 0's graph has {len(base_lines)} nodes, rank {other}'s has {len(lines)}."
    return head + f"(this is rank {rank})"
