"""``offload`` (``Config.offload_optimizer="nvme"``): optimizer states live in the offload tier, not in memory.

Plan: the optimizer-state inputs in graph order (the binding's parameter order), taken whole until their bytes
reach ``fraction`` of all optimizer-state bytes (DeepSpeed's ``ratio``: the first states move, the rest stay).
Rewrite, for each planned state:

* its reads go through ``zgraph::reload(state, slot)`` (``slot``: the input's position), inserted right before
  the first read, so the state is in memory only from there (the optimizer phase) on;
* the updated value the graph returns for it goes to ``zgraph::write_back(value, slot)``, inserted right after
  the value is computed; the output becomes write_back's empty token, with role ``OFFLOADED``: the runtime
  writes nothing back, the tier holds the new value (made current once the whole graph ran).

Safety rules: only ``opt_state`` inputs move; a state the graph does not read is left alone (nothing to
reload); a state read but not updated gets no write_back. Nothing else changes: the arithmetic is the same, so
training is bitwise the same as without offload. ``tier`` other than ``"nvme"`` (``None``; ``"cpu"`` on the
CPU, the identity) leaves the graph as it is.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from zgraph.graph import INPUT, OFFLOADED, OPTIMIZER, VAL, insert, placeholders, state_key, tensor_bytes
from zgraph.ops import RELOAD, WRITE_BACK
from zgraph.passes.graph_utils import outputs, set_outputs
from zgraph.passes.pipeline import PassContext


def plan_offload(gm: fx.GraphModule, fraction: float) -> list[fx.Node]:
    """The optimizer-state placeholders to offload: whole states in order until ``fraction`` of the bytes."""
    states = [n for n in placeholders(gm) if n.meta[INPUT].kind == "opt_state" and n.meta[VAL].dim() > 0]
    budget = fraction * sum(tensor_bytes(n.meta[VAL]) for n in states)
    chosen, done = [], 0
    for node in states:
        if done >= budget or fraction <= 0:
            break
        if node.users:
            chosen.append(node)
        done += tensor_bytes(node.meta[VAL])
    return chosen


def offload(gm: fx.GraphModule, ctx: PassContext, *, tier: str | None = None, fraction: float = 1.0) -> fx.GraphModule:
    """Offloaded optimizer states: reloaded right before their first read, written back right after their update.

    ``tier``: ``Config.offload_optimizer`` (only ``"nvme"`` changes the graph); ``fraction``:
    ``Config.offload_fraction``."""
    if tier != "nvme":
        return gm
    chosen = plan_offload(gm, fraction)
    if not chosen:
        return gm
    slots = {node: i for i, node in enumerate(placeholders(gm))}
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    items = outputs(gm)
    updated = {state_key(role): k for k, (_, role) in enumerate(items) if role.kind == "opt_state"}
    for node in chosen:
        first = min(node.users, key=order.__getitem__)
        readers = list(node.users)
        loaded = insert(gm, RELOAD, (node, slots[node]), before=first, phase=OPTIMIZER)
        for user in readers:
            user.replace_input_with(node, loaded)
        k = updated.get(state_key(node.meta[INPUT]))
        if k is None:
            continue
        value, role = items[k]
        if not isinstance(value, fx.Node):
            continue
        anchor = value if value.op != "placeholder" else loaded
        token = insert(
            gm, WRITE_BACK, (value if value is not node else loaded, slots[node]), after=anchor, phase=OPTIMIZER
        )
        items[k] = (token, dataclasses.replace(role, kind=OFFLOADED))
    set_outputs(gm, items)
    return gm
