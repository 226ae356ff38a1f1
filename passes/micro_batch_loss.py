"""``micro_batch_loss``: how a pipelined step's losses and 0-d results combine over micro-batches into eager's value
on the whole batch (``Config.pipeline_parallel``), and the graph rewritten where that needs it.

The loss is what the backward is seeded with (``ones_like(loss)``). It is followed back through sums, differences
and constant factors to the reductions over the batch that make it (``sample_flow`` says which ops reduce over the
batch), each of one *kind*:

- ``mean``: a mean over every element (``.mean()``, ``mse_loss``, ...): micro-batches hold equal shares, so the
  whole batch's value is the micro-batches' average, and the gradient their gradients' sum over ``M``;
- ``sum``: a sum (``reduction="sum"``): the micro-batches' sum, gradients summed as they are;
- a mean over tokens: ``cross_entropy`` / ``nll_loss``'s mean over the labels not ``ignore_index`` (of which
  micro-batches hold different counts), or a sum divided by a count of labels (``cross_entropy``'s
  ``label_smoothing`` term, a masked mean written by hand; or over the number of labels less a count of ignored
  ones, ``m.numel() - m.sum()``: Hugging Face's ``LabelSmoother``). Where the count is made from the batch's inputs
  alone (``zgraph.passes.token_count``), the graph divides by the whole batch's count instead, a new input (kind
  ``batch_count``) the runtime counts before any micro-batch runs: each micro-batch's value is then its part of
  eager's sum, of kind ``sum``, and a step may add several (their counts counted apart) and sums. Else (labels made
  from activations) one ``nll_loss`` mean, kind ``token``: rewritten (``zgraph.passes.token_mean``) to each
  micro-batch's sum, and the count returned (``GraphOutput`` kind ``loss_count``): the whole batch's value is the
  sum of the sums over the sum of the counts, the gradient likewise (the runtime divides once all micro-batches'
  counts are known).

A value made without the batch (of parameters only) is the same on every micro-batch (kind ``same``). The step's
0-d results are combined by the same rule (``gm.meta[LOSS_COMBINE]``), but for one made by the optimizer phase
(the norm ``clip_grad_norm_`` returns: kind ``step``, made once, from the summed gradients); another result must
hold the samples along dim 0 (the runtime concatenates it). Refused (``PassError``, before anything runs): losses
of different kinds in one step, a sum scaled by the micro-batch size (``x.sum() / len(x)``, a mean written by
hand), two token means counted only by the forward, any other way of reaching the loss (a ratio of batch values not
over a count of labels), an op that combines samples otherwise (batch statistics, an in-batch contrastive loss:
``sample_flow``), and random draws (dropout).

Each backward seed is multiplied by the graph input ``loss_share`` (``LOSS_SHARE``, 0-d float32), which the runtime
feeds with the micro-batch's share of the whole batch (``1 / M`` for a mean, 1 otherwise): each value a
micro-batch's backward makes per sample is then eager's on the whole batch, and fp16 loss scaling overflows where
eager's does per sample (not at ``M``, or for a token mean a micro-batch's token count, times lower a scale). Not
where the backward returns a value of its own (``autograd.grad``'s result, a leaf input's ``.grad``), which the share
would scale (``LossCombine.shared`` False: the runtime divides the summed gradients instead).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from zgraph.errors import PassError
from zgraph.graph import (
    BACKWARD,
    OPTIMIZER,
    OUTPUTS,
    PHASE,
    VAL,
    GraphInput,
    GraphOutput,
    add_input,
    fake_mode,
    insert,
    output_node,
    output_roles,
)
from zgraph.passes.pass_list import PassContext
from zgraph.passes.sample_flow import named_arguments, sample_flow
from zgraph.passes.token_count import count_dtype, count_graph
from zgraph.passes.token_mean import MEAN, SUM, as_sum_over
from zgraph.sizes import same_size

aten = torch.ops.aten
LOSS_COMBINE = "zgraph_loss_combine"
"""``gm.meta``: the ``LossCombine``."""
_LINEAR = {aten.detach.default, aten.clone.default, aten.alias.default, aten._to_copy.default, aten.neg.default,
           aten.view.default, aten.reshape.default, aten.squeeze.default, aten.lift_fresh_copy.default}  # fmt: skip
_SCALED = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
_ADDED = {aten.add.Tensor, aten.sub.Tensor}
_NAMES = {"mean": "mean over samples", "sum": "sum", "token": "cross_entropy token mean", "counted": "token mean"}
_TOTALS = {aten.sum.default: "sum", aten.sum.dim_IntList: "sum", aten.mean.default: "mean", aten.mean.dim: "mean"}
LOSS_SHARE = GraphInput("loss_share", "loss_share", 0)
"""The graph input each backward seed is multiplied by: the micro-batch's share of the whole batch."""


@dataclass
class LossCombine:
    """``kind`` of the loss (``mean``, ``sum``, ``token``; ``mean`` for a step without one) and of each 0-d result
    (``results[index]``; also ``same`` and ``step``), which the runtime combines over micro-batches (see the
    module's docstring); the dtype of a token mean's count; whether the backward seeds read ``LOSS_SHARE``; each
    whole batch's count the graph reads (an input of kind ``batch_count``) with the graph counting it on a
    micro-batch (``zgraph.passes.token_count``)."""

    kind: str = "mean"
    results: dict[int, str] = field(default_factory=dict)
    count_dtype: torch.dtype = torch.float32
    shared: bool = False
    counts: list[tuple[GraphInput, fx.GraphModule]] = field(default_factory=list)


def micro_batch_loss(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Classify the loss and the 0-d results; a mean over tokens becomes a sum over the whole batch's count (an
    input), or returns its count; the backward seeds read the micro-batch's share."""
    flow, mixing = sample_flow(gm)
    walk = _Walk(gm, flow, mixing)
    seeds = [n for n in gm.graph.nodes if n.target is aten.ones_like.default and n.meta.get(PHASE) == BACKWARD]
    if not seeds and any(n.meta.get(PHASE) == BACKWARD for n in gm.graph.nodes):
        raise PassError(
            "pipeline parallelism could not find the loss: the backward is not seeded with ones (loss.backward() "
            "of a 0-d loss); call .backward() on the loss without a gradient argument"
        )
    losses = {walk.kind(n.args[0]) for n in seeds if isinstance(n.args[0], fx.Node)} - {"same"}
    if len(losses) > 1:
        raise PassError(
            f"the step's losses combine over micro-batches differently ({_named(losses)}); pipeline parallelism "
            "needs one kind: all means over samples, or sums and means over labels counted from the batch (or one "
            "cross_entropy token mean)"
        )
    out = output_node(gm)
    results = {}
    for value, role in zip(out.args[0], output_roles(gm)):
        if role.kind == "user" and isinstance(value, fx.Node) and _is_scalar(value):
            results[role.index] = "step" if value.meta.get(PHASE) == OPTIMIZER else walk.kind(value)
        elif role.kind == "user" and isinstance(value, fx.Node) and getattr(flow.get(value), "dim", None) != 0:
            raise PassError(
                f"the step returns {value.name}, which is not 0-d and does not hold the samples along dim 0; a "
                "pipelined step concatenates such a result's micro-batches along dim 0. Return per-sample values "
                "with the batch first, or 0-d ones"
            )
    for node, why in mixing.items():
        if node not in walk.terms:
            raise PassError(
                f"{node.name} combines the samples of the batch ({why}); micro-batches cannot reproduce it exactly, "
                "so pipeline parallelism refuses it (BatchNorm: put it in eval mode; a contrastive loss over the "
                "batch: train without Config.pipeline_parallel)"
            )
    kind = losses.pop() if losses else "mean"
    if len(walk.tokens) > 1 or (walk.tokens and kind != "token"):
        raise PassError(
            f"the step takes {len(walk.tokens)} cross_entropy token mean(s) ({', '.join(n.name for n in walk.tokens)}) "
            f"and its loss is a {_NAMES[kind]}; pipeline parallelism combines one token mean over micro-batches, "
            "and only as the loss"
        )
    for node in walk.tokens:
        count = as_sum_over(gm, node, None, fake_mode(gm))
        if count is None:
            raise PassError(f"{node.name}: the token count of the cross_entropy mean is not in the graph")
        out.args = ((*out.args[0], count),)
        out.meta[OUTPUTS] = [*out.meta[OUTPUTS], GraphOutput("loss_count", count.name, 0)]
    dtype = walk.tokens[0].meta[VAL][1].dtype if walk.tokens else torch.float32
    counts = _counted_first(gm, walk.counted)
    gm.meta[LOSS_COMBINE] = LossCombine(kind, results, dtype, shared=_share_seeds(gm, seeds), counts=counts)
    gm.recompile()
    return gm


def _share_seeds(gm: fx.GraphModule, seeds: list[fx.Node]) -> bool:
    """Each seed multiplied by a new ``LOSS_SHARE`` input (in the seed's dtype); False, and nothing changed, where
    there is no seed or the backward returns a value of its own."""
    out = output_node(gm)
    returned = (v for v, r in zip(out.args[0], output_roles(gm)) if r.kind in ("user", "input_grad"))
    if not seeds or any(isinstance(v, fx.Node) and v.meta.get(PHASE) == BACKWARD for v in returned):
        return False
    mode = fake_mode(gm)
    share = add_input(gm, "loss_share", LOSS_SHARE, mode.from_tensor(torch.ones(())))
    for seed in seeds:
        factor = share
        if seed.meta[VAL].dtype != torch.float32:
            factor = insert(gm, aten._to_copy.default, (share,), {"dtype": seed.meta[VAL].dtype}, after=seed, mode=mode)
        scaled = insert(gm, aten.mul.Tensor, (seed, factor), after=factor if factor is not share else seed, mode=mode)
        seed.replace_all_uses_with(scaled, delete_user_cb=functools.partial(operator.is_not, scaled))
    return True


def _counted_first(gm: fx.GraphModule, counted: dict[fx.Node, fx.GraphModule]) -> list:
    """Each mean over a count of labels made a sum over the whole batch's count, a new input (kind
    ``batch_count``): an ``nll_loss_forward``'s total over it (in the forward and the backward: ``as_sum_over``),
    a ratio's denominator replaced by it. Returns the inputs with their counting graphs."""
    mode = fake_mode(gm)
    counts = []
    for node, counter in counted.items():
        spec = GraphInput("batch_count", node.name, len(counts))
        value = mode.from_tensor(torch.zeros((), dtype=count_dtype(node)))
        whole = add_input(gm, f"batch_count_{node.name}", spec, value)
        if node.target is aten.nll_loss_forward.default:
            as_sum_over(gm, node, functools.partial(_read_after, gm, whole, mode=mode), mode)
        else:
            node.replace_all_uses_with(whole)
        counts.append((spec, counter))
    return counts


def _read_after(gm: fx.GraphModule, value: fx.Node, count: fx.Node, *, mode: object) -> fx.Node:
    """``value`` (an input) read right after ``count``: what ``as_sum_over`` divides by in its place."""
    return insert(gm, aten.clone.default, (value,), after=count, mode=mode)


def _reduced_numel(node: fx.Node) -> int | None:
    """The number of elements the reduction making ``node`` reduces over (through ``_LINEAR`` ops), if known."""
    while node.target in _LINEAR:
        node = node.args[0]
    numel = _summed_numel(node)
    return numel if isinstance(numel, int) else None


def _summed_numel(node: fx.Node) -> object:
    """The number of elements the reduction ``node`` reduces over (an int, a ``SymInt``), None if not a tensor's."""
    if node.target is operator.getitem and node.args[0].target is aten.nll_loss_forward.default:
        node = node.args[0].args[1]  # the labels
    elif node.target in _TOTALS or named_arguments(node).get("reduction") is not None:
        node = node.args[0]
    value = node.meta.get(VAL)
    return value.numel() if isinstance(value, torch.Tensor) else None


def _count_in(node: object) -> object:
    """The count a denominator is made of: ``node`` without the casts and constant factors around it."""
    while isinstance(node, fx.Node):
        if node.target in _LINEAR:
            node = node.args[0]
        elif node.target in _SCALED and isinstance(node.args[1], (int, float)):
            node = node.args[0]
        elif node.target in (aten.mul.Tensor, aten.mul.Scalar) and isinstance(node.args[0], (int, float)):
            node = node.args[1]
        else:
            break
    return node


def _same_size(given: object, numel: object) -> bool:
    """Whether ``given`` (a graph argument: a number, or a node of a symbolic size) is ``numel`` at every size."""
    given = given.meta.get(VAL) if isinstance(given, fx.Node) else given
    sizes = (int, torch.SymInt)
    return isinstance(given, sizes) and isinstance(numel, sizes) and same_size(given, numel)


def _named(kinds: set[str], between: str = ", ") -> str:
    return between.join(_NAMES[k] for k in sorted(kinds))


def _is_scalar(node: fx.Node) -> bool:
    return isinstance(node.meta.get(VAL), torch.Tensor) and node.meta[VAL].dim() == 0


class _Walk:
    """Follows a 0-d value back to the reductions over the batch that make it."""

    def __init__(self, gm: fx.GraphModule, flow: dict, mixing: dict):
        self.gm, self.flow, self.mixing = gm, flow, mixing
        self.terms: set[fx.Node] = set()
        self.tokens: list[fx.Node] = []  # token means counted only by their forward (``token``)
        self.counted: dict[fx.Node, fx.GraphModule] = {}  # means over a count of labels, counted first (``sum``)
        self.dependent: dict[fx.Node, bool] = {}
        self.size = next((b.size for b in flow.values()), 1)

    def depends(self, node: object) -> bool:
        if not isinstance(node, fx.Node):
            return False
        if node not in self.dependent:
            inputs = node.all_input_nodes
            self.dependent[node] = node in self.flow or node in self.mixing or any(self.depends(a) for a in inputs)
        return self.dependent[node]

    def kind(self, node: fx.Node) -> str:
        """``node``'s kind (``same``, ``mean``, ``sum``, ``token``); a mean over a count of labels counted first
        (``counted`` inside the walk: a constant factor on it is no batch size) is a ``sum``."""
        kind = self._kind(node)
        return "sum" if kind == "counted" else kind

    def _kind(self, node: fx.Node) -> str:
        if not self.depends(node):
            return "same"
        target = node.target
        if target is operator.getitem and node.args[0].target is aten.nll_loss_forward.default:
            return self._nll(node.args[0])
        if node in self.mixing and _is_scalar(node):
            return self._total(node)
        if target in _LINEAR:
            return self._kind(node.args[0])
        if target in _SCALED:
            return self._scaled(node)
        if target in _ADDED:
            return self._added(node)
        raise self._undecomposable(node)

    def _added(self, node: fx.Node) -> str:
        kinds = {self._kind(a) for a in node.args[:2] if isinstance(a, fx.Node)} | {"same"}
        if kinds <= {"same", "mean"}:
            return "mean"
        if "counted" in kinds and kinds <= {"same", "counted", "sum"}:
            kinds = (kinds - {"counted"}) | ({"sum"} if "sum" in kinds else {"counted"})
        if len(kinds - {"same"}) == 1 and all(self.depends(a) for a in node.args[:2]):
            return (kinds - {"same"}).pop()
        if len(kinds - {"same"}) > 1:
            raise PassError(
                f"{node.name} adds a {_named(kinds - {'same'}, ' and a ')}, which combine over "
                "micro-batches differently; pipeline parallelism needs the loss's terms to be of one kind (all "
                "means over samples, or sums and means over labels counted from the batch)"
            )
        raise self._undecomposable(node)

    def _nll(self, loss: fx.Node) -> str:
        self.terms.add(loss)
        if loss.args[3] == SUM:
            return "sum"
        assert loss.args[3] == MEAN
        counter = self.counted.get(loss) or count_graph(self.gm, loss)
        if counter is not None:
            self.counted[loss] = counter
            return "counted"
        if loss not in self.tokens:
            self.tokens.append(loss)
        return "token"

    def _total(self, node: fx.Node) -> str:
        self.terms.add(node)
        if node.target in _TOTALS:
            return _TOTALS[node.target]
        reduction = named_arguments(node).get("reduction")
        if reduction in (MEAN, SUM):
            return "mean" if reduction == MEAN else "sum"
        raise self._undecomposable(node)

    def _scaled(self, node: fx.Node) -> str:
        a, b = node.args[:2]
        if node.target is aten.div.Tensor and self.depends(a) and self.depends(b):
            return self._over_count(node)
        if self.depends(b):
            if node.target in (aten.div.Tensor, aten.div.Scalar) or self.depends(a):
                raise self._undecomposable(node)
            a, b = b, a
        kind = self._kind(a)
        factor = b if node.target in (aten.mul.Tensor, aten.mul.Scalar) else 1 / b if isinstance(b, (int, float)) else b
        if kind in ("sum", "mean") and isinstance(factor, (int, float)) and self._by_batch_size(factor, kind, a):
            how = f"divides a sum by {1 / factor:g}" if kind == "sum" else f"multiplies a mean by {factor:g}"
            raise PassError(
                f"{node.name} {how}, a multiple of the micro-batch's size ({self.size}; the batch size written as a "
                "number?): the whole batch's size differs. Write a mean as .mean(), a sum as .sum()"
            )
        return kind

    def _over_count(self, node: fx.Node) -> str:
        """``a / b``: a sum over a count of labels, counted first (``cross_entropy``'s ``label_smoothing`` term,
        Hugging Face's ``LabelSmoother``), a sum over the micro-batches once ``b``'s count is the whole batch's;
        else undecomposable. ``b``: the count, cast or times a constant (``_count_in``)."""
        a, b = node.args[:2]
        count = _count_in(b)
        if count not in self.counted:
            counter = count_graph(self.gm, count) if self._is_count(count) else None
            if counter is None:
                raise self._undecomposable(node)
            self.counted[count] = counter
        if self._kind(a) != "sum":
            raise self._undecomposable(node)
        return "counted"

    def _is_count(self, node: fx.Node) -> bool:
        """Whether ``node`` is a sum over the micro-batch that adds up over micro-batches: a sum (``m.sum()``), or
        the number of elements it sums less it (``m.numel() - m.sum()``: the sum of ``1 - m``)."""
        if node.target is aten.rsub.Scalar and named_arguments(node).get("alpha", 1) == 1:
            summed = node.args[0]
            return self._is_count(summed) and _same_size(node.args[1], _summed_numel(summed))
        return node in self.mixing and _is_scalar(node) and self._total(node) == "sum"

    def _by_batch_size(self, factor: float, kind: str, value: fx.Node) -> bool:
        """Whether ``factor`` on ``value`` looks like the micro-batch's size written as a number: a multiple of it
        that divides the number of elements ``value`` reduces over (``x.sum() / (B * T)``; not ``1e-3 * x.sum()``)."""
        ratio = abs(1 / factor if kind == "sum" else factor)
        if self.size <= 1 or ratio < self.size or float(ratio) % self.size:
            return False
        numel = _reduced_numel(value)
        return numel is None or numel % round(ratio) == 0

    def _undecomposable(self, node: fx.Node) -> PassError:
        return PassError(
            f"{node.name} ({node.target}) makes a loss or 0-d result zgraph cannot split into micro-batches: "
            "pipeline parallelism combines means over samples, sums, and cross_entropy token means (and constant "
            "multiples and sums of them); compute the loss as one of those"
        )
