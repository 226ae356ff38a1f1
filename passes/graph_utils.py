"""Helpers the passes share: graph outputs and their roles, shard values, and pushing ``zgraph::shard``
through element-wise ops (inserting nodes and graph inputs: ``zgraph.graph``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from zgraph.graph import (
    OUTPUTS,
    PHASE,
    VAL,
    GraphOutput,
    ParamInfo,
    compute_val,
    eliminate_dead_code,
    fake_mode,
    insert,
    output_node,
    set_input_layout,
    shard_rows,
)
from zgraph.ops import SHARD, UNSHARD
from zgraph.sizes import same_shape

aten = torch.ops.aten


def outputs(gm: fx.GraphModule) -> list[tuple[Any, Any]]:
    """``[(value node, GraphOutput)]`` of the graph."""
    out = output_node(gm)
    return list(zip(out.args[0], out.meta[OUTPUTS]))


def set_outputs(gm: fx.GraphModule, items: Iterable[tuple[Any, Any]]) -> None:
    values, roles = zip(*items) if items else ((), ())
    out = output_node(gm)
    out.args = (tuple(values),)
    out.meta[OUTPUTS] = list(roles)


def shard_val(val: torch.Tensor, world_size: int) -> torch.Tensor:
    rows = shard_rows(val.shape[0], world_size)
    with val.fake_mode:
        return val.new_empty((rows, *val.shape[1:]))


def shard_input(
    gm: fx.GraphModule, node: fx.Node, info: ParamInfo, world_size: int, group: str, phase: str, mode: FakeTensorMode
) -> fx.Node:
    """Placeholder ``node`` now receives this rank's padded shard; what read it reads the whole tensor,
    all-gathered right after it (later passes move the gather)."""
    users = list(node.users)
    set_input_layout(node, "shard", shard_val(node.meta[VAL], world_size))
    whole = insert(gm, UNSHARD, (node, info.shape[0], world_size, group), after=node, phase=phase, mode=mode)
    for user in users:
        user.replace_input_with(node, whole)
    return whole


def shard_output(
    gm: fx.GraphModule,
    value: fx.Node,
    role: GraphOutput,
    world_size: int,
    rank: int,
    phase: str | None,
    mode: FakeTensorMode,
) -> tuple[fx.Node, GraphOutput]:
    """Output ``value`` is written back as this rank's shard: ``(shard(value), role with layout "shard")``."""
    piece = insert(gm, SHARD, (value, world_size, rank), before=output_node(gm), phase=phase, mode=mode)
    return piece, dataclasses.replace(role, layout="shard")


def use_regions(node: fx.Node, order: dict[fx.Node, int], skip: Any = None) -> list[list[fx.Node]]:
    """``node``'s readers (not the output node, nor those ``skip(user)`` is true for) in graph order, cut into
    *use regions*: maximal runs of readers within one phase (the forward's, the backward's, the optimizer's)."""
    uses = sorted(
        (u for u in node.users if u.op != "output" and not (skip and skip(u))),
        key=order.__getitem__,
    )
    regions: list[list[fx.Node]] = []
    for use in uses:
        if regions and regions[-1][-1].meta.get(PHASE) == use.meta.get(PHASE):
            regions[-1].append(use)
        else:
            regions.append([use])
    return regions


def insert_per_region(
    gm: fx.GraphModule, node: fx.Node, regions: list[list[fx.Node]], target: Any, args: tuple
) -> list[fx.Node]:
    """Insert ``target(*args)`` right before each region's first reader, in the region's phase, and make the
    region's readers read it instead of ``node``; returns the new nodes, one per region."""
    made = []
    for region in regions:
        new = insert(gm, target, args, before=region[0], phase=region[0].meta.get(PHASE))
        for use in region:
            use.replace_input_with(node, new)
        made.append(new)
    return made


# Ops that only re-view or re-type one tensor, shared by the passes that move such ops along with what they read.
CASTS = frozenset({aten._to_copy.default})
SIMPLE_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten.t.default, aten.slice.Tensor})
VIEWS = SIMPLE_VIEWS | {
    aten.transpose.int,
    aten.permute.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.split_with_sizes.default,
}


# Ops that act element by element without being tagged pointwise.
_ELEMENTWISE = {
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten._to_copy.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.copy.default,
}


def is_elementwise(node: fx.Node) -> bool:
    """An op whose output element ``k`` depends only on element ``k`` of its same-shaped tensor inputs (and on
    0-d tensors and scalars): it commutes with taking a dim-0 shard."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target not in _ELEMENTWISE and torch.Tag.pointwise not in target.tags:
        return False
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dim() == 0:
        return False
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            if val.dim() != 0 and not same_shape(val.shape, out.shape):
                return False
        elif not isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            return False
    return True


def _shard_arg(
    gm: fx.GraphModule, arg: Any, layout: tuple, anchor: fx.Node, shards: dict, work: list, mode: FakeTensorMode
) -> Any:
    """``shard(arg, *layout)`` (inserted before ``anchor`` once per argument) for a tensor argument with dims;
    ``arg`` itself for 0-d tensors and scalars."""
    if not (isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor) and arg.meta["val"].dim()):
        return arg
    if arg not in shards:
        shards[arg] = insert(gm, SHARD, (arg, *layout), before=anchor, mode=mode)
        work.append(shards[arg])
    return shards[arg]


def push_shards(gm: fx.GraphModule) -> None:
    """Move every ``shard(x)`` as far up as it goes, so the work it feeds runs on shards.

    Rules, applied until nothing changes:

    - ``shard(unshard(y))`` is ``y`` (both cut across the same ranks);
    - ``shard(f(x1, ..., xn))`` becomes ``f(shard(x1), ..., shard(xn))`` when ``f`` is element-wise
      (``is_elementwise``) and every user of ``f`` is a ``shard``: the work is then done on 1/N of the
      elements, and nothing whole is computed that no one reads. 0-d and scalar arguments stay as they are.
    """
    mode = fake_mode(gm)
    # The output node is detached while shards move and re-attached once: editing its arguments (every piece of
    # state) once per move would be quadratic. ``returned``: the nodes it reads, ``moved``: old -> new node.
    out = output_node(gm)
    values = out.args[0]
    returned = {v for v in values if isinstance(v, fx.Node)}
    moved: dict[fx.Node, fx.Node] = {}
    out.args = ((),)

    def replace(old: fx.Node, new: fx.Node) -> None:
        old.replace_all_uses_with(new)
        if old in returned:
            returned.add(new)
            moved[old] = new
        gm.graph.erase_node(old)

    work = [n for n in gm.graph.nodes if n.target is SHARD]
    while work:
        node = work.pop()
        if node._erased or node.target is not SHARD:
            continue
        source, world_size, rank = node.args
        if source.target is UNSHARD and source.args[2] == world_size:  # not hpZ's secondary shard of a gather
            replace(node, source.args[0])
            continue
        if source in returned or not is_elementwise(source) or any(u.target is not SHARD for u in source.users):
            continue
        if any(u.args[1:] != (world_size, rank) for u in source.users):
            continue
        # the sharded op takes the place of the whole one: before every reader of it, after its inputs
        anchor = source.next
        shards: dict[fx.Node, fx.Node] = {}
        args = tuple(_shard_arg(gm, a, (world_size, rank), anchor, shards, work, mode) for a in source.args)
        with gm.graph.inserting_before(anchor):
            replacement = gm.graph.call_function(source.target, args, dict(source.kwargs))
        replacement.meta = {k: v for k, v in source.meta.items() if k != VAL}
        compute_val(replacement, mode)
        for user in list(source.users):
            replace(user, replacement)
        gm.graph.erase_node(source)
    out.args = (tuple(_follow(v, moved) for v in values),)
    eliminate_dead_code(gm.graph)


def _follow(value: Any, moved: dict[fx.Node, fx.Node]) -> Any:
    while value in moved:
        value = moved[value]
    return value


def has_dead_code(gm: fx.GraphModule) -> bool:
    """Whether ``eliminate_dead_code`` may change ``gm``'s graph: a node nothing reads and without side effects
    (random operators counted among those, whichever way it decides them), or a subgraph (``get_attr`` of a
    ``GraphModule``, whose own dead code it removes too)."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), fx.GraphModule):
            return True
        if not node.users and not node.is_impure(impure_random=False):
            return True
    return False
