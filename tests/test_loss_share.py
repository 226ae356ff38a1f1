"""Each pipelined micro-batch's backward seeded with its share of the whole batch (``micro_batch_loss``'s
``loss_share``), a token mean's count taken from the labels before any micro-batch runs (``passes/token_count.py``),
and what that changes: fp16 loss scaling overflows as eager's on the whole batch, not at a micro-batch's token count
times lower a scale."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from pipeline_cases import LOSSES, Net, step_of

import zgraph
from zgraph.graph import INPUT, OUTPUTS, GraphInput, GraphOutput
from zgraph.passes.token_count import count_graph

aten = torch.ops.aten
SUM, IGNORE = 2, -100
ONE_RANK = {"pipeline_parallel": 1, "pipeline_virtual_stages": 2, "schedule": "interleaved_1f1b", "microbatches": 4}


def _forward(labels_from_activation: bool = False, weighted: bool = False) -> fx.GraphModule:
    """A stage forward of a shifted token mean: ``nll_loss_forward(logp[:-1], y[1:], weight)`` rewritten to its sum,
    returning the loss and its count (``loss_count``); the labels shifted from the input ``y`` or an argmax of the
    activation ``logp``; ``weight`` a buffer."""
    graph = fx.Graph()
    logp = graph.placeholder("logp")
    logp.meta[INPUT] = GraphInput("activation", "logp", 0)
    y = graph.placeholder("y")
    y.meta[INPUT] = GraphInput("input", "y", 1)
    weight = None
    if weighted:
        weight = graph.placeholder("w")
        weight.meta[INPUT] = GraphInput("buffer", "w", 0)
    scores = graph.call_function(aten.slice.Tensor, (logp, 0, 0, -1))
    labels = graph.call_function(aten.argmax.default, (scores, 1)) if labels_from_activation else y
    labels = graph.call_function(aten.slice.Tensor, (labels, 0, 1)) if not labels_from_activation else labels
    nll = graph.call_function(aten.nll_loss_forward.default, (scores, labels, weight, SUM, IGNORE))
    nll.meta["val"] = (torch.zeros(()), torch.zeros(()))
    loss, count = (graph.call_function(operator.getitem, (nll, i)) for i in (0, 1))
    out = graph.output((loss, count))
    out.meta[OUTPUTS] = [GraphOutput("user", "loss", 0), GraphOutput("loss_count", "count", 0)]
    return fx.GraphModule(torch.nn.Module(), graph)


def _nll(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.target is aten.nll_loss_forward.default)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class_weights"])
def test_the_count_graph_counts_from_the_labels_alone_what_the_loss_counts(weighted):
    """The count graph reads only the labels (and the class weights) and gives ``nll_loss_forward``'s count of the
    labels not ignored (their weights' sum), wider (summed over micro-batches before it is cast)."""
    forward = _forward(weighted=weighted)
    counter = count_graph(forward, _nll(forward))
    assert counter is not None
    read = [n.meta[INPUT].kind for n in counter.graph.nodes if n.op == "placeholder"]
    assert read == (["input", "buffer"] if weighted else ["input"])
    logp = torch.randn(9, 3).log_softmax(-1)
    y = torch.tensor([0, 2, IGNORE, 1, IGNORE, 0, 0, 2, 1])
    w = torch.tensor([0.5, 2.0, 3.0])
    inputs = [y, w] if weighted else [y]
    want = forward(logp, *inputs)[1]
    (got,) = counter(*inputs)
    assert got.dtype == (torch.float64 if weighted else torch.int64)
    assert got.item() == want.item() == (11.0 if weighted else 6.0)


def test_a_count_of_labels_is_copied_and_labels_made_from_activations_have_no_count_graph():
    forward = _forward()
    graph = forward.graph
    y = next(n for n in graph.nodes if n.name == "y")
    with graph.inserting_after(y):
        kept = graph.call_function(aten.ne.Scalar, (y, IGNORE))
    with graph.inserting_after(kept):
        count = graph.call_function(aten.sum.default, (kept,))
    counter = count_graph(forward, count)
    assert counter is not None
    assert counter(torch.tensor([0, IGNORE, 2]))[0].item() == 2
    derived = _forward(labels_from_activation=True)
    assert count_graph(derived, _nll(derived)) is None


def _train(loss: str, init_scale: float, **pipeline: object) -> tuple[list[float], list[float], dict]:
    """3 fp16 steps (fp32 master weights, dynamic loss scaling) of ``Net`` on a 64-sample batch: the losses, the
    scale after each step, the parameters."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 4, generator=g) * 30, torch.randint(0, 3, (64,), generator=g)) for _ in range(3)]
    model = Net(d=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaling = zgraph.DynamicLossScale(init_scale=init_scale, hysteresis=1)
    config = zgraph.Config(backend="eager", param_dtype=torch.float16, loss_scale=scaling, **pipeline)
    step = zgraph.distribute(config)(step_of(LOSSES[loss]))
    losses, scales = [], []
    for x, y in data:
        losses.append(float(step(model, opt, x, y)))
        scales.append(float(opt._zgraph_loss_scale["scale"]))
    return losses, scales, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_fp16_loss_scaling_with_pipelines_skips_the_steps_eager_skips():
    """fp16 compute with dynamic loss scaling, a token mean (a third of the labels ignored) over 4 micro-batches
    against the whole batch: the same scales after each step, so the same skipped steps (none), and the same losses
    and parameters within fp16's rounding. Each micro-batch seeded with 1 on its sum over its tokens overflowed
    at this scale (the scale halved twice, two steps skipped)."""
    want = _train("token_mean", 2.0**12)
    got = _train("token_mean", 2.0**12, **ONE_RANK)
    assert got[1] == want[1] == [2.0**12] * 3, (got[1], want[1])
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=2e-3, atol=0)
    distance = max((got[2][n] - p).abs().max().item() for n, p in want[2].items())
    assert distance < 2e-3, distance


def test_fp16_loss_scaling_of_a_mean_with_pipelines_settles_at_most_m_times_higher_than_eager():
    """A mean over samples whose eager gradient overflows in its sum over the whole batch (a weight's) at 2**9:
    the 4 micro-batches' parts of that sum do not, so the pipelined scale stays above eager's, within M times."""
    eager = _train("scaled_mean", 2.0**9)[1]
    pipelined = _train("scaled_mean", 2.0**9, **ONE_RANK)[1]
    assert all(e <= p <= 4 * e for e, p in zip(eager, pipelined)), (eager, pipelined)


def test_a_token_mean_of_labels_made_from_activations_still_equals_eager():
    """Labels the step computes from the model's output (ignored where the batch's are) cannot be counted before
    the micro-batches run: the seeds stay 1 and the summed gradients are divided by the count afterwards."""

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, logits.detach().argmin(-1).masked_fill(y == 0, IGNORE))

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    eager_model = Net()
    model = copy.deepcopy(eager_model)
    eager_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager_model, model))
    step = step_of(loss_fn)
    compiled = zgraph.distribute(zgraph.Config(backend="eager", **ONE_RANK))(step)
    for x, y in data:
        torch.testing.assert_close(compiled(model, opt, x, y), step(eager_model, eager_opt, x, y))
    combine = compiled._dispatch.last.pipeline.combine
    assert combine.kind == "token" and not combine.counts
    for n, p in eager_model.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[n], p, rtol=1e-6, atol=1e-6)


def test_the_labels_number_less_the_ignored_is_counted_at_symbolic_batch_sizes():
    """A loss over ``m.numel() - m.sum()`` (Hugging Face's ``LabelSmoother``) at batch sizes 8, 12, 16: the
    second size captures the step again with a symbolic batch, whose micro-batch's number of labels is a size in
    the graph; each step equals eager's, its count the whole batch's."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(b, 4, generator=g), torch.randint(0, 3, (b,), generator=g)) for b in (8, 12, 16)]
    eager_model = Net()
    model = copy.deepcopy(eager_model)
    eager_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager_model, model))
    step = step_of(LOSSES["complement_count"])
    compiled = zgraph.distribute(zgraph.Config(backend="eager", **ONE_RANK))(step)
    for x, y in data:
        torch.testing.assert_close(compiled(model, opt, x, y), step(eager_model, eager_opt, x, y))
    counted = compiled._dispatch.last.pipeline.combine.counts[0][1]
    sizes = [n for n in counted.graph.nodes if isinstance(n.meta.get("val"), torch.SymInt)]
    assert sizes, "the last capture's count reads a symbolic size"
    for n, p in eager_model.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[n], p, rtol=1e-6, atol=1e-6)
