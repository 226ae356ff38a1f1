"""``offload``: optimizer states (``Config.offload_optimizer``) and stage-3 parameter shards
(``Config.offload_params``) live in the offload tier, not in the memory of the state's device: ``"nvme"`` (files),
or ``"cpu"`` when the state is on a device (host memory; on the CPU ``"cpu"`` is the identity).

Plan:

* optimizer states: the ``opt_state`` inputs in graph order (the binding's parameter order), taken whole until
  their bytes reach ``fraction`` of all optimizer-state bytes (DeepSpeed's ``ratio``: the first states move, the
  rest stay);
* parameters: every parameter input the ``shard_params`` pass made a shard (``layout="shard"``); parameters that
  stay whole (under ``Config.param_persistence_threshold``, 0-d) stay in memory.

Rewrite, for each planned input (``slot``: its input position):

* its readers are cut into *use regions* (a maximal run of readers within one phase: for a parameter the
  forward's all-gather, the backward's re-gather, the optimizer's update; for a state the update), and each
  region reads ``zgraph::reload(input, slot)``, inserted right before the region's first reader: the value is in
  memory only within the region, not across the whole step;
* the updated value the graph returns for it goes to ``zgraph::write_back(value, slot)``, inserted right after
  the value is computed; the output becomes write_back's empty token, with role ``OFFLOADED``: the runtime
  writes nothing back, the tier holds the new value (made current once the whole graph ran, so every reload of
  the step reads the value the step started from).

Parameters the host updates (``PassContext.host_params``, ``Config.offload_update="host"``) and their states are in host
memory already: the ``host_update`` pass places them, this one leaves them alone.

Safety rules: only ``opt_state`` and sharded ``param`` inputs move; an input the graph does not read is left
alone (nothing to reload); one read but not updated gets no write_back. Nothing else changes: the arithmetic is
the same, so training is bitwise the same as without offload. No tier, or ``"cpu"`` with the state on the CPU
(the identity), leaves its inputs as they are.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from zgraph.graph import (
    INPUT,
    OFFLOADED,
    OPTIMIZER,
    VAL,
    insert,
    offload_moves,
    output_node,
    placeholders,
    state_key,
    tensor_bytes,
)
from zgraph.ops import RELOAD, WRITE_BACK
from zgraph.passes.graph_utils import insert_per_region, outputs, set_outputs, use_regions
from zgraph.passes.pass_list import PassContext


def plan_offload(gm: fx.GraphModule, fraction: float, host: set[int]) -> list[fx.Node]:
    """The optimizer-state placeholders to offload: whole states in order until ``fraction`` of the bytes (but the
    states of parameters the host updates, ``host``: the ``host_update`` pass places them)."""
    states = [
        n
        for n in placeholders(gm)
        if n.meta[INPUT].kind == "opt_state" and n.meta[VAL].dim() > 0 and n.meta[INPUT].index not in host
    ]
    budget = fraction * sum(tensor_bytes(n.meta[VAL]) for n in states)
    chosen, done = [], 0
    for node in states:
        if done >= budget or fraction <= 0:
            break
        if node.users:
            chosen.append(node)
        done += tensor_bytes(node.meta[VAL])
    return chosen


def plan_param_offload(gm: fx.GraphModule, host: set[int]) -> list[fx.Node]:
    """The parameter placeholders to offload: every sharded (stage-3) parameter the graph reads (but those in host
    memory already, ``host``)."""
    return [
        n
        for n in placeholders(gm)
        if n.meta[INPUT].kind == "param"
        and n.meta[INPUT].layout == "shard"
        and n.meta[INPUT].index not in host
        and any(u.op != "output" for u in n.users)
    ]


def offload_applies(
    gm: fx.GraphModule, ctx: PassContext, *, tier: str | None = None, fraction: float = 1.0, params: str | None = None
) -> bool:
    """Whether ``offload`` may change the graph: only where a tier moves state off the device (``Pass.applies``)."""
    return offload_moves(tier, ctx.device_type) or offload_moves(params, ctx.device_type)


def offload(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    tier: str | None = None,
    fraction: float = 1.0,
    params: str | None = None,
) -> fx.GraphModule:
    """Offloaded optimizer states and parameter shards: reloaded before each phase's reads, written back after
    their update.

    ``tier``: ``Config.offload_optimizer``; ``fraction``: ``Config.offload_fraction``; ``params``:
    ``Config.offload_params`` (``"cpu"`` changes the graph only when ``ctx.device_type`` is not the CPU)."""
    if not offload_applies(gm, ctx, tier=tier, fraction=fraction, params=params):
        return gm
    host = ctx.host_params
    chosen = plan_offload(gm, fraction, host) if offload_moves(tier, ctx.device_type) else []
    chosen += plan_param_offload(gm, host) if offload_moves(params, ctx.device_type) else []
    if not chosen:
        return gm
    slots = {node: i for i, node in enumerate(placeholders(gm))}
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    items = outputs(gm)
    updated = {state_key(role): k for k, (_, role) in enumerate(items) if role.kind in ("opt_state", "param")}
    for node in chosen:
        regions = use_regions(node, order)
        k = updated.get(state_key(node.meta[INPUT]))
        if regions:
            loaded = insert_per_region(gm, node, regions, RELOAD, (node, slots[node]))[-1]
        elif k is not None:  # read by nothing but the output: a state returned as it is
            loaded = insert(gm, RELOAD, (node, slots[node]), before=output_node(gm), phase=OPTIMIZER)
        if k is None:
            continue
        value, role = items[k]
        if not isinstance(value, fx.Node):
            continue
        value = loaded if value is node else value  # returned unchanged: its last reload is written back
        token = insert(gm, WRITE_BACK, (value, slots[node]), after=value, phase=OPTIMIZER)
        items[k] = (token, dataclasses.replace(role, kind=OFFLOADED))
    set_outputs(gm, items)
    return gm
