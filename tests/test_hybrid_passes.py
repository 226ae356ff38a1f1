"""The passes under hybrid sharding and hpZ, each alone on small synthetic graphs (``pass_graphs``): 4 ranks as
2 shard groups of 2 (rank 1: rank 1 of shard group ``SHARD_GROUP``, rank 0 of replicate group ``REPLICAS``), or
hpZ's secondary groups of 2 (``SECONDARY``)."""

from __future__ import annotations

import dataclasses

import torch
from pass_graphs import GROUP, Builder, aten, context, count, grad_step, param

from zgraph.graph import BACKWARD, FORWARD, INPUT, OPTIMIZER, VAL, Axis, GraphOutput
from zgraph.ops import COMBINE, GRAD_CONTRIBUTION, GRAD_NORM, REDUCE, REDUCE_SHARD, SHARD, UNSHARD
from zgraph.passes.cast import cast
from zgraph.passes.clip_grad import clip_grad
from zgraph.passes.graph_utils import push_shards
from zgraph.passes.reduce_scatter_grads import reduce_scatter_grads
from zgraph.passes.secondary_shards import secondary_shards
from zgraph.passes.shard_optimizer import shard_optimizer
from zgraph.passes.shard_params import shard_params

SHARD_GROUP, REPLICAS, SECONDARY = "shard_group", "replicas", "secondary"


def _hybrid(*params):
    ctx = context(tuple(params), world=4, rank=1)
    return dataclasses.replace(
        ctx,
        shard_group=Axis(size=2, rank=1, name=SHARD_GROUP),
        replicate_group=Axis(size=2, rank=0, name=REPLICAS, crosses_nodes=True),
    )


def _hpz(*params):
    ctx = context(tuple(params), world=4, rank=1)
    return dataclasses.replace(ctx, secondary_group=Axis(size=2, rank=1, name=SECONDARY))


def _user(node):
    return GraphOutput("user", node.name, 0)


def test_gradients_reduce_scatter_in_the_group_then_all_reduce_across_groups():
    gm = reduce_scatter_grads(grad_step(), _hybrid(param(0, (8, 4))), stage=2)
    gm.graph.lint()
    (scatter,) = [n for n in gm.graph.nodes if n.target is REDUCE_SHARD]
    (across,) = [n for n in gm.graph.nodes if n.target is REDUCE]
    assert scatter.args[1:] == (2, 1, SHARD_GROUP)
    assert across.args == (scatter, 2, REPLICAS)  # the shard, not the whole gradient, crosses groups
    g = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "g")
    assert tuple(g.meta[VAL].shape) == (4, 4)  # 8 rows over a shard group of 2
    assert count(gm, GRAD_CONTRIBUTION) == 0


def test_whole_gradients_are_all_reduced_over_every_rank():
    gm = reduce_scatter_grads(grad_step(), _hybrid(param(0, (8, 4))), stage=0)
    (reduce,) = [n for n in gm.graph.nodes if n.target is REDUCE]
    assert reduce.args[1:] == (4, GROUP) and count(gm, REDUCE_SHARD) == 0


def _param_step():
    b = Builder()
    w = b.input("w", (8, 4), "param", 0)
    x = b.input("x", (2, 8))
    y = b.op(aten.mm.default, x, w)
    gy = b.op(aten.mul.Tensor, y, 2.0, phase=BACKWARD)
    gx = b.op(aten.mm.default, gy, b.op(aten.t.default, w, phase=BACKWARD), phase=BACKWARD)
    new_w = b.op(aten.mul.Tensor, w, 0.5, phase=OPTIMIZER)
    return b.finish([(gx, _user(gx)), (new_w, GraphOutput("param", "w", 0))])


def test_stage3_parameters_are_gathered_within_the_shard_group():
    gm = shard_params(_param_step(), _hybrid(param(0, (8, 4))), stage=3)
    gathers = [n for n in gm.graph.nodes if n.target is UNSHARD]
    assert len(gathers) == 2 and all(g.args[2:] == (2, SHARD_GROUP) for g in gathers)
    w = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "w")
    assert tuple(w.meta[VAL].shape) == (4, 4)


def test_optimizer_state_is_cut_across_the_shard_group():
    b = Builder()
    m = b.input("m", (8, 4), "opt_state", 0, field="exp_avg")
    new_m = b.op(aten.mul.Tensor, m, 0.9, phase=OPTIMIZER)
    gm = shard_optimizer(b.finish([(new_m, GraphOutput("opt_state", "m", 0))]), _hybrid(param(0, (8, 4))), stage=1)
    m = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert m.meta[INPUT].layout == "shard" and tuple(m.meta[VAL].shape) == (4, 4)


def test_hpz_backward_regathers_from_the_secondary_shard():
    ctx = _hpz(param(0, (8, 4)))
    gm = secondary_shards(shard_params(_param_step(), ctx, stage=3), ctx, stage=3)
    gm.graph.lint()
    forward, backward = [n for n in gm.graph.nodes if n.target is UNSHARD]
    assert forward.meta["phase"] == FORWARD and forward.args[2:] == (4, GROUP)
    assert backward.meta["phase"] == BACKWARD and backward.args[1:] == (8, 2, SECONDARY)
    kept = backward.args[0]
    assert kept.target is aten.clone.default  # a copy: the forward's whole gather is not kept alive
    piece = kept.args[0]
    assert piece.target is SHARD and piece.args == (forward, 2, 1)
    assert tuple(kept.meta[VAL].shape) == (4, 4)


def test_hpz_needs_stage_3_and_a_forward_gather():
    ctx = _hpz(param(0, (8, 4)))
    gm = shard_params(_param_step(), ctx, stage=3)
    assert count(secondary_shards(gm, ctx, stage=2), SHARD) == 0
    b = Builder()  # a parameter only the backward reads: nothing kept from a forward, gathered over every rank
    w = b.input("w", (8, 4), "param", 0)
    gw = b.op(aten.mul.Tensor, w, 2.0, phase=BACKWARD)
    gm = shard_params(b.finish([(gw, _user(gw))]), ctx, stage=3)
    gm = secondary_shards(gm, ctx, stage=3)
    (gather,) = [n for n in gm.graph.nodes if n.target is UNSHARD]
    assert gather.args[2:] == (4, GROUP)


def test_clip_grad_combines_over_the_shard_group_only():
    b = Builder()
    g = b.input("g", (8, 4), "grad", 0)
    scatter = b.op(REDUCE_SHARD, g, 2, 1, SHARD_GROUP, phase=BACKWARD)
    across = b.op(REDUCE, scatter, 2, REPLICAS, phase=BACKWARD)
    whole = b.op(UNSHARD, across, 8, 2, SHARD_GROUP, phase=BACKWARD)
    norm = b.op(GRAD_NORM, whole, 2.0, phase=OPTIMIZER)
    gm = clip_grad(b.finish([(norm, _user(norm))]), _hybrid(param(0, (8, 4))))
    (combine,) = [n for n in gm.graph.nodes if n.target is COMBINE]
    assert combine.args[1:] == ("sum", 2, SHARD_GROUP)  # every group holds the same shards: count them once


def test_cross_group_dtype_narrows_only_what_crosses_groups():
    b = Builder()
    g = b.input("g", (8, 4), "grad", 0)
    scatter = b.op(REDUCE_SHARD, g, 2, 1, SHARD_GROUP, phase=BACKWARD)
    across = b.op(REDUCE, scatter, 2, REPLICAS, phase=BACKWARD)
    gm = cast(b.finish([(across, _user(across))]), _hybrid(), cross_group_dtype=torch.bfloat16)
    (scatter,) = [n for n in gm.graph.nodes if n.target is REDUCE_SHARD]
    (across,) = [n for n in gm.graph.nodes if n.target is REDUCE]
    assert scatter.meta[VAL].dtype == torch.float32 and across.meta[VAL].dtype == torch.bfloat16
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]
    assert out.meta[VAL].dtype == torch.float32  # cast back after the collective


def test_a_shard_of_a_gather_over_other_ranks_is_not_the_gathered_shard():
    b = Builder()
    w = b.input("w", (8, 4), "param", 0)
    whole = b.op(UNSHARD, w, 8, 4, GROUP)
    piece = b.op(SHARD, whole, 2, 1)
    gm = b.finish([(piece, _user(piece))])
    push_shards(gm)
    assert count(gm, UNSHARD) == 1 and count(gm, SHARD) == 1
