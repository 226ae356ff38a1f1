"""The model state a step graph leaves, piece by piece and by kind (``Estimate.model_state_bytes``): what the graph
reads and writes back — parameters, the ``.grad`` left after the step, optimizer state, buffers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch.fx as fx

from zgraph.capture.captured import CapturedGraph
from zgraph.config import Config
from zgraph.graph import (
    INPUT,
    OUTPUTS,
    STATE_KINDS,
    VAL,
    GraphInput,
    GraphOutput,
    output_node,
    placeholders,
    state_key,
    tensor_bytes,
)
from zgraph.inspect.liveness import cuda_block_bytes, offloaded

MODEL_STATE_KINDS = ("params", "master", "grads", "optimizer", "buffers", "offloaded")


class StatePiece(NamedTuple):
    """One piece of model state a step graph leaves (``state_pieces``)."""

    spec: GraphInput | GraphOutput
    value: Any
    nbytes: int
    offloaded: bool


def state_pieces(final: fx.GraphModule, captured: CapturedGraph, device: str) -> list[StatePiece]:
    """Each piece of state the graph leaves: its output value, else its input (``.grad`` the step sets to None
    excepted); its bytes, on ``"cuda"`` its allocator block."""
    after: dict[tuple, tuple] = {}
    for node in placeholders(final):
        spec = node.meta[INPUT]
        if spec.kind in STATE_KINDS and not (spec.kind == "grad" and spec.index in captured.none_grads):
            after[state_key(spec)] = (spec, node.meta[VAL])
    out = output_node(final)
    for value, role in zip(out.args[0], out.meta[OUTPUTS]):
        if role.kind in STATE_KINDS:
            after[state_key(role)] = (role, value.meta[VAL] if hasattr(value, "meta") else value)
    stored = {state_key(n.meta[INPUT]) for n in placeholders(final) if offloaded(n)}
    pieces = []
    for key, (spec, val) in after.items():
        nbytes = cuda_block_bytes(tensor_bytes(val)) if device == "cuda" else tensor_bytes(val)
        pieces.append(StatePiece(spec, val, nbytes, key in stored))
    return pieces


def state_totals(pieces: Sequence[StatePiece], config: Config) -> dict[str, int]:
    """``pieces``' bytes by kind (``Estimate.model_state_bytes``): a parameter stored wider than the compute dtype
    is ``master``; an offloaded piece is ``offloaded`` only."""
    compute = config.param_dtype
    totals = dict.fromkeys(MODEL_STATE_KINDS, 0)
    for piece in pieces:
        spec, val = piece.spec, piece.value
        if piece.offloaded:
            totals["offloaded"] += piece.nbytes
        elif spec.kind == "param":
            wider = compute is not None and val.is_floating_point() and val.element_size() > compute.itemsize
            totals["master" if wider else "params"] += piece.nbytes
        else:
            totals[{"grad": "grads", "opt_state": "optimizer", "buffer": "buffers"}[spec.kind]] += piece.nbytes
    totals["total"] = sum(v for k, v in totals.items() if k != "offloaded")
    return totals
