"""Lowering for the update on the host: each parameter's Adam / AdamW update, captured op by op (zgraph's update
rule, ``zgraph.capture.update_rules``), replaced by one call of torch's fused CPU kernel (``torch._fused_adamw_`` /
``torch._fused_adam_``, what ``torch.optim.AdamW(fused=True)`` runs on CPU tensors), as a backend rewrite of the
graph ``host_partitions`` then cuts.

The op-by-op update reads each element of the parameter and its two moments eight times in as many passes; the
fused kernel reads and writes each once, vectorized (``benchmarks/host_adam.py`` measures both). Its arithmetic is
the same up to rounding (``exp_avg_sq * beta2 + (1 - beta2) * g * g`` in one expression, ``param - step_size *
exp_avg / denom``...): the update on the host is then bitwise eager ``AdamW(fused=True)`` on the CPU, not the
single-tensor ``AdamW`` — within the distance torch's own tests accept between the two. An optimizer built with
``fused=False`` keeps the op-by-op update (the capture marks its nodes ``EXACT``): bitwise eager's for-loop step.

**What is matched**, for one parameter, from the ``addcdiv`` that writes it (in place or not, any other shape
refuses the match and leaves the ops as they are):

    p1   = mul(p, 1 - lr * weight_decay)              (AdamW with weight decay; else p1 = p)
    m1   = lerp(m, g, float32(1 - beta1))
    v1   = addcmul(mul(v, beta2), g, g, value=1 - beta2)
    step = add(step0, 1)                               (one float32 counter)
    out  = addcdiv(p1, m1, add(div(sqrt(v1), (1 - beta2 ** step) ** 0.5), eps), value=-lr / (1 - beta1 ** step))

every hyper-parameter the group's own graph input, the four tensors float32 or float64 of one shape, contiguous.
``g`` is whatever the chain reads: a clipped, unscaled or widened gradient, Adam's ``g + weight_decay * p`` or
``maximize``'s ``-g`` (computed op by op before the kernel, which then has no decay of its own to apply).
The kernel then updates ``p``, ``m``, ``v`` themselves where the chain did so in place, else fresh copies of them
(a chain kept functional: the skipped step of fp16 loss scaling still chooses between old and new values after; a
ZeRO-1/2 shard sliced from a whole master is all-gathered from its copy).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

from zgraph.graph import CUSTOM, INPUT, OPTIMIZER, PHASE, VAL, eliminate_dead_code
from zgraph.host_ops import EXACT, HOST, PLACE

_FLOATS = (torch.float32, torch.float64)


@torch.fx.node.has_side_effect
def host_adam(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Tensor,
    hyper: list[Tensor],
    decoupled: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """One parameter's Adam (``decoupled``: AdamW) step by torch's fused CPU kernel, in place on ``param``,
    ``exp_avg`` and ``exp_avg_sq``; ``step`` already counts it. ``hyper``: lr, beta1, beta2, eps, weight_decay
    (0-d host tensors, as the graph reads them). Returns the three tensors it updated."""
    lr, beta1, beta2, eps, weight_decay = (t.item() for t in hyper)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(
        [param],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [],
        [step],
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay if decoupled else 0.0,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )
    return param, exp_avg, exp_avg_sq


@dataclass
class _Match:
    """One parameter's matched update: the roots it reads, the nodes it makes, what it returns."""

    out: fx.Node  # the addcdiv: the new parameter
    m1: fx.Node  # the lerp: the new exp_avg
    v1: fx.Node  # the addcmul: the new exp_avg_sq
    roots: tuple[fx.Node, fx.Node, fx.Node]  # p, m, v
    in_place: tuple[bool, bool, bool]  # whether the chain updated each root in place
    grad: fx.Node
    step: fx.Node
    hyper: list[fx.Node]  # lr, beta1, beta2, eps, weight_decay placeholders
    decoupled: bool
    chain: list[fx.Node]  # every node the kernel replaces, in graph order
    scalars: list[fx.Node]  # the chain's scalar arithmetic (bias corrections...), erased where nothing else reads it


def fuse_host_adam(gm: fx.GraphModule) -> int:
    """Replace every matched host Adam / AdamW update (module docstring) by ``host_adam``; returns how many."""
    hparams = {n: n.meta[INPUT] for n in gm.graph.nodes if n.op == "placeholder" and n.meta[INPUT].kind == "hparam"}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    matches = []
    for node in gm.graph.nodes:
        if _name(node) == "addcdiv" and node.meta.get(PLACE) == HOST and node.meta.get(PHASE) == OPTIMIZER:
            match = _match(node, hparams, position)
            if match is not None:
                matches.append(match)
    for match in matches:
        _replace(gm, match)
    if matches:
        _erase_unread(gm, [n for m in matches for n in m.scalars])
        eliminate_dead_code(gm.graph)
        gm.recompile()
    return len(matches)


# ----------------------------------------------------------------------------------------------- matching
def _name(node: object) -> str | None:
    """An aten op's name without its in-place underscore (``mul_`` and ``mul``: ``mul``)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    return target._schema.name.split("::")[-1].rstrip("_") or None


def _in_place(node: fx.Node) -> bool:
    return node.target._schema.name.endswith("_")


def _is(node: object, name: str, nargs: int | None = None) -> bool:
    return _name(node) == name and (nargs is None or len(node.args) == nargs)


def _hp(node: object, field: str, hparams: dict, group: list) -> bool:
    """``node`` is the hyper-parameter ``field`` of the one group the match reads (the first fixes it)."""
    spec = hparams.get(node)
    if spec is None or spec.field != field:
        return False
    key = (spec.optimizer, spec.group)
    if not group:
        group.append(key)
    return group[0] == key


def _rsub_one(node: object) -> fx.Node | None:
    """``x`` for ``node = 1 - x`` (``rsub(x, 1)``)."""
    return node.args[0] if _is(node, "rsub", 2) and node.args[1] == 1 and not node.kwargs else None


def _cast(node: object, dtype: torch.dtype) -> fx.Node | None:
    if _is(node, "_to_copy", 1) and set(node.kwargs) == {"dtype"} and node.kwargs["dtype"] == dtype:
        return node.args[0]
    return None


def _power_of(node: object, field: str, hparams: dict, group: list) -> fx.Node | None:
    """The step counter ``s`` for ``node = 1 - hp ** float64(s)``."""
    power = _rsub_one(node)
    if not _is(power, "pow", 2) or not _hp(power.args[0], field, hparams, group):
        return None
    return _cast(power.args[1], torch.float64)


def _scalar_of(node: object) -> fx.Node | None:
    """``x`` for ``node = x.item()``."""
    return node.args[0] if _is(node, "_local_scalar_dense", 1) else None


def _match(out: fx.Node, hparams: dict, position: dict) -> _Match | None:
    """The update of one parameter whose new value ``out`` (an ``addcdiv``) makes, or None."""
    if (out.meta.get(CUSTOM) or {}).get(EXACT) or len(out.args) != 3 or set(out.kwargs) != {"value"}:
        return None
    group: list = []
    p1, m1, denom = out.args
    # value = -(lr / (1 - beta1 ** step))
    negated = _scalar_of(out.kwargs["value"])
    ratio = negated.args[0] if _is(negated, "neg", 1) else None
    if not _is(ratio, "div", 2) or not _hp(ratio.args[0], "lr", hparams, group):
        return None
    step64 = _power_of(ratio.args[1], "beta1", hparams, group)
    # m1 = lerp(m, g, float32(1 - beta1))
    if not _is(m1, "lerp", 3) or m1.kwargs or _rsub_one(_cast(m1.args[2], torch.float32)) is None:
        return None
    if not _hp(_rsub_one(_cast(m1.args[2], torch.float32)), "beta1", hparams, group):
        return None
    m, grad = m1.args[0], m1.args[1]
    # denom = sqrt(v1) / (1 - beta2 ** step) ** 0.5 + eps
    added = denom if _is(denom, "add", 2) and not denom.kwargs and _hp(denom.args[1], "eps", hparams, group) else None
    divided = added.args[0] if added is not None else None
    if not _is(divided, "div", 2) or not _is(divided.args[0], "sqrt", 1):
        return None
    root = divided.args[1]
    if not _is(root, "pow", 2) or root.args[1] != 0.5 or _power_of(root.args[0], "beta2", hparams, group) is None:
        return None
    if _power_of(root.args[0], "beta2", hparams, group) is not step64 or step64 is None:
        return None
    v1 = divided.args[0].args[0]
    # v1 = addcmul(mul(v, beta2), g, g, value=(1 - beta2).item())
    if not _is(v1, "addcmul", 3) or v1.args[1] is not grad or v1.args[2] is not grad or set(v1.kwargs) != {"value"}:
        return None
    if not _hp(_rsub_one(_scalar_of(v1.kwargs["value"])), "beta2", hparams, group):
        return None
    decayed_v = v1.args[0]
    if not _is(decayed_v, "mul", 2) or not _hp(decayed_v.args[1], "beta2", hparams, group):
        return None
    # step = add(step0, 1)
    step = step64
    if not _is(step, "add", 2) or step.args[1] != 1 or step.kwargs:
        return None
    # p1 = mul(p, 1 - lr * weight_decay), or p
    decay = _rsub_one(p1.args[1]) if _is(p1, "mul", 2) and isinstance(p1.args[1], fx.Node) else None
    decoupled = _is(decay, "mul", 2) and _hp(decay.args[0], "lr", hparams, group)
    if decoupled and not _hp(decay.args[1], "weight_decay", hparams, group):
        return None
    p = p1.args[0] if decoupled else p1
    hyper = _hyper(hparams, group[0])
    if hyper is None or not _tensors_fit(p, grad, m, decayed_v.args[0], step):
        return None
    chain = [n for n in (p1 if decoupled else None, m1, decayed_v, v1, divided.args[0], divided, added, out) if n]
    if not _private(chain, out, (m1, v1), position):
        return None
    in_place = _all_or_none([p1, out] if decoupled else [out]), _all_or_none([m1]), _all_or_none([decayed_v, v1])
    if None in in_place:
        return None
    scalars = _inputs_upto(
        [out.kwargs["value"], root, v1.kwargs["value"], m1.args[2]] + ([decay] if decoupled else []), step
    )
    return _Match(out, m1, v1, (p, m, decayed_v.args[0]), in_place, grad, step, hyper, decoupled, chain, scalars)


def _inputs_upto(nodes: list[fx.Node], step: fx.Node) -> list[fx.Node]:
    """``nodes`` and what they compute from, up to the hyper-parameters and the step counter (not included)."""
    seen: dict[fx.Node, None] = {}
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node in seen or node is step or node.op != "call_function":
            continue
        seen[node] = None
        todo.extend(node.all_input_nodes)
    return list(seen)


def _all_or_none(chain: list[fx.Node]) -> bool | None:
    """Whether the chain updates its root in place (True: every op), or makes a new tensor (False: its first op,
    the rest may update that temporary); None where it updates the root and then leaves it (no match)."""
    if not _in_place(chain[0]):
        return False
    return True if all(_in_place(n) for n in chain) else None


def _hyper(hparams: dict, key: tuple) -> list[fx.Node] | None:
    """The group's lr, beta1, beta2, eps, weight_decay placeholders (weight_decay may be absent: none needed)."""
    by_field = {s.field: n for n, s in hparams.items() if (s.optimizer, s.group) == key}
    fields = ("lr", "beta1", "beta2", "eps", "weight_decay")
    return [by_field[f] for f in fields] if all(f in by_field for f in fields) else None


def _tensors_fit(p: fx.Node, grad: fx.Node, m: fx.Node, v: fx.Node, step: fx.Node) -> bool:
    """The kernel's operands: one float dtype and shape, contiguous; a 0-d float32 step counter."""
    vals = [n.meta.get(VAL) if isinstance(n, fx.Node) else None for n in (p, grad, m, v)]
    if not all(isinstance(t, Tensor) and t.device.type == "cpu" for t in vals):
        return False
    first = vals[0]
    same = all(t.dtype == first.dtype and t.shape == first.shape and t.is_contiguous() for t in vals)
    counter = step.meta.get(VAL)
    plain = isinstance(counter, Tensor) and counter.dim() == 0 and counter.dtype == torch.float32
    return same and first.dtype in _FLOATS and plain


def _private(chain: list[fx.Node], out: fx.Node, kept: tuple[fx.Node, ...], position: dict) -> bool:
    """Nothing outside the chain reads its temporaries, and what reads the new moments reads them after ``out``."""
    inside = set(chain)
    for node in chain:
        outside = [u for u in node.users if u not in inside]
        if node is out or node in kept:
            if any(position[u] < position[out] for u in outside):
                return False
        elif outside:
            return False
    return True


# ---------------------------------------------------------------------------------------------- rewriting
def _replace(gm: fx.GraphModule, match: _Match) -> None:
    """``host_adam`` before the match's ``addcdiv`` on its roots (or fresh copies), its results in the chain's
    place, the chain erased."""
    graph = gm.graph
    with graph.inserting_before(match.out):
        targets = []
        for root, in_place in zip(match.roots, match.in_place):
            target = root if in_place else graph.call_function(torch.ops.aten.clone.default, (root,))
            if target is not root:
                _mark(target, root.meta[VAL])
            targets.append(target)
        p, m, v = targets
        args = (p, match.grad, m, v, match.step, match.hyper, match.decoupled)
        fused = graph.call_function(host_adam, args)
        results = [graph.call_function(operator.getitem, (fused, k)) for k in range(3)]
    _mark(fused, tuple(n.meta[VAL] for n in (match.out, match.m1, match.v1)))
    for node, result in zip((match.out, match.m1, match.v1), results):
        _mark(result, node.meta[VAL])
        node.replace_all_uses_with(result, delete_user_cb=lambda user: user not in match.chain)
    for node in reversed(match.chain):
        graph.erase_node(node)


def _erase_unread(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    """Erase those of ``nodes`` nothing reads any more (0-d arithmetic made in place, ``.item()``: dead-code
    elimination keeps them), readers first."""
    left = set(nodes)
    for node in reversed(list(gm.graph.nodes)):
        if node in left and not node.users:
            gm.graph.erase_node(node)


def _mark(node: fx.Node, val: object) -> None:
    node.meta.update({VAL: val, PLACE: HOST, PHASE: OPTIMIZER})
