"""Each pass alone, on small synthetic graphs (``pass_graphs``), checking the rules its module docstring states."""

from __future__ import annotations

import functools
import operator

import torch
from pass_graphs import GROUP, Builder, aten, context, count, grad_step, param, targets

from zgraph.graph import (
    BACKWARD,
    BUCKET,
    FORWARD,
    INPUT,
    MADE_BY,
    OPTIMIZER,
    OUTPUTS,
    PHASE,
    VAL,
    GraphOutput,
    ShardSpec,
)
from zgraph.ops import (
    COMBINE,
    GRAD_CONTRIBUTION,
    GRAD_NORM,
    NONFINITE,
    REDUCE,
    REDUCE_BUCKET,
    REDUCE_SHARD,
    REDUCE_SHARD_BUCKET,
    RELOAD,
    SHARD,
    UNSHARD,
    UNSHARD_BUCKET,
    WRITE_BACK,
)
from zgraph.passes import Pass, PassContext, run_passes
from zgraph.passes.bucket import MIN_OVERLAP_BYTES, bucket, overlap_limit
from zgraph.passes.cast import cast
from zgraph.passes.clip_grad import clip_grad
from zgraph.passes.cse import eliminate_common_subexpressions
from zgraph.passes.loss_scale import loss_scale
from zgraph.passes.lower_collectives import lower_collectives
from zgraph.passes.offload import offload
from zgraph.passes.reduce_scatter_grads import reduce_scatter_grads
from zgraph.passes.schedule import WAIT, schedule
from zgraph.passes.shard_optimizer import shard_optimizer
from zgraph.passes.shard_params import shard_params

c10d = torch.ops._c10d_functional
KiB = 1024


def _user(node):
    return GraphOutput("user", node.name, 0)


# ------------------------------------------------------------------------------------------------------ bucket
def _two_reductions(dtype2=torch.float32, phase2=BACKWARD, second_reads_first=False):
    b = Builder()
    g1 = b.input("g1", (8, 4), "grad", 0)
    g2 = b.input("g2", (8, 4), "grad", 1, dtype=dtype2)
    r1 = b.op(REDUCE_SHARD, g1, 2, 0, GROUP, phase=BACKWARD)
    use1 = b.op(aten.mul.Tensor, r1, 2.0, phase=BACKWARD)
    x2 = g2
    if second_reads_first:  # the second reduction's input is computed from the first one's result
        x2 = b.op(aten.add.Tensor, g2, b.op(aten.sum.default, use1, phase=phase2), phase=phase2)
    r2 = b.op(REDUCE_SHARD, x2, 2, 0, GROUP, phase=phase2)
    use2 = b.op(aten.mul.Tensor, r2, 2.0, phase=phase2)
    return b.finish([(use1, _user(use1)), (use2, _user(use2))])


def _bucket(gm, nbytes=1024 * KiB):
    return bucket(gm, context(), allgather_bytes=nbytes, reduce_bytes=nbytes)


def test_bucket_merges_same_phase_and_dtype():
    gm = _bucket(_two_reductions())
    assert count(gm, REDUCE_SHARD) == 0 and count(gm, REDUCE_SHARD_BUCKET) == 1
    (merged,) = [n for n in gm.graph.nodes if n.target is REDUCE_SHARD_BUCKET]
    assert merged.meta[BUCKET]["members"] == ["g1", "g2"] and merged.meta[BUCKET]["bytes"] == 2 * 8 * 4 * 4
    gm.graph.lint()


def test_bucket_keeps_different_dtypes_and_phases_apart():
    assert count(_bucket(_two_reductions(dtype2=torch.bfloat16)), REDUCE_SHARD_BUCKET) == 0
    assert count(_bucket(_two_reductions(phase2=OPTIMIZER)), REDUCE_SHARD_BUCKET) == 0


def test_bucket_respects_the_byte_cap_and_zero_disables():
    assert count(_bucket(_two_reductions(), nbytes=8 * 4 * 4), REDUCE_SHARD_BUCKET) == 0
    assert count(_bucket(_two_reductions(), nbytes=0), REDUCE_SHARD_BUCKET) == 0


def test_bucket_needs_a_legal_position():
    # the second member's input depends on the first member's result: no single place can issue both
    gm = _bucket(_two_reductions(second_reads_first=True))
    assert count(gm, REDUCE_SHARD_BUCKET) == 0 and count(gm, REDUCE_SHARD) == 2


def test_bucket_gathers_and_all_reduces():
    b = Builder()
    p0, p1 = b.input("p0", (4, 4), "param", 0), b.input("p1", (4, 4), "param", 1)
    w0, w1 = b.op(UNSHARD, p0, 8, 2, GROUP), b.op(UNSHARD, p1, 8, 2, GROUP)
    s, m = b.op(aten.add.Tensor, w0, w1), b.op(aten.mul.Tensor, w0, w1)  # both gathers read in forward only
    r0, r1 = b.op(REDUCE, s, 2, GROUP, phase=BACKWARD), b.op(REDUCE, m, 2, GROUP, phase=BACKWARD)
    t = b.op(aten.add.Tensor, r0, r1, phase=BACKWARD)
    gm = _bucket(b.finish([(t, _user(t))]))
    assert count(gm, UNSHARD_BUCKET) == 1 and count(gm, REDUCE_BUCKET) == 1
    assert count(gm, UNSHARD) == 0 and count(gm, REDUCE) == 0


def test_auto_reduction_buckets_leave_backward_something_to_overlap():
    """``"auto"``: gradient reductions are split into at least a quarter of their bytes each (never below
    ``MIN_OVERLAP_BYTES``), so all but the last bucket can be issued while backward still runs; gathers keep the
    cost model's size."""
    b = Builder()
    grads = [b.input(f"g{i}", (128, 128), "grad", i) for i in range(8)]  # 64 KiB each, 512 KiB in all
    outs = [b.op(aten.mul.Tensor, b.op(REDUCE, g, 2, GROUP, phase=BACKWARD), 2.0, phase=BACKWARD) for g in grads]
    gm = bucket(b.finish([(o, _user(o)) for o in outs]), context(), allgather_bytes="auto", reduce_bytes="auto")
    merged = [n.meta[BUCKET]["bytes"] for n in gm.graph.nodes if n.target is REDUCE_BUCKET]
    assert merged == [MIN_OVERLAP_BYTES, MIN_OVERLAP_BYTES] and count(gm, REDUCE) == 0
    assert overlap_limit(gm, REDUCE, 16 << 20) == MIN_OVERLAP_BYTES  # nothing left to reduce: the floor


def test_bucket_is_a_no_op_without_process_group():
    gm = _two_reductions()
    before = targets(gm)
    assert targets(bucket(gm, context().__class__())) == before


# ---------------------------------------------------------------------------------------------------- schedule
def _lowered_step():
    """A backward that produces two gradients, each reduced (lowered: collective + wait), then used by the
    optimizer."""
    b = Builder()
    x = b.input("x", (8, 4))
    g1 = b.op(aten.mul.Tensor, x, 2.0, phase=BACKWARD)
    c1 = b.op(c10d.all_reduce.default, g1, "avg", GROUP, phase=BACKWARD)
    w1 = b.op(WAIT, c1, phase=BACKWARD)
    g2 = b.op(aten.mul.Tensor, x, 3.0, phase=BACKWARD)
    g3 = b.op(aten.mul.Tensor, g2, 3.0, phase=BACKWARD)
    c2 = b.op(c10d.all_reduce.default, g3, "avg", GROUP, phase=BACKWARD)
    w2 = b.op(WAIT, c2, phase=BACKWARD)
    u1 = b.op(aten.add.Tensor, x, w1, phase=OPTIMIZER)
    u2 = b.op(aten.add.Tensor, x, w2, phase=OPTIMIZER)
    return b.finish([(u1, _user(u1)), (u2, _user(u2))])


def _order(gm):
    return {n.name: i for i, n in enumerate(gm.graph.nodes)}


def test_schedule_issues_early_and_waits_late():
    gm = schedule(_lowered_step(), context())
    gm.graph.lint()
    order = _order(gm)
    # the first reduction's wait moves past the backward work that does not need it
    assert order["wait_tensor_default"] > order["mul_tensor_1"]
    # each wait sits right before its first reader
    for node in gm.graph.nodes:
        if node.target is WAIT:
            first = min(order[u.name] for u in node.users)
            assert first == order[node.name] + 1
    # the collectives are issued right after their inputs
    assert order["all_reduce_default"] == order["mul_tensor"] + 1
    assert order["all_reduce_default_1"] == order["mul_tensor_2"] + 1


def test_schedule_updates_during_backward():
    gm = schedule(_lowered_step(), context())
    order = _order(gm)
    # the optimizer update of the first bucket runs before the second reduction is issued
    assert order["add_tensor"] < order["all_reduce_default_1"]


def _gathers(n):
    b = Builder()
    ps = [b.input(f"p{i}", (256, 256), "param", i) for i in range(n)]
    out = b.input("x", (256, 256))
    for p in ps:
        c = b.op(c10d.all_gather_into_tensor.default, p, 2, GROUP)
        w = b.op(WAIT, c)
        out = b.op(aten.mm.default, out, b.op(aten.slice.Tensor, w, 0, 0, 256))
    return b.finish([(out, _user(out))])


def _issued_ahead(gm):
    """Most all-gathers issued and not yet read at any point."""
    most = ahead = 0
    for node in gm.graph.nodes:
        if node.target is c10d.all_gather_into_tensor.default:
            ahead += 1
        elif node.target is aten.slice.Tensor:
            ahead -= 1
        most = max(most, ahead)
    return most


def test_schedule_prefetch_is_capped():
    one = 512 * 256 * 4  # bytes of one gathered parameter
    assert _issued_ahead(schedule(_gathers(4), context(), prefetch_bytes=one)) == 1
    assert _issued_ahead(schedule(_gathers(4), context(), prefetch_bytes=2 * one)) == 2
    assert _issued_ahead(schedule(_gathers(4), context(), prefetch_bytes=100 * one)) == 4


# -------------------------------------------------------------------------------------------------------- cast
def test_cast_drops_exact_round_trips_only():
    b = Builder()
    a = b.input("a", (4,), dtype=torch.bfloat16)
    h = b.input("h", (4,), dtype=torch.float16)
    exact = b.op(aten._to_copy.default, b.op(aten._to_copy.default, a, dtype=torch.float32), dtype=torch.bfloat16)
    lossy = b.op(aten._to_copy.default, b.op(aten._to_copy.default, a, dtype=torch.float16), dtype=torch.bfloat16)
    other = b.op(aten._to_copy.default, b.op(aten._to_copy.default, h, dtype=torch.float32), dtype=torch.bfloat16)
    gm = cast(b.finish([(exact, _user(exact)), (lossy, _user(lossy)), (other, _user(other))]), context())
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert out[0].name == "a"  # bf16 -> fp32 -> bf16 is the identity
    assert out[1].target is aten._to_copy.default  # bf16 -> fp16 -> bf16 may round: kept
    assert out[2].target is aten._to_copy.default  # fp16 -> fp32 -> bf16 is a real cast: kept


def test_cast_gathers_in_compute_dtype_and_reduces_in_reduce_dtype():
    b = Builder()
    p = b.input("p", (4, 4), "param", 0)
    g = b.input("g", (8, 4), "grad", 0)
    whole = b.op(UNSHARD, p, 8, 2, GROUP)
    low = b.op(aten._to_copy.default, whole, dtype=torch.bfloat16)
    red = b.op(REDUCE_SHARD, g, 2, 0, GROUP, phase=BACKWARD)
    gm = cast(b.finish([(low, _user(low)), (red, _user(red))]), context(), reduce_dtype=torch.bfloat16)
    (gather,) = [n for n in gm.graph.nodes if n.target is UNSHARD]
    assert gather.args[0].meta[VAL].dtype == torch.bfloat16 and gather.meta[VAL].dtype == torch.bfloat16
    (reduction,) = [n for n in gm.graph.nodes if n.target is REDUCE_SHARD]
    assert reduction.args[0].meta[VAL].dtype == torch.bfloat16
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert out[1].meta[VAL].dtype == torch.float32  # cast back to the gradient's own dtype


# ------------------------------------------------------------------------------------------------ shard_params
def test_shard_params_gathers_once_per_use_region():
    b = Builder()
    w = b.input("w", (8, 4), "param", 0)
    x = b.input("x", (2, 8))
    y1 = b.op(aten.mm.default, x, w)  # forward region: two uses
    y2 = b.op(aten.mm.default, x, w)
    gy = b.op(aten.add.Tensor, y1, y2, phase=BACKWARD)
    gx = b.op(aten.mm.default, gy, b.op(aten.t.default, w, phase=BACKWARD), phase=BACKWARD)  # backward region
    new_w = b.op(aten.mul.Tensor, w, 0.5, phase=OPTIMIZER)  # the optimizer's update: runs on the shard
    gm = b.finish([(gx, _user(gx)), (new_w, GraphOutput("param", "w", 0))])
    ctx = context((param(0, (8, 4)),))
    gm = shard_params(gm, ctx, stage=3)
    gm.graph.lint()
    gathers = [n for n in gm.graph.nodes if n.target is UNSHARD]
    assert [g.meta[PHASE] for g in gathers] == [FORWARD, BACKWARD]
    w_node = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "w")
    assert w_node.meta[INPUT].layout == "shard" and tuple(w_node.meta[VAL].shape) == (4, 4)
    order = _order(gm)
    for g in gathers:  # each gather sits right before its region's first use
        assert order[g.name] + 1 == min(order[u.name] for u in g.users)
    output = [n for n in gm.graph.nodes if n.op == "output"][0]
    assert output.meta["zgraph_outputs"][1].layout == "shard"
    update = output.args[0][1]  # the elementwise update was pushed onto the shard: no gather for it
    assert update.target is aten.mul.Tensor and update.args[0] is w_node


def test_shard_params_below_stage_3_does_nothing():
    b = Builder()
    w = b.input("w", (8, 4), "param", 0)
    y = b.op(aten.mul.Tensor, w, 2.0)
    gm = b.finish([(y, _user(y))])
    assert count(shard_params(gm, context((param(0, (8, 4)),)), stage=2), UNSHARD) == 0


# ------------------------------------------------------------------------------------------- lower_collectives
def _lower_one(op, *args, shape=(5, 3)):
    b = Builder()
    x = b.input("x", shape)
    y = b.op(op, x, *args)
    return lower_collectives(b.finish([(y, _user(y))]), context(rank=1))


def test_lower_shard_pads_the_last_rank():
    # 5 rows over 2 ranks: 3 rows each; rank 1 holds rows 3..4 and one zero row
    gm = _lower_one(SHARD, 2, 1)
    assert count(gm, aten.constant_pad_nd.default) == 1
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]
    assert tuple(out.meta[VAL].shape) == (ShardSpec((5, 3), 2).rows, 3)
    # rows that divide evenly need no padding
    assert count(_lower_one(SHARD, 2, 1, shape=(6, 3)), aten.constant_pad_nd.default) == 0


def test_lower_unshard_drops_padding_rows():
    gm = _lower_one(UNSHARD, 5, 2, GROUP, shape=(3, 3))
    gather = next(n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default)
    assert tuple(gather.meta[VAL].shape) == (6, 3)
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]
    assert tuple(out.meta[VAL].shape) == (5, 3)
    assert gm.graph.find_nodes(op="call_function", target=WAIT)


def test_lower_reduce_shard_pads_before_reducing():
    gm = _lower_one(REDUCE_SHARD, 2, 1, GROUP)
    scatter = next(n for n in gm.graph.nodes if n.target is c10d.reduce_scatter_tensor.default)
    assert tuple(scatter.args[0].meta[VAL].shape)[0] == 6  # padded to whole shards
    assert scatter.args[1] == "avg"
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]
    assert tuple(out.meta[VAL].shape) == (3, 3)
    assert not any(n.target in (SHARD, UNSHARD, REDUCE, REDUCE_SHARD) for n in gm.graph.nodes)


# ---------------------------------------------------------------------------------------- clip_grad, loss_scale
def _sharded_grad(b, name, index):
    g = b.input(name, (8, 4), "grad", index)
    shard = b.op(REDUCE_SHARD, g, 2, 0, GROUP, phase=BACKWARD)
    return shard, b.op(UNSHARD, shard, 8, 2, GROUP, phase=BACKWARD)


def test_clip_grad_norm_from_shards_with_one_global_reduction():
    b = Builder()
    s0, g0 = _sharded_grad(b, "g0", 0)
    s1, g1 = _sharded_grad(b, "g1", 1)
    n0 = b.op(GRAD_NORM, g0, 2.0, phase=OPTIMIZER)
    n1 = b.op(GRAD_NORM, g1, 2.0, phase=OPTIMIZER)
    total = b.op(aten.add.Tensor, n0, n1, phase=OPTIMIZER)
    gm = clip_grad(b.finish([(total, _user(total))]), context())
    gm.graph.lint()
    assert count(gm, GRAD_NORM) == 0
    (combine,) = [n for n in gm.graph.nodes if n.target is COMBINE]
    assert combine.args[1:] == ("sum", 2, GROUP)
    # the partial sums read the shards, not the gathered gradients
    abs_inputs = {n.args[0] for n in gm.graph.nodes if n.target is aten.abs.default}
    assert abs_inputs == {s0, s1}
    assert count(gm, UNSHARD) == 0  # nothing reads the gathered gradients any more


def test_clip_grad_infinity_norm_takes_the_max():
    b = Builder()
    _, g0 = _sharded_grad(b, "g0", 0)
    n0 = b.op(GRAD_NORM, g0, float("inf"), phase=OPTIMIZER)
    gm = clip_grad(b.finish([(n0, _user(n0))]), context())
    (combine,) = [n for n in gm.graph.nodes if n.target is COMBINE]
    assert combine.args[1] == "max"


def test_clip_grad_leaves_whole_gradients_alone():
    b = Builder()
    g = b.input("g", (8, 4), "grad", 0)
    whole = b.op(REDUCE, g, 2, GROUP, phase=BACKWARD)
    n = b.op(GRAD_NORM, whole, 2.0, phase=OPTIMIZER)
    gm = clip_grad(b.finish([(n, _user(n))]), context())
    assert count(gm, GRAD_NORM) == 1 and count(gm, COMBINE) == 0


def test_loss_scale_overflow_flag_is_global():
    b = Builder()
    s0, g0 = _sharded_grad(b, "g0", 0)
    flag = b.op(NONFINITE, [g0], phase=OPTIMIZER)
    gm = loss_scale(b.finish([(flag, _user(flag))]), context())
    gm.graph.lint()
    (check,) = [n for n in gm.graph.nodes if n.target is NONFINITE]
    assert check.args[0] == [s0]  # reads the shard
    (combine,) = [n for n in gm.graph.nodes if n.target is COMBINE]
    assert combine.args[1:] == ("max", 2, GROUP)
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]
    assert out.meta[VAL].dtype == torch.bool


def test_loss_scale_whole_gradients_need_no_collective():
    b = Builder()
    g = b.input("g", (8, 4), "grad", 0)
    flag = b.op(NONFINITE, [b.op(REDUCE, g, 2, GROUP, phase=BACKWARD)], phase=OPTIMIZER)
    gm = loss_scale(b.finish([(flag, _user(flag))]), context())
    assert count(gm, COMBINE) == 0


# ---------------------------------------------------------------------------------------------------- pass list
def test_pass_list_stamps_the_pass_that_made_each_node():
    gm = _two_reductions()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta.pop(MADE_BY, None)
    bound = functools.partial(bucket, allgather_bytes=1 << 20, reduce_bytes=1 << 20)
    (record,) = run_passes(gm, context(), [Pass("bucket", bound)], check_input=False)
    made = {n.name: n.meta.get(MADE_BY) for n in record.gm.graph.nodes if n.op == "call_function"}
    merged = [n for n in record.gm.graph.nodes if n.target is REDUCE_SHARD_BUCKET]
    assert merged and made[merged[0].name] == "bucket"
    assert all(made[n.name] == "bucket" for n in record.gm.graph.nodes if n.target is operator.getitem)
    assert made["mul_tensor"] is None  # untouched nodes name no pass
    assert record.doc.startswith("Merge same-kind collectives")  # the doc of the bound function


# ------------------------------------------------------------------------------ cse, reduce_scatter, shard_optimizer
def test_cse_merges_pure_repeats_and_drops_identities():
    b = Builder()
    x = b.input("x", (4, 4))
    t1, t2 = b.op(aten.t.default, x), b.op(aten.t.default, x)
    d = b.op(aten.detach.default, t2)
    r1, r2 = b.op(aten.rand_like.default, x), b.op(aten.rand_like.default, x)  # random: never merged
    s = b.op(aten.add.Tensor, b.op(aten.add.Tensor, t1, d), b.op(aten.add.Tensor, r1, r2))
    gm = eliminate_common_subexpressions(b.finish([(s, _user(s))]), context())
    assert count(gm, aten.t.default) == 1 and count(gm, aten.detach.default) == 0
    assert count(gm, aten.rand_like.default) == 2


def test_reduce_scatter_grads_averages_every_marker():
    ctx = context((param(0, (8, 4)),))
    whole = reduce_scatter_grads(grad_step(), ctx, stage=1)
    assert count(whole, GRAD_CONTRIBUTION) == 0 and count(whole, REDUCE) == 1 and count(whole, REDUCE_SHARD) == 0
    sharded = reduce_scatter_grads(grad_step(), ctx, stage=2)
    assert count(sharded, GRAD_CONTRIBUTION) == 0 and count(sharded, REDUCE_SHARD) == 1 and count(sharded, REDUCE) == 0
    g = next(n for n in sharded.graph.nodes if n.op == "placeholder" and n.name == "g")
    assert g.meta[INPUT].layout == "shard" and tuple(g.meta[VAL].shape) == (4, 4)
    out = [n for n in sharded.graph.nodes if n.op == "output"][0]
    assert out.meta["zgraph_outputs"][0].layout == "shard"
    assert tuple(out.args[0][0].meta[VAL].shape) == (4, 4)  # the update runs on the shard
    alone = reduce_scatter_grads(grad_step(), PassContext(), stage=2)  # no process group: markers dropped
    assert count(alone, GRAD_CONTRIBUTION) == 0 and count(alone, REDUCE) == 0


def test_shard_optimizer_keeps_state_sharded():
    b = Builder()
    w = b.input("w", (8, 4), "param", 0)
    m = b.input("m", (8, 4), "opt_state", 0, field="exp_avg", optimizer=0)
    new_m = b.op(aten.mul.Tensor, m, 0.9, phase=OPTIMIZER)
    new_w = b.op(aten.sub.Tensor, w, new_m, phase=OPTIMIZER)
    roles = [GraphOutput("param", "w", 0), GraphOutput("opt_state", "m", 0, field="exp_avg", optimizer=0)]
    gm = shard_optimizer(b.finish(list(zip([new_w, new_m], roles))), context((param(0, (8, 4)),)), stage=1)
    gm.graph.lint()
    m_node = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "m")
    assert m_node.meta[INPUT].layout == "shard"
    out = [n for n in gm.graph.nodes if n.op == "output"][0]
    assert [r.layout for r in out.meta["zgraph_outputs"]] == ["full", "shard"]
    assert tuple(out.args[0][1].meta[VAL].shape) == (4, 4)  # the state update runs on the shard
    assert out.args[0][0].target is UNSHARD  # the updated parameter is gathered whole
    assert count(shard_optimizer(grad_step(), context((param(0, (8, 4)),)), stage=0), UNSHARD) == 0


# ------------------------------------------------------------------------------------------------------ offload
def _adam_like() -> torch.fx.GraphModule:
    b = Builder()
    w = b.input("w", (8, 4), "param", 0)
    m = b.input("m", (8, 4), "opt_state", 0, field="exp_avg", optimizer=0)
    v = b.input("v", (8, 4), "opt_state", 0, field="exp_avg_sq", optimizer=0)
    s = b.input("s", (), "opt_state", 0, field="step", optimizer=0)
    new_s = b.op(aten.add.Tensor, s, 1, phase=OPTIMIZER)
    new_m = b.op(aten.mul.Tensor, m, 0.9, phase=OPTIMIZER)
    new_v = b.op(aten.mul.Tensor, v, 0.99, phase=OPTIMIZER)
    new_w = b.op(aten.sub.Tensor, w, b.op(aten.div.Tensor, new_m, new_v, phase=OPTIMIZER), phase=OPTIMIZER)
    roles = [GraphOutput("param", "w", 0)] + [
        GraphOutput("opt_state", name, 0, field=field, optimizer=0)
        for name, field in (("m", "exp_avg"), ("v", "exp_avg_sq"), ("s", "step"))
    ]
    return b.finish(list(zip([new_w, new_m, new_v, new_s], roles)))


def test_offload_reloads_before_first_read_and_writes_back_each_update():
    gm = offload(_adam_like(), context(), tier="nvme", fraction=1.0)
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    reloads = [n for n in nodes if n.target is RELOAD]
    writes = [n for n in nodes if n.target is WRITE_BACK]
    assert [n.args for n in reloads] == [(nodes[1], 1), (nodes[2], 2)]  # m and v, by input position; not the step
    for r in reloads:
        assert list(r.args[0].users) == [r]  # the placeholder is only a shape now
        first_reader = min(r.users, key=nodes.index)
        assert nodes.index(first_reader) == nodes.index(r) + 1  # reloaded right before its first read
        assert r.meta[PHASE] == OPTIMIZER
    for w in writes:
        assert nodes.index(w) == nodes.index(w.args[0]) + 1  # written back right after the update
    out = nodes[-1]
    assert [r.kind for r in out.meta[OUTPUTS]] == ["param", "offloaded", "offloaded", "opt_state"]
    assert list(out.args[0][1:3]) == writes


def test_offload_fraction_takes_whole_states_in_order_and_other_tiers_change_nothing():
    half = offload(_adam_like(), context(), tier="nvme", fraction=0.5)
    assert [n.args[1] for n in half.graph.nodes if n.target is RELOAD] == [1]  # m: half the bytes
    assert count(offload(_adam_like(), context(), tier="nvme", fraction=0.0), RELOAD) == 0
    for tier in (None, "cpu"):
        gm = offload(_adam_like(), context(), tier=tier, fraction=1.0)
        assert count(gm, RELOAD) == 0 and count(gm, WRITE_BACK) == 0
