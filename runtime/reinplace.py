"""Updates in place for the eager backend: the optimizer writes into its state as ``torch.optim`` does.

The pass list's graphs are functional: an optimizer step makes new parameter and state tensors while the old ones,
still referenced by the model and the optimizer, stay alive until the step returns — twice the optimizer's memory
at the end of every step, and fresh allocations each call. Inductor removes this itself; for the FX executor this
rewrite does, on the final graph only:

For every state output (parameter, gradient, buffer, optimizer state) whose value is computed by a chain
``x1 = op1(P, ...)``, ``x2 = op2(x1, ...)``, ..., ``out = opk(x_{k-1}, ...)`` starting at the *same* state's input
``P``, where every op has an in-place form (``mul`` → ``mul_``...), keeps ``P``'s shape and dtype, each
intermediate has no other reader, and nothing reads ``P`` after ``op1``: the chain becomes in-place on ``P``.
The output is then the input tensor itself, updated, and writing it back is free. An offloaded optimizer state
(``zgraph::reload`` ... ``zgraph::write_back``) is updated in place on the buffer its reload made. Anything else
(where the old value is still needed, a dtype change, ``where`` for skipped fp16 steps) stays functional.

``reinplace_all_reduces`` does the same for collectives: a functional ``all_reduce`` copies its input before
reducing it; where the input is a temporary nothing else reads (a bucket ``_chunk_cat`` packed, a gradient made
contiguous), it is reduced in place (``all_reduce_``) — one copy and one allocation of the bucket less per step.

``fresh_copies`` gives every functional ``copy(self, src)`` left a buffer of ``self``'s size. The aten kernel clones
``self``'s whole storage and returns the view of the clone that ``self`` is (``clone_preserve_strides``): for the
optimizer's write-back of a ZeRO shard, ``copy(slice(param), new)``, that is a whole parameter allocated for a
shard (and held until the all-gather that sends the shard completes), where only ``self``'s shape, strides, dtype
and device matter. For a contiguous ``self``, ``copy_(empty(...), src)`` computes the same values in a buffer the
size of the result, as the graph's fake values already assume.

``reinplace_temporaries``: a pointwise op whose first argument is a temporary that nothing else reads (the
optimizer's ``sqrt(v) / c + eps``, a residual gradient's ``add``) writes its result into that temporary, as
``torch.optim``'s ``add_`` does, instead of allocating a fresh tensor. A pointwise kernel computes each element
the same way in place, so the numbers are bitwise the same.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from zgraph.graph import (
    INPUT,
    OFFLOADED,
    OUTPUTS,
    PHASE,
    STATE_KINDS,
    UPDATED_INPUTS,
    fake_mode,
    insert,
    output_node,
    state_key,
)
from zgraph.ops import RELOAD, WRITE_BACK
from zgraph.sizes import same_shape


def _inplace_variant(target: object) -> object | None:
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    name = target._schema.name.split("::")[-1]
    if name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name + "_", None)
    if packet is None:
        return None
    return getattr(packet, target._overloadname, None)


def reinplace_state_updates(gm: fx.GraphModule, only: Callable[[fx.Node], bool] | None = None) -> list[int]:
    """Rewrite ``gm`` in place as described above (only chains whose every op ``only`` accepts, if given); returns
    the output positions that are now updated inputs."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    placeholders = {
        state_key(n.meta[INPUT]): n
        for n in gm.graph.nodes
        if n.op == "placeholder" and n.meta[INPUT].kind in STATE_KINDS
    }
    reloads = {n.args[1]: n for n in gm.graph.nodes if n.target is RELOAD}
    output = output_node(gm)
    values = list(output.args[0])
    updated = []
    for position, (value, role) in enumerate(zip(values, output.meta[OUTPUTS])):
        source = placeholders.get(state_key(role))
        if role.kind == OFFLOADED and isinstance(value, fx.Node) and value.target is WRITE_BACK:
            # an offloaded state: its update can run in place on the buffer its reload made (the graph owns it)
            source, value = reloads.get(value.args[1]), value.args[0]
        if source is None or not isinstance(value, fx.Node):
            continue
        chain = _chain(source, value, values)
        if chain is None or (only is not None and not all(only(node) for node in chain)):
            continue
        first = chain[0]
        if any(order[r] > order[first] for r in _readers(source) if r is not first):
            continue  # the old value (or a view of it, or a collective still sending it) is read afterwards
        for node in chain:
            node.target = _inplace_variant(node.target)
        if role.kind != OFFLOADED:
            updated.append(position)
    gm.recompile()
    return updated


_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
_ALL_REDUCE_ = torch.ops._c10d_functional.all_reduce_.default


def reinplace_all_reduces(gm: fx.GraphModule) -> int:
    """Turn ``all_reduce(x)`` into ``all_reduce_(x)`` where ``x`` is a contiguous temporary only the collective
    reads (``x``, or the one value it is a view of, is computed by a non-aliasing op and has no other reader);
    returns how many were rewritten."""
    count = 0
    for node in gm.graph.nodes:
        if node.target is not _ALL_REDUCE:
            continue
        x = node.args[0]
        base = x.args[0] if x.target is torch.ops.aten.view.default else x
        only_reader = list(x.users) == [node] and (base is x or list(base.users) == [x])
        val = x.meta.get("val")
        if (
            only_reader
            and base.op == "call_function"
            and not _aliases(base)
            and isinstance(val, torch.Tensor)
            and val.is_contiguous()
        ):
            node.target = _ALL_REDUCE_
            count += 1
    gm.recompile()
    return count


# ops whose result shares its input's memory though their schema declares no alias
_UNDECLARED_VIEWS = (torch.ops.aten._unsafe_view.default,)


def _aliases(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem or target in _UNDECLARED_VIEWS:
        return True
    return isinstance(target, torch._ops.OpOverload) and any(r.alias_info for r in target._schema.returns)


def _readers(source: fx.Node) -> list[fx.Node]:
    """Every node that reads ``source``'s memory: its users, the users of views of it, and the waits of
    collectives sending it (an asynchronous collective reads its input until its wait)."""
    out = []
    frontier = list(source.users)
    while frontier:
        node = frontier.pop()
        out.append(node)
        if _aliases(node) or (
            isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "_c10d_functional"
        ):
            frontier.extend(node.users)
    return out


def _chain(source: fx.Node, value: fx.Node, outputs: list) -> list[fx.Node] | None:
    """The ops from ``source`` (first argument of the first) to ``value``, each rewritable in place."""
    chain = []
    node = value
    want = source.meta["val"]
    while node is not source:
        if node.op != "call_function" or _inplace_variant(node.target) is None or not node.args:
            return None
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not same_shape(val.shape, want.shape) or val.dtype != want.dtype:
            return None
        if node is not value and (len(node.users) != 1 or node in outputs):
            return None
        chain.append(node)
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return None
    chain.reverse()
    return chain if chain else None


_COPY = torch.ops.aten.copy.default


def fresh_copies(gm: fx.GraphModule) -> int:
    """Rewrite ``copy(self, src)`` as ``copy_(empty(<self's shape>), src)`` where ``self`` is contiguous (see the
    module docstring); returns how many were rewritten."""
    mode = None
    count = 0
    for node in list(gm.graph.nodes):
        if node.target is not _COPY:
            continue
        self_ = node.args[0]
        val = self_.meta.get("val") if isinstance(self_, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not val.is_contiguous():
            continue
        mode = mode or fake_mode(gm)
        at = dict(before=node, phase=node.meta.get(PHASE), mode=mode)
        layout = {"dtype": val.dtype, "device": val.device}
        buffer = insert(gm, torch.ops.aten.empty.memory_format, (list(val.shape),), layout, **at)
        copied = insert(gm, torch.ops.aten.copy_.default, (buffer, *node.args[1:]), dict(node.kwargs), **at)
        node.replace_all_uses_with(copied)
        gm.graph.erase_node(node)
        count += 1
    gm.recompile()
    return count


def _temporary(node: fx.Node) -> bool:
    """``node`` is an aten op's fresh, contiguous result (no view or alias of another value)."""
    val = node.meta.get("val")
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "aten"
        and not _aliases(node)
        and isinstance(val, torch.Tensor)
        and val.is_contiguous()
    )


def reinplace_temporaries(gm: fx.GraphModule) -> int:
    """Turn ``y = op(x, ...)`` into ``op_(x, ...)`` where ``op`` is pointwise with an in-place form, ``x`` a
    temporary (``_temporary``) that only ``y`` reads, and ``y`` has ``x``'s shape, dtype and strides; returns how
    many were rewritten."""
    fresh: set[fx.Node] = set()  # rewritten ops: their result is still the temporary's own memory
    for node in gm.graph.nodes:
        inplace = _inplace_variant(node.target) if node.op == "call_function" else None
        tags = node.target.tags if inplace is not None else ()
        if torch.Tag.pointwise not in tags or torch.Tag.nondeterministic_seeded in tags or not node.args:
            continue
        x, val = node.args[0], node.meta.get("val")
        if not isinstance(x, fx.Node) or list(x.users) != [node] or not (x in fresh or _temporary(x)):
            continue
        if any(a is x for a in (*node.args[1:], *node.kwargs.values())):
            continue
        want = x.meta["val"]
        same = isinstance(val, torch.Tensor) and same_shape(val.shape, want.shape) and val.dtype == want.dtype
        if same and same_shape(val.stride(), want.stride()):
            node.target = inplace
            fresh.add(node)
    gm.recompile()
    return len(fresh)


def reinplace(gm: fx.GraphModule) -> fx.GraphModule:
    """The eager backend's rewrite: state updates, all-reduces and pointwise temporaries in place, functional copies
    into buffers of their own size (``gm.meta[UPDATED_INPUTS]``: the output positions that are now their own input,
    updated); in place, returns ``gm``."""
    updated = reinplace_state_updates(gm)
    reinplace_all_reduces(gm)
    fresh_copies(gm)
    reinplace_temporaries(gm)
    gm.meta[UPDATED_INPUTS] = frozenset(updated)
    return gm
