"""``bucket``: merge layout operators of one kind into buckets, so many small collectives become few large ones.

Plan first, then rewrite. The planner walks the ``unshard`` nodes (all-gathers), then the ``reduce_shard``
nodes (reduce-scatters), then the ``reduce`` nodes (all-reduces), each in graph order, and grows a bucket with
the next node while all of these hold:

- same kind, process group, world size and dtype, and same phase (a forward gather never waits in a bucket
  with a backward one: that would keep it alive across the two); for gathers also the same phase of the last
  reader (a gather ``shard_params`` kept for the backward never holds a forward-only one alive with it);
- the bucket's bytes (of the whole tensors) stay within ``Config.allgather_bucket_bytes`` (gathers) or
  ``Config.reduce_bucket_bytes`` (reductions); ``"auto"`` asks the cost model for the smallest size whose
  latency is a tenth of its transfer time (at least ``MIN_AUTO_BYTES``), and for reductions caps it at a quarter
  of all the gradient bytes (``overlap_limit``), so that the buckets reduced first overlap the rest of backward;
- the merged collective has a legal place: every member's input is computed before the first use of any
  member's output.

Safety: the plan depends only on the graph and on numbers every rank has identically (the config, and the
cost model, which rank 0 measures and broadcasts), and the planner is deterministic, so every rank builds the
same buckets in the same order and issues the same collectives. A bucket of one is left as it was.

Rewrite: each bucket becomes one ``zgraph::*_bucket`` node placed right before the first use of any member's
output; members' users read their element of it. Bucket nodes carry ``meta[BUCKET]`` (members, bytes)
for ``explain()``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from zgraph.graph import BUCKET, PHASE, CostModel, fake_mode, insert, tensor_bytes
from zgraph.ops import BUCKETED, REDUCE, REDUCE_SHARD, RELOAD, UNSHARD
from zgraph.passes.graph_utils import CASTS, SIMPLE_VIEWS
from zgraph.passes.pass_list import PassContext

# "auto" sizes: never below MIN_AUTO_BYTES from the cost model. Below a few MiB each collective's fixed host-side
# costs (issue, pack, wait, unpack) outweigh what smaller buckets gain: on gloo (2 ranks, bench GPT, alternated
# steps) ZeRO-1 ran 1.16x DDP with 1 MiB buckets, 1.08x with 4 MiB and 16 MiB (benchmarks/README.md); NCCL's
# cost model asks for more than this anyway.
MIN_AUTO_BYTES = 4 * 1024 * 1024
MAX_AUTO_BYTES = 256 * 1024 * 1024
MIN_OVERLAP_BYTES = 256 * 1024  # the smallest reduction bucket overlap_limit splits into
REDUCTION_BUCKETS = 4  # "auto" gradient reductions: at least this many buckets where they are big enough


@dataclass(frozen=True)
class Bucket:
    """Layout operators of one kind merged into one collective."""

    kind: object
    members: tuple[fx.Node, ...]
    nbytes: int


def _nbytes(node: fx.Node) -> int:
    return tensor_bytes(node.meta["val"] if node.target is UNSHARD else node.args[0].meta["val"])


def _collective_kind(target: object) -> str:
    return "all_gather_into_tensor" if target is UNSHARD else "reduce_scatter_tensor"


def bucket_limit(value: int | str, target: object, cost_model: CostModel | None) -> int:
    """The bucket size in bytes for a kind of layout operator (0: no bucketing); ``value`` is the configured size
    (``Config.allgather_bucket_bytes`` / ``reduce_bucket_bytes``), ``"auto"`` sized from ``cost_model``."""
    if value != "auto":
        return value
    kind = _collective_kind(target) if target is not REDUCE else "all_reduce"
    auto = cost_model.bucket_bytes(kind) if cost_model is not None else 16 * 1024 * 1024
    return max(MIN_AUTO_BYTES, min(MAX_AUTO_BYTES, auto))


def overlap_limit(gm: fx.GraphModule, target: object, limit: int) -> int:
    """An ``"auto"`` gradient-reduction bucket size no larger than a ``REDUCTION_BUCKETS``-th of all the graph's
    ``target`` reductions (never below ``MIN_OVERLAP_BYTES``): one bucket of every gradient could only be issued
    once backward has produced the last of them, so none of its transfer would overlap backward."""
    total = sum(_nbytes(n) for n in gm.graph.nodes if n.target is target)
    return min(limit, max(MIN_OVERLAP_BYTES, -(-total // REDUCTION_BUCKETS)))


# Cheap ops that only re-view or re-type one value: they can follow a merged collective wherever it lands.
_FOLLOWERS = CASTS | SIMPLE_VIEWS | {operator.getitem}


def _follows(user: fx.Node, node: fx.Node) -> bool:
    """``user`` only re-views or re-types ``node`` (it moves along with a bucket)."""
    return user.target in _FOLLOWERS and user.all_input_nodes == [node]


# What may sit between a graph input and a bucket that reads it: those, and an offloaded input's reload.
_HOISTABLE = _FOLLOWERS | {RELOAD}


def _hoistable(node: fx.Node) -> bool:
    """``node`` only re-views, re-types or reloads a graph input (e.g. a parameter shard cast to the compute
    dtype, or read back from the offload tier): it can be computed as early as needed, before a bucket that
    reads it."""
    while node.op != "placeholder":
        if node.target not in _HOISTABLE or len(node.all_input_nodes) != 1:
            return False
        node = node.all_input_nodes[0]
    return True


def _hoisted_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes of ``node``'s hoistable input chains (not the graph inputs), parents first."""
    out: list[fx.Node] = []
    for arg in node.all_input_nodes:
        if arg.op != "placeholder" and _hoistable(arg):
            out.extend(_hoisted_inputs(arg))
            out.append(arg)
    return out


def _followers(node: fx.Node) -> list[fx.Node]:
    """The chains of ``_follows`` users hanging from ``node``, in no particular order."""
    out = []
    for user in node.users:
        if _follows(user, node):
            out.append(user)
            out.extend(_followers(user))
    return out


def plan_buckets(gm: fx.GraphModule, limits: dict[object, int]) -> list[Bucket]:
    """The buckets to build, in the order their collectives will be issued (deterministic); ``limits``: bytes per
    bucket for each layout operator (``UNSHARD``, ``REDUCE_SHARD``, ``REDUCE``)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    end = len(order)

    def ready(node: fx.Node) -> int:
        return max((-1 if _hoistable(a) else order[a] for a in node.all_input_nodes), default=-1)

    def first_use(node: fx.Node) -> int:
        return min((first_use(u) if _follows(u, node) else order[u] for u in node.users), default=end)

    def last_use(node: fx.Node) -> int:
        return max((last_use(u) if _follows(u, node) else order[u] for u in node.users), default=-1)

    nodes = list(order)

    def key(node: fx.Node) -> tuple:
        val = node.args[0].meta["val"]
        common = tuple(a for i, a in enumerate(node.args) if i > 1 or (i == 1 and node.target is not UNSHARD))
        held = nodes[last_use(node)].meta.get(PHASE) if node.target is UNSHARD and node.users else None
        return (common, val.dtype, node.meta.get(PHASE), held)

    plans = []
    for target in (UNSHARD, REDUCE_SHARD, REDUCE):
        limit = limits[target]
        if limit == 0:
            continue
        members: list[fx.Node] = []
        nbytes = latest_input = 0
        earliest_use = end
        for node in (n for n in gm.graph.nodes if n.target is target):
            size = _nbytes(node)
            fits = (
                members
                and key(node) == key(members[0])
                and nbytes + size <= limit
                and max(latest_input, ready(node)) < min(earliest_use, first_use(node))
            )
            if not fits:
                if len(members) > 1:
                    plans.append(Bucket(target, tuple(members), nbytes))
                members, nbytes, latest_input, earliest_use = [], 0, -1, end
            members.append(node)
            nbytes += size
            latest_input = max(latest_input, ready(node))
            earliest_use = min(earliest_use, first_use(node))
        if len(members) > 1:
            plans.append(Bucket(target, tuple(members), nbytes))
    return plans


def bucket(
    gm: fx.GraphModule, ctx: PassContext, *, allgather_bytes: int | str = "auto", reduce_bytes: int | str = "auto"
) -> fx.GraphModule:
    """Merge same-kind collectives into buckets (bytes capped by config or by the cost model).

    ``allgather_bytes`` / ``reduce_bytes``: ``Config.allgather_bucket_bytes`` / ``reduce_bucket_bytes``."""
    if not ctx.distributed:
        return gm
    mode = fake_mode(gm)
    limits = {
        UNSHARD: bucket_limit(allgather_bytes, UNSHARD, ctx.cost_model),
        REDUCE_SHARD: bucket_limit(reduce_bytes, REDUCE_SHARD, ctx.cost_model),
        REDUCE: bucket_limit(reduce_bytes, REDUCE, ctx.cost_model),
    }
    if reduce_bytes == "auto":
        for target in (REDUCE_SHARD, REDUCE):
            limits[target] = overlap_limit(gm, target, limits[target])
    for plan in plan_buckets(gm, limits):
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        followers = {f for m in plan.members for f in _followers(m)}
        users = [u for n in (*plan.members, *followers) for u in n.users if u not in followers]
        anchor = min(users, key=order.__getitem__)
        first = plan.members[0]
        inputs = [m.args[0] for m in plan.members]
        if plan.kind is UNSHARD:
            args = (inputs, [m.args[1] for m in plan.members], *first.args[2:])
        else:
            args = (inputs, *first.args[1:])
        for chain_node in [n for m in plan.members for n in _hoisted_inputs(m)]:
            if order[chain_node] > order[anchor]:
                anchor.prepend(chain_node)  # a cast of a shard the bucket reads: computed before it
        merged = insert(gm, BUCKETED[plan.kind], args, before=anchor, phase=first.meta.get(PHASE), mode=mode)
        merged.meta[BUCKET] = {
            "members": [m.args[0].name for m in plan.members],
            "bytes": plan.nbytes,
        }
        for i, member in enumerate(plan.members):
            with gm.graph.inserting_after(merged):
                item = gm.graph.call_function(operator.getitem, (merged, i))
            item.meta.update(val=merged.meta["val"][i], phase=member.meta.get(PHASE))
            member.replace_all_uses_with(item)
            gm.graph.erase_node(member)
        for follower in sorted(followers, key=order.__getitem__):  # they now read the bucket: move after it
            anchor.prepend(follower)
    return gm
