"""The ``stage_cut`` pass and ``stage_graphs`` (issue 42, item 3): a captured four-block MLP step (forward, backward,
AdamW) cut into pipeline stages: which stage and part each node runs in, what crosses each boundary, the backward
split into input and weight gradients, and the refusals."""

from __future__ import annotations

import copy
import functools
import operator

import pytest
import torch
import torch.nn.functional as F
from pipeline_cases import Net, batches, step, train
from torch import nn

import zgraph
from zgraph.errors import PassError
from zgraph.graph import BACKWARD, FORWARD, INPUT, PHASE, input_specs, output_roles
from zgraph.graph_copy import copy_graph_module
from zgraph.ops import GRAD_CONTRIBUTION
from zgraph.passes import PassContext
from zgraph.passes.stage_balance import balance
from zgraph.passes.stage_cut import STAGE, STAGE_PLAN, stage_cut
from zgraph.passes.stage_graphs import stage_graphs

PIPELINE = {"backend": "eager", "pipeline_parallel": 1, "schedule": "interleaved_1f1b", "microbatches": 2}


def captured(model: nn.Module, fn=step, virtual: int = 2) -> zgraph.DistributedStep:
    """``fn`` called once as a one-rank pipeline of ``virtual`` stages (what marks the blocks)."""
    compiled = zgraph.distribute(zgraph.Config(pipeline_virtual_stages=virtual, **PIPELINE))(fn)
    x, y = batches()[0]
    compiled(model, torch.optim.AdamW(model.parameters(), lr=1e-2), x, y)
    return compiled


@pytest.fixture(scope="module")
def graph():
    """The captured step graph of ``pipeline_cases.Net``."""
    return captured(Net()).graphs["captured"]


def cut(gm, stages: int, split=()):
    return stage_cut(copy_graph_module(gm), PassContext(), stages=stages, split=split)


def placed(gm, name: str):
    return next(n for n in gm.graph.nodes if n.name == name).meta[STAGE]


def test_balance_minimises_the_costliest_group():
    assert balance([1.0, 1.0, 1.0, 1.0], 2) == [0, 2]
    assert balance([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == [0, 1]
    assert balance([1.0, 2.0, 3.0, 4.0, 5.0], 3) == [0, 3, 4]
    assert balance([1.0, 1.0, 1.0], 3) == [0, 1, 2]


def test_equal_blocks_are_cut_in_the_middle_and_each_stage_owns_its_parameters(graph):
    gm = cut(graph, 2)
    plan = gm.meta[STAGE_PLAN]
    assert plan.blocks == {"model.blocks.0": 0, "model.blocks.1": 0, "model.blocks.2": 1, "model.blocks.3": 1}
    names = {spec.index: spec.name for spec in input_specs(gm) if spec.kind == "param"}
    owners = {names[index]: stage for (kind, index), stage in plan.owners.items() if kind == "param"}
    assert owners["inp.weight"] == 0 and owners["blocks.1.fc.bias"] == 0
    assert owners["blocks.2.ln.weight"] == 1 and owners["head.weight"] == 1
    assert 0.8 < plan.flops[0] / plan.flops[1] < 1.25


def test_nodes_run_with_their_block_their_readers_and_their_parameters(graph):
    gm = cut(graph, 4)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta[STAGE] is None:
            continue
        block = (node.meta.get("custom") or {}).get("zgraph_block")
        if block is not None and node.meta[PHASE] == FORWARD:
            assert node.meta[STAGE].stage == int(block.rsplit(".", 1)[1]), node.name
        if node.target is GRAD_CONTRIBUTION:
            assert node.meta[STAGE].part == "backward"
            assert all(u.meta[STAGE].part == "update" for u in node.users if u.meta[STAGE] is not None)
    head = next(p for p in gm.graph.nodes if p.op == "placeholder" and p.meta[INPUT].name == "head.weight")
    (transpose,) = [u for u in head.users if u.meta[PHASE] == FORWARD]
    assert transpose.meta[STAGE].stage == 3, "the head's weight is transposed where the head runs"
    ones = next(n for n in gm.graph.nodes if n.meta.get(PHASE) == BACKWARD)
    assert ones.meta[STAGE].stage == 3, "the backward starts at the last stage"


def test_one_activation_and_one_gradient_cross_each_boundary(graph):
    gm = cut(graph, 2)
    first, last = stage_graphs(gm)
    sent = [r for r in output_roles(first.forward) if r.kind == "activation"]
    received = [s for s in input_specs(last.forward) if s.kind == "activation"]
    assert len(sent) == len(received) == 1 and sent[0].name == received[0].name  # the residual stream
    grads_sent = [r for r in output_roles(last.backward) if r.kind == "activation_grad"]
    grads_received = [s for s in input_specs(first.backward) if s.kind == "activation_grad"]
    assert len(grads_sent) == len(grads_received) == 1, "the residual's two gradients are summed where they are made"
    assert [r.kind for r in output_roles(last.forward) if r.kind == "user"] == ["user"], "the loss"
    assert not [s for s in input_specs(first.forward) if s.kind == "activation"]
    means = sorted(s.index for s in input_specs(first.update) if s.kind == "grad_mean")
    assert means == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "stage 0's update reads the gradients of its parameters only"
    updated = sorted(r.index for r in output_roles(first.update) if r.kind == "param")
    assert updated == means


def test_the_backward_splits_into_what_the_previous_stage_waits_for_and_the_weight_gradients(graph):
    _, last = stage_graphs(cut(graph, 2))
    kinds = lambda gm: [r.kind for r in output_roles(gm)]  # noqa: E731
    assert "grad_contribution" not in kinds(last.input_grad) and "activation_grad" in kinds(last.input_grad)
    contributions = sorted(r.index for r in output_roles(last.backward) if r.kind == "grad_contribution")
    assert sorted(r.index for r in output_roles(last.weight_grad) if r.kind == "grad_contribution") == contributions
    handed = [r.name for r in output_roles(last.input_grad) if r.kind == "partial"]
    assert handed == [s.name for s in input_specs(last.weight_grad) if s.kind == "partial"] and handed
    # a gradient marker is the identity (its kernel a copy): the stage graphs return what it marks, without it
    for gm in (last.backward, last.input_grad, last.weight_grad):
        assert not gm.graph.find_nodes(op="call_function", target=GRAD_CONTRIBUTION)
    # the LayerNorm backward's weight gradients cross as tensors (its getitems run in I): a graph returns no tuple
    values = [n.meta["val"] for n in last.input_grad.graph.find_nodes(op="output")[0].args[0]]
    assert all(isinstance(v, torch.Tensor) for v in values)


def test_a_gpt_block_boundary_carries_one_gradient():
    """The demo GPT cut into 2 stages: the gradient of the residual stream crosses once. The next block's Linear
    reads it as a view, its transpose and a sum (the bias gradient): those run in the stage that reads them, not
    where the gradient is made, or each would cross too (3x the bytes)."""
    from zgraph.demos.models import GPT, GPTConfig, lm_loss

    def lm_step(model, opt, ids, targets):
        loss = lm_loss(model(ids), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    model = GPT(GPTConfig(vocab=32, d_model=8, layers=2, heads=2, seq=8))
    compiled = zgraph.distribute(zgraph.Config(**{**PIPELINE, "microbatches": 1}))(lm_step)
    ids = torch.randint(0, 32, (2, 8))
    compiled(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ids, ids)
    _, last = stage_graphs(cut(compiled.graphs["captured"], 2))
    assert [r.kind for r in output_roles(last.backward)].count("activation_grad") == 1


def test_split_points_name_the_first_block_of_each_stage(graph):
    assert cut(graph, 2, ["blocks.1"]).meta[STAGE_PLAN].blocks["model.blocks.0"] == 0
    plan = cut(graph, 3, ["model.blocks.1", "blocks.3"]).meta[STAGE_PLAN]
    assert list(plan.blocks.values()) == [0, 1, 1, 2]
    with pytest.raises(PassError, match=r"'layers.1' is not one of the step's blocks: model.blocks.0, model.blocks"):
        cut(graph, 2, ["layers.1"])
    with pytest.raises(PassError, match=r"must name 2 blocks in forward order.*got \['blocks.3', 'blocks.1'\]"):
        cut(graph, 3, ["blocks.3", "blocks.1"])
    with pytest.raises(PassError, match="a pipeline of 5 stages needs at least 5 repeated blocks.*have 4"):
        cut(graph, 5)


class Tied(nn.Module):
    """An embedding whose weight the head reads too (GPT-2's tied weights): ``transposed`` reads it through the
    embedding's own transpose (a value stage 0 makes, sent on to the head's stage), else as the placeholder itself
    in both stages."""

    def __init__(self, transposed: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.transposed = transposed
        self.emb = nn.Linear(4, 8, bias=False) if transposed else nn.Embedding(10, 8)
        self.blocks = Net().blocks

    def forward(self, x):
        h = self.emb(x if self.transposed else (x[:, 0].abs() * 3).long().clamp(max=9))
        for block in self.blocks:
            h = block(h)
        return F.linear(h, self.emb.weight.t() if self.transposed else self.emb.weight)[..., :3]


def test_a_tied_weight_the_head_reads_through_a_transpose_is_sent_to_its_stage():
    config = {k: v for k, v in PIPELINE.items() if k != "backend"}
    result = train(functools.partial(Tied, True), **config, pipeline_virtual_stages=2)
    torch.testing.assert_close(result["got"], result["want"], rtol=1e-6, atol=1e-6)
    assert result["distance"] < 1e-6


class Normed(Net):
    def __init__(self):
        super().__init__()
        for block in self.blocks:
            block.ln = nn.BatchNorm1d(8)


def scaled_by_every_gradient(model, opt, x, y):
    """Each gradient divided by a sum over every parameter's gradient: a value over several stages' state that is
    not a norm (a global norm and an overflow check are cut into per-stage partials: ``passes/stage_totals.py``)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    total = sum(p.grad.sum() for p in model.parameters())
    for p in model.parameters():
        p.grad.div_(total.abs() + 1)
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize(
    "model,fn,message",
    [
        (Tied, step, r"param emb.weight is read by the forwards of stages \[0, 1\] \(a weight tied"),
        (Normed, step, r"_native_batch_norm_legit_functional combines the samples of the batch \(batch norm in train"),
        (Net, scaled_by_every_gradient, r"reads the state of stages \[0, 1\]"),
    ],
    ids=["tied_weights", "batch_norm", "value_over_every_gradient"],
)
def test_what_micro_batches_or_stages_cannot_reproduce_is_refused_before_anything_changes(model, fn, message):
    model = model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(PassError, match=message):
        captured(model, fn)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_cut_is_a_pass_with_its_options_bound(graph):
    gm = functools.partial(stage_cut, stages=2, split=())(copy_graph_module(graph), PassContext())
    assert gm.meta[STAGE_PLAN].stages == 2


def test_a_fused_attentions_seed_and_offset_hold_no_samples():
    """CUDA's fused attention returns the random generator's seed and offset (0-d) beside its output: reading them
    mixes no samples (``sample_flow``), where a 0-d element of another op's results still counts as mixing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zgraph.graph import VAL, GraphInput
    from zgraph.passes.sample_flow import sample_flow

    aten = torch.ops.aten
    with FakeTensorMode():
        q, scalar = torch.empty(4, 2, 8, 16), torch.empty(())
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta = {VAL: q, INPUT: GraphInput("input", "x", 0)}
    attention = graph.call_function(aten._scaled_dot_product_flash_attention.default, (x, x, x))
    out = (q, q[..., 0], None, None, 8, 8, scalar, scalar, q)
    attention.meta = {VAL: out, PHASE: FORWARD}
    other = graph.call_function(aten.native_layer_norm.default, (x, [16], None, None, 1e-5))
    other.meta = {VAL: (q, scalar, scalar), PHASE: FORWARD}
    for parent, index in ((attention, 0), (attention, 6), (attention, 7), (other, 1)):
        node = graph.call_function(operator.getitem, (parent, index))
        node.meta = {VAL: parent.meta[VAL][index], PHASE: FORWARD}
    graph.output(None)
    flow, mixing = sample_flow(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert [n.name for n in mixing] == ["getitem_3"]  # another op's 0-d result still counts as mixing
    assert flow[next(n for n in graph.nodes if n.name == "getitem")].dim == 0


def test_a_norm_over_every_stage_is_cut_into_partials_and_one_total():
    """``passes/stage_totals.py`` through the cut: each stage returns its partial (a sum of squares) and reads the
    one total the runtime combines them to (``total_inputs``: the ``stage_total`` placeholder, field ``sum``)."""
    from hybrid_cases import clip_step  # the gradients clipped by their norm over every parameter

    from zgraph.passes.stage_totals import total_inputs

    gm = cut(captured(Net(), clip_step).graphs["captured"], 2)
    totals = total_inputs(gm)
    assert [(n.meta[INPUT].kind, n.meta[INPUT].field) for n in totals] == [("stage_total", "sum")], totals
    partials = [r for r in output_roles(gm) if r.kind == "stage_partial"]
    assert sorted(r.index for r in partials) == [0, 1] and {r.name for r in partials} == {totals[0].meta[INPUT].name}
