"""``schedule``: order the lowered graph so communication overlaps computation.

Rules (plan first — an anchor position per node — then one stable reorder):

- **Issue early.** Each collective, with the copies and views that only prepare its input, is issued as soon as
  its inputs exist: a gradient's reduce-scatter right after backward produced it, an updated parameter's
  all-gather right after the optimizer produced it.
- **Prefetch within a cap.** Stage-3 parameter all-gathers read only graph inputs, so "as soon as possible"
  would be the very start. They are issued in the order their results are first used, each as early as keeps
  the bytes gathered ahead of use (issued, not yet read) within ``Config.prefetch_bytes``.
- **Reload with the gather, or late.** An offloaded parameter shard's ``zgraph::reload`` moves with the gather
  it feeds (it only packs the gather's input); any other reload goes right before its first reader.
- **Wait late.** Each ``wait_tensor``, and the views and copies that unpack its result, moves right before the
  first op that reads them — a reduce-scatter's no later than the next reduce-scatter's issue (its whole input
  is held until its wait).
- **Update while backward continues.** Optimizer work that depends on the gradient buckets up to the k-th
  reduction is placed right before the (k+1)-th reduction is issued: bucket k's reduce-scatter overlaps the
  backward work between the two issues, then its update runs while bucket k+1's is in flight.

Safety: the anchors depend only on the graph and on the config, and the reorder is a stable sort, so every rank
computes the same order and issues the same collectives in the same sequence (the runtime's per-call graph
check compares ranks before anything runs). Anchors are made monotone along every edge before sorting, so the
result is a valid topological order.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from zgraph.graph import BACKWARD, OPTIMIZER, PHASE, tensor_bytes
from zgraph.ops import RELOAD, UNSHARD
from zgraph.passes.bucket import bucket_limit
from zgraph.passes.graph_utils import CASTS, VIEWS
from zgraph.passes.pass_list import PassContext

aten = torch.ops.aten
WAIT = torch.ops._c10d_functional.wait_tensor.default
# Data movement that only packs a collective's input or unpacks its output: copies, and views and casts that
# re-type or re-lay one tensor (a gathered weight's transpose moves with its wait, not ahead of it).
_PACKING = (
    VIEWS
    | CASTS
    | {
        aten.cat.default,
        aten._chunk_cat.default,
        aten.constant_pad_nd.default,
        aten.clone.default,
        operator.getitem,
        RELOAD,  # an offloaded parameter shard read back for its gather
    }
)
_EPS = 1e-3
_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default  # a reduce-scatter on gloo
_REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
_REDUCTIONS = (_REDUCE_SCATTER, torch.ops._c10d_functional.all_reduce.default, _ALL_TO_ALL)
# after an all-to-all's wait, the sum of the received chunks and its division by the world size finish the
# reduce-scatter: they move with the wait
_ALL_TO_ALL_UNPACKING = frozenset({aten.sum.dim_IntList, aten.div.Tensor})


def is_collective(node: fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace == "_c10d_functional"
        and target is not WAIT
    )


def _packing_inputs(start: fx.Node) -> list[fx.Node]:
    """Nodes that exist only to build ``start``'s input (each used only by the chain), in graph order."""
    chain: list[fx.Node] = []
    members = {start}
    frontier = list(start.all_input_nodes)
    while frontier:
        node = frontier.pop()
        if node in members or node.target not in _PACKING or not set(node.users) <= members:
            continue
        members.add(node)
        chain.append(node)
        frontier.extend(node.all_input_nodes)
    return chain


def _unpacking(first: fx.Node, also: frozenset = frozenset()) -> list[fx.Node]:
    """``first`` (a wait, or the getitem a wait reads) and the waits/views/copies (and ops in ``also``) that only
    unpack its result, in graph order."""
    chain = [first]
    for node in chain:
        for user in node.users:
            unpacks = user.target in _PACKING or user.target is WAIT or user.target in also
            if unpacks and user not in chain and all(a in chain for a in user.all_input_nodes):
                chain.append(user)
    return chain


def _completions(start: fx.Node) -> list[list[fx.Node]]:
    """One chain per result of a collective: its wait and what unpacks it (a coalesced collective has one per
    tensor, reached through ``getitem``)."""
    chains = []
    also = _ALL_TO_ALL_UNPACKING if start.target is _ALL_TO_ALL else frozenset()
    for user in start.users:
        if user.target is WAIT or user.target is operator.getitem:
            chains.append(_unpacking(user, also))
    return chains


def prefetch_limit(ctx: PassContext, prefetch_bytes: int | str, allgather_bytes: int | str) -> int:
    """``Config.prefetch_bytes``; ``"auto"``: two all-gather buckets (of ``Config.allgather_bucket_bytes``)."""
    if prefetch_bytes != "auto":
        return prefetch_bytes
    return 2 * bucket_limit(allgather_bytes, UNSHARD, ctx.cost_model)


def schedule(
    gm: fx.GraphModule, ctx: PassContext, *, prefetch_bytes: int | str = "auto", allgather_bytes: int | str = "auto"
) -> fx.GraphModule:
    """Issue collectives early (parameter prefetch capped), wait late, run optimizer updates inside backward.

    ``prefetch_bytes``: ``Config.prefetch_bytes``; ``allgather_bytes``: ``Config.allgather_bucket_bytes``."""
    if not ctx.distributed:
        return gm
    nodes = list(gm.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    anchor = {node: float(i) for i, node in enumerate(nodes)}
    starts = [n for n in nodes if is_collective(n)]
    packing = {s: _packing_inputs(s) for s in starts}
    unpacking = {s: _completions(s) for s in starts}  # per result: its wait and what unpacks it
    waits = {s: chains[0][0] for s, chains in unpacking.items() if len(chains) == 1}

    def external_inputs(start: fx.Node) -> list[fx.Node]:
        group = set(packing[start]) | {start}
        return [a for n in group for a in n.all_input_nodes if a not in group]

    def first_reader(start: fx.Node) -> float:
        group = {n for chain in unpacking[start] for n in chain}
        readers = [index[u] for n in group for u in n.users if u not in group]
        return min(readers, default=float(len(nodes)))

    # issue early; parameter gathers (inputs are graph inputs) within the prefetch cap
    def reads_only_graph_inputs(start: fx.Node) -> bool:
        inputs = external_inputs(start)
        return bool(inputs) and all(a.op == "placeholder" for a in inputs)

    prefetchable = [s for s in starts if reads_only_graph_inputs(s)]
    issued_asap = [s for s in starts if s not in prefetchable]

    def issue_early() -> None:
        for start in issued_asap:
            issue = max((anchor[a] for a in external_inputs(start)), default=-1.0)
            _place(anchor, [*packing[start], start], issue + _EPS)

    issue_early()
    _interleave_optimizer(nodes, anchor, starts, waits)
    _reload_late(nodes, anchor, {n for s in starts for n in packing[s]})
    _monotone(nodes, anchor)
    issue_early()  # gathers of updated parameters follow the optimizer work that moved into backward
    _place_prefetch(anchor, prefetchable, first_reader, prefetch_limit(ctx, prefetch_bytes, allgather_bytes))
    _monotone(nodes, anchor)
    _wait_late(anchor, starts, unpacking)
    _monotone(nodes, anchor)
    ordered = sorted(nodes, key=lambda n: (anchor[n], index[n]))
    _reorder(gm.graph, ordered)
    return gm


def _wait_late(anchor: dict, starts: list[fx.Node], unpacking: dict) -> None:
    """Wait late: each wait and its unpacking right before the first reader of that result; a reduce-scatter's
    before the next is issued: its whole input (and on gloo, where it is an all-to-all, its W chunks) is held until
    the wait — NCCL keeps a collective's input alive until it is waited for — so at most one gradient bucket is
    held whole."""
    scatters = sorted((s for s in starts if s.target in (_ALL_TO_ALL, _REDUCE_SCATTER)), key=anchor.__getitem__)
    next_issue = {s: [anchor[t]] for s, t in zip(scatters, scatters[1:])}
    for start in reversed(starts):
        for chain in unpacking[start]:
            group = set(chain)
            readers = [anchor[u] for n in chain for u in n.users if u not in group]
            if readers:
                for i, node in enumerate(chain):
                    anchor[node] = min(readers + next_issue.get(start, [])) - _EPS * (len(chain) - i)


def _place(anchor: dict, chain: list[fx.Node], position: float) -> None:
    """Anchor ``chain`` (in its order) just after ``position``; never later than where it is."""
    for i, node in enumerate(chain):
        anchor[node] = min(anchor[node], position + _EPS * 1e-3 * (i + 1))


def _place_prefetch(anchor: dict, gathers: list, first_reader: Callable, limit: int) -> None:
    """Issue parameter gathers in the order they are read, each as soon as the gathers between its issue and
    its read fit, with it, in ``limit`` bytes (a gather alone over the limit is issued right before its read)."""
    by_use = sorted(gathers, key=first_reader)
    sizes = [tensor_bytes(g.meta["val"]) for g in by_use]
    for i, start in enumerate(by_use):
        held, j = sizes[i], i
        while j > 0 and held + sizes[j - 1] <= limit:
            held += sizes[j - 1]
            j -= 1
        if held > limit:
            position = first_reader(start) - 0.5
        else:  # gathers j..i are in flight or unread together; issue once gather j-1 has been read
            position = first_reader(by_use[j - 1]) if j > 0 else -1.0
        _place(anchor, [*_packing_inputs(start), start], position + _EPS * 1e-2 * i)


def _interleave_optimizer(nodes: list, anchor: dict, starts: list, waits: dict) -> None:
    """Optimizer work that needs reduction k (and none later) goes right before reduction k+1 is issued."""
    reductions = [s for s in starts if s.meta.get(PHASE) == BACKWARD and s.target in _REDUCTIONS]
    if len(reductions) < 2:
        return
    reduction_of_wait = {waits[s]: k for k, s in enumerate(reductions)}
    needs: dict[fx.Node, int] = {}
    for node in nodes:
        k = max([reduction_of_wait.get(node, -1), *(needs.get(a, -1) for a in node.all_input_nodes)])
        needs[node] = k
        if node.meta.get(PHASE) == OPTIMIZER and node.op == "call_function" and 0 <= k < len(reductions) - 1:
            anchor[node] = min(anchor[node], anchor[reductions[k + 1]] - 0.5)


def _reload_late(nodes: list, anchor: dict, packing: set) -> None:
    """A reload that feeds no collective (an optimizer state's or a parameter shard's for its update) goes right
    before its first reader, wherever that moved: it reads only a graph input, and the offload tier reads its
    bytes ahead on its own thread (within ``Config.prefetch_bytes``), so the value is held only from there."""
    for node in nodes:
        if node.target is RELOAD and node not in packing and node.users:
            anchor[node] = min(anchor[u] for u in node.users) - _EPS * 1e-3


def _monotone(nodes: list, anchor: dict) -> None:
    """Make anchors non-decreasing along every edge (in the original topological order)."""
    for node in nodes:
        for arg in node.all_input_nodes:
            if anchor[arg] >= anchor[node]:
                anchor[node] = anchor[arg] + _EPS * 1e-6


def _reorder(graph: fx.Graph, ordered: list[fx.Node]) -> None:
    """Move the graph's nodes into ``ordered`` (placeholders stay first, the output last)."""
    body = [n for n in ordered if n.op not in ("placeholder", "output")]
    cursor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for node in body:
        cursor.append(node)
        cursor = node
