"""Lowering for the update on the host: the optimizer's host nodes (``zgraph.passes.host_update``) cut into
partitions that a host thread runs while the graph goes on (``zgraph.runtime.host_update``), as a backend rewrite
of either backend (the graph shown as ``final`` is the one that runs).

* **Cut.** Walking the graph in order, the optimizer-phase host nodes gather into one partition until a
  ``to_host`` (a device value arriving: a new gradient) or a node outside reads one of them; so a partition
  is about one gradient bucket's update, and starts as soon as the bucket's copy is issued. The host nodes of other
  phases (the forward's casts to the compute dtype) stay inline: the graph needs them right there.
* **Partition.** Its nodes move into a ``GraphModule`` of its own (``gm.meta[HOST_PARTS]``), whose inputs are the
  values the graph hands it, then those earlier partitions made (names in ``meta[ENV_INPUTS]``); it returns every
  value something outside it reads (``meta[ENV_OUTPUTS]``). In the graph: ``zgraph::host_submit(inputs, part)``
  where the partition closed, and ``zgraph::host_fetch(token, part, index, ...)`` before a node outside that reads
  one of its values (it waits for the partition).
* **State written in place.** Each host state the graph returns (a master parameter, an optimizer state, a step
  counter) is written by its partition into the input tensor itself — the chain already in place on it (the eager
  backend's ``reinplace``, here done for host chains under either backend), else a ``copy_`` at the partition's end
  where no read of the input's old value follows — and the graph returns the input (``UPDATED_INPUTS``). Only a
  state that cannot be is fetched (the exact update only: with ``offload_overlap`` the runtime refuses it).
* **Release.** ``zgraph::host_release`` right after the last node of the graph that reads a host parameter: with
  ``Config.offload_overlap="one_step"`` the previous step's update may overwrite them from there on.
* **Within the step.** A partition a value of which the graph fetches (an updated shard a parameter whole on every
  rank all-gathers), and the earlier partitions it reads, is marked ``meta[WITHIN_STEP]``: with ``one_step`` it
  still runs within its step (those parameters' update is not delayed).

Each partition's pointwise temporaries are made in place (``reinplace_temporaries``), as eager ``torch.optim``
computes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zgraph.graph import (
    INPUT,
    OPTIMIZER,
    OUTPUTS,
    PHASE,
    UPDATED_INPUTS,
    VAL,
    fake_mode,
    insert,
    output_node,
    placeholders,
    state_key,
)
from zgraph.host_ops import HOST, HOST_FETCH, HOST_PARTS, HOST_RELEASE, HOST_SUBMIT, PLACE, TO_DEVICE, TO_HOST
from zgraph.runtime.host_update import ENV_INPUTS, ENV_OUTPUTS, WITHIN_STEP
from zgraph.runtime.reinplace import reinplace_state_updates, reinplace_temporaries

aten = torch.ops.aten
READS = "zgraph_reads_parts"  # a partition's meta: the earlier partitions whose values it reads


def host_partitions(gm: fx.GraphModule) -> fx.GraphModule:
    """Cut ``gm``'s optimizer host nodes into partitions (module docstring); in place, returns ``gm``."""
    is_host = lambda n: n.meta.get(PLACE) == HOST and n.op == "call_function"  # noqa: E731
    if not has_host_ops(gm):
        return gm
    updated = set(gm.meta.get(UPDATED_INPUTS, ())) | set(reinplace_state_updates(gm, only=is_host))
    mode = fake_mode(gm)
    members = [n for n in gm.graph.nodes if is_host(n) and n.meta.get(PHASE) == OPTIMIZER]
    cuts = _cut(gm, set(members))
    owner = {n: j for j, (nodes, _) in enumerate(cuts) for n in nodes}
    parts = []
    for j, (nodes, close) in enumerate(cuts):
        parts.append(_outline(gm, j, nodes, close, owner, updated, mode))
    for sub in reversed(parts):  # what a partition the step waits for reads is waited for too
        for j in sub.meta[READS] if sub.meta[WITHIN_STEP] else ():
            parts[j].meta[WITHIN_STEP] = True
    for nodes, _ in reversed(cuts):
        for node in reversed(nodes):
            gm.graph.erase_node(node)
    _release(gm)
    gm.meta[HOST_PARTS] = parts
    gm.meta[UPDATED_INPUTS] = frozenset(updated)
    gm.recompile()
    return gm


def has_host_ops(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` has nodes the host runs, or copies between the host and the device."""
    return any(n.meta.get(PLACE) == HOST or n.target in (TO_HOST, TO_DEVICE) for n in gm.graph.nodes)


def _cut(gm: fx.GraphModule, members: set[fx.Node]) -> list[tuple[list[fx.Node], fx.Node]]:
    """``[(nodes, the node the partition is submitted before)]`` in graph order."""
    cuts, current, inside = [], [], set()
    for node in gm.graph.nodes:
        if node in members:
            current.append(node)
            inside.add(node)
            continue
        reads = any(a in inside for a in node.all_input_nodes)
        if current and (node.target is TO_HOST or node.op == "output" or reads):
            cuts.append((current, node))
            current, inside = [], set()
    return cuts


def _outline(
    gm: fx.GraphModule,
    j: int,
    nodes: list[fx.Node],
    close: fx.Node,
    owner: dict[fx.Node, int],
    updated: set[int],
    mode: object,
) -> fx.GraphModule:
    """Partition ``j`` of ``nodes``: its ``GraphModule``; in ``gm`` its submit before ``close``, fetches before the
    readers outside it, its state outputs written in place."""
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    handed = [a for a in inputs if a not in owner]
    earlier = [a for a in inputs if a in owner]
    writes = _in_place_writes(gm, nodes, close, owner, updated)
    handed += [x for x, _ in writes if x not in handed]
    outside = [n for n in nodes if any(u not in inside for u in n.users)]
    fetched = [n for n in outside if any(u not in owner for u in n.users)]
    sub = _module(handed, earlier, nodes, outside, writes)
    sub.meta[WITHIN_STEP] = bool(fetched)
    sub.meta[READS] = sorted({owner[a] for a in earlier})
    token = insert(gm, HOST_SUBMIT, (handed, j), before=close, phase=OPTIMIZER, mode=mode)
    token.meta[PLACE] = HOST
    for node in fetched:
        readers = [u for u in node.users if u not in owner]
        val = node.meta[VAL]
        args = (token, j, outside.index(node), list(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
        if args is None:
            raise NotImplementedError(f"zgraph: a host partition's non-tensor value {node} is read outside it")
        fetch = insert(gm, HOST_FETCH, args, before=min(readers, key=_position(gm)), phase=OPTIMIZER, mode=mode)
        for reader in readers:
            reader.replace_input_with(node, fetch)
    return sub


def _in_place_writes(
    gm: fx.GraphModule, nodes: list[fx.Node], close: fx.Node, owner: dict[fx.Node, int], updated: set[int]
) -> list[tuple[fx.Node, fx.Node | None]]:
    """The host states the partition writes into their input: ``[(input, value to copy, or None: updated in
    place already)]``; the graph's output then returns the input."""
    out = output_node(gm)
    inputs = {state_key(n.meta[INPUT]): n for n in placeholders(gm) if n.meta.get(PLACE) == HOST}
    position = _position(gm)
    values, writes = list(out.args[0]), []
    for k, (value, role) in enumerate(zip(values, out.meta[OUTPUTS])):
        source = inputs.get(state_key(role))
        if source is None or value not in nodes:
            continue
        if k in updated:
            writes.append((source, None))
        elif all(position(r) < position(close) for r in source.users if r not in owner and r.op != "output") and all(
            owner[r] <= owner[value] for r in source.users if r in owner
        ):
            writes.append((source, value))
            updated.add(k)
        else:
            continue
        values[k] = source
    out.args = (tuple(values),)
    return writes


def _module(
    handed: list[fx.Node],
    earlier: list[fx.Node],
    nodes: list[fx.Node],
    outside: list[fx.Node],
    writes: list[tuple[fx.Node, fx.Node | None]],
) -> fx.GraphModule:
    """The partition's ``GraphModule``: ``(*handed, *earlier) -> outside``, writing ``writes`` last."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in (*handed, *earlier):
        env[node] = graph.placeholder(node.name)
        env[node].meta[VAL] = node.meta.get(VAL)
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    for source, value in writes:
        if value is not None:
            graph.call_function(aten.copy_.default, (env[source], env[value]))
    graph.output(tuple(env[n] for n in outside))
    sub = fx.GraphModule(torch.nn.Module(), graph)
    sub.meta[ENV_INPUTS] = [n.name for n in earlier]
    sub.meta[ENV_OUTPUTS] = [n.name for n in outside]
    reinplace_temporaries(sub)
    return sub


def _release(gm: fx.GraphModule) -> None:
    """``host_release`` right after the graph's last read of a host parameter (at its start if it reads none)."""
    params = {n for n in placeholders(gm) if n.meta.get(PLACE) == HOST and n.meta[INPUT].kind == "param"}
    readers = [u for p in params for u in p.users if u.op != "output" and u.target is not HOST_SUBMIT]
    position = _position(gm)
    last = max(readers, key=position, default=None)
    anchor = last.next if last is not None else next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(anchor):
        node = gm.graph.call_function(HOST_RELEASE, (readers,))
    node.meta[PHASE] = anchor.meta.get(PHASE, OPTIMIZER)
    with fake_mode(gm):
        node.meta[VAL] = torch.empty(0)


def _position(gm: fx.GraphModule):  # noqa: ANN202
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return order.__getitem__
