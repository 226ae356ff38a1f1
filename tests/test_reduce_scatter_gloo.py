"""Reduce-scatters on gloo run as ``all_to_all_single`` plus a sum (``reduce_scatter_by_all_to_all``).

gloo's ``reduce_scatter_tensor`` all-reduces a copy of the whole input; the all-to-all moves each rank only its
chunk. Unit tests of the lowering and the schedule on small synthetic graphs, then real gloo ranks: the lowered
graph gives what ``reduce_scatter_tensor`` gives (bit for bit on 2 ranks, padding and bf16 included)."""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist
from dist_harness import run_ranks
from pass_graphs import GROUP, Builder, aten, context, count
from pass_graphs import param as param_info

from zgraph.graph import (
    BACKWARD,
    COLLECTIVE,
    OPTIMIZER,
    VAL,
    GraphOutput,
    collective_kind,
    reduce_scatter_by_all_to_all,
)
from zgraph.ops import REDUCE_SHARD, REDUCE_SHARD_BUCKET
from zgraph.passes.lower_collectives import lower_collectives
from zgraph.passes.schedule import WAIT, schedule

c10d = torch.ops._c10d_functional
A2A = c10d.all_to_all_single.default


def _reduce_shard_graph(shape=(5, 3), world: int = 2, group: str = GROUP, dtype=torch.float32):
    b = Builder()
    x = b.input("x", shape, dtype=dtype)
    y = b.op(REDUCE_SHARD, x, world, 0, group, phase=BACKWARD)
    return b.finish([(y, GraphOutput("user", "y", 0))])


def _output(gm):
    return next(n for n in gm.graph.nodes if n.op == "output").args[0][0]


def test_only_gloo_reduce_scatters_by_all_to_all():
    assert reduce_scatter_by_all_to_all("gloo")
    assert not reduce_scatter_by_all_to_all("nccl")
    assert not reduce_scatter_by_all_to_all(None)


def test_on_gloo_a_reduce_shard_is_an_all_to_all_then_a_sum():
    gm = lower_collectives(_reduce_shard_graph(), context(backend="gloo"))
    gm.graph.lint()
    assert count(gm, c10d.reduce_scatter_tensor.default) == 0
    (a2a,) = gm.graph.find_nodes(op="call_function", target=A2A)
    assert tuple(a2a.args[0].meta[VAL].shape) == (6, 3)  # padded to whole shards, as for reduce_scatter_tensor
    assert a2a.args[1] == a2a.args[2] == [3, 3]
    assert a2a.meta[COLLECTIVE][0] == "reduce_scatter" and collective_kind(a2a) == "reduce_scatter_tensor"
    assert [u.target for u in a2a.users] == [WAIT]
    assert tuple(_output(gm).meta[VAL].shape) == (3, 3)
    assert _output(gm).target is aten.div.Tensor and _output(gm).args[1] == 2  # the average
    # elsewhere: the reduce-scatter itself
    native = lower_collectives(_reduce_shard_graph(), context(backend="nccl"))
    assert count(native, A2A) == 0 and count(native, c10d.reduce_scatter_tensor.default) == 1


def test_on_gloo_a_reduce_scatter_bucket_is_one_all_to_all():
    b = Builder()
    xs = [b.input(f"g{i}", (4, 2)) for i in range(3)]
    bucket = b.op(REDUCE_SHARD_BUCKET, xs, 2, 0, GROUP, phase=BACKWARD)
    outs = [b.op(aten.mul.Tensor, b.op(operator.getitem, bucket, i, phase=BACKWARD), 1.0) for i in range(3)]
    gm = b.finish([(o, GraphOutput("user", f"o{i}", i)) for i, o in enumerate(outs)])
    gm = lower_collectives(gm, context(backend="gloo"))
    gm.graph.lint()
    (a2a,) = gm.graph.find_nodes(op="call_function", target=A2A)
    assert a2a.meta[VAL].numel() == 24 and count(gm, c10d.reduce_scatter_tensor.default) == 0
    # each member's reader now reads its averaged shard, a view of the summed chunks
    assert [tuple(o.args[0].meta[VAL].shape) for o in outs] == [(2, 2)] * 3
    assert all(o.args[0].target is not operator.getitem or o.args[0].args[0] is not bucket for o in outs)


def test_the_sum_moves_late_with_the_wait():
    """The schedule moves an all-to-all's wait, and the sum and division that finish the reduce-scatter, to right
    before the first reader of the result: backward work in between overlaps the communication."""
    b = Builder()
    g = b.input("g", (8, 4), "grad", 0)
    x = b.input("x", (8, 4))
    shard = b.op(REDUCE_SHARD, g, 2, 0, GROUP, phase=BACKWARD)
    work = b.op(aten.mul.Tensor, b.op(aten.mul.Tensor, x, 2.0, phase=BACKWARD), 3.0, phase=BACKWARD)
    update = b.op(aten.add.Tensor, shard, 1.0, phase=OPTIMIZER)
    gm = b.finish([(update, GraphOutput("user", "u", 0)), (work, GraphOutput("user", "w", 1))])
    gm = schedule(lower_collectives(gm, context((param_info(0, (8, 4)),), backend="gloo")), context())
    gm.graph.lint()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    (a2a,) = gm.graph.find_nodes(op="call_function", target=A2A)
    (wait,) = a2a.users
    (last_work,) = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor and n.args[1] == 3.0]
    (total,) = gm.graph.find_nodes(op="call_function", target=aten.sum.dim_IntList)
    assert order[a2a] < order[last_work] < order[wait] < order[total]


def test_one_all_to_all_in_flight_at_a_time():
    """Each all-to-all holds its input and W chunks until its wait: the wait comes before the next is issued,
    even when the result is read only by the optimizer at the end."""
    b = Builder()
    g1, g2 = b.input("g1", (8, 4), "grad", 0), b.input("g2", (8, 4), "grad", 1)
    x = b.input("x", (8, 4))
    s1 = b.op(REDUCE_SHARD, g1, 2, 0, GROUP, phase=BACKWARD)
    s2 = b.op(REDUCE_SHARD, b.op(aten.mul.Tensor, g2, x, phase=BACKWARD), 2, 0, GROUP, phase=BACKWARD)
    both = b.op(aten.add.Tensor, s1, s2, phase=OPTIMIZER)
    gm = b.finish([(both, GraphOutput("user", "u", 0))])
    params = (param_info(0, (8, 4)), param_info(1, (8, 4)))
    gm = schedule(lower_collectives(gm, context(params, backend="gloo")), context(params))
    gm.graph.lint()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first, second = sorted(gm.graph.find_nodes(op="call_function", target=A2A), key=order.__getitem__)
    (wait,) = first.users
    assert order[wait] < order[second]


# ------------------------------------------------------------------------------------------- on real gloo ranks
def check_against_reduce_scatter(rank: int, world: int) -> None:
    group = dist.group.WORLD.group_name
    for rows, dtype in ((6, torch.float32), (5, torch.float32), (7, torch.bfloat16)):
        torch.manual_seed(rank)
        x = torch.randn(rows, 3).to(dtype)
        ctx = context(world=world, rank=rank, group=group, backend="gloo")
        gm = lower_collectives(_reduce_shard_graph((rows, 3), world, group, dtype), ctx)
        assert count(gm, A2A) == 1
        got = gm(x)[0]
        per = -(-rows // world)
        padded = torch.cat([x, x.new_zeros(per * world - rows, 3)])
        want = c10d.wait_tensor(c10d.reduce_scatter_tensor(padded, "avg", world, group))
        assert got.dtype == want.dtype and got.shape == want.shape
        if world == 2:
            assert torch.equal(got, want), (rows, dtype, (got - want).abs().max())
        else:
            torch.testing.assert_close(got, want)


def test_lowered_on_two_ranks_equals_reduce_scatter_bit_for_bit():
    run_ranks(2, "test_reduce_scatter_gloo.check_against_reduce_scatter", timeout=120)


def test_lowered_on_three_ranks_matches_reduce_scatter():
    run_ranks(3, "test_reduce_scatter_gloo.check_against_reduce_scatter", timeout=120)


def test_schedule_waits_each_reduce_scatter_before_the_next_is_issued():
    """A reduce-scatter's whole input is held until its wait (NCCL keeps it alive; gloo's all-to-all too): the
    wait moves no later than the next reduce-scatter's issue, even when nothing reads the result before both are
    done (a global-norm clip reads every gradient), so at most one gradient bucket is held whole."""
    b = Builder()
    x = b.input("x", (8, 4))
    waits = []
    for scale in (2.0, 3.0):
        g = b.op(aten.mul.Tensor, x, scale, phase=BACKWARD)
        c = b.op(c10d.reduce_scatter_tensor.default, g, "avg", 2, GROUP, phase=BACKWARD)
        waits.append(b.op(WAIT, c, phase=BACKWARD))
    both = b.op(aten.add.Tensor, *waits, phase=OPTIMIZER)
    gm = schedule(b.finish([(both, GraphOutput("user", "both", 0))]), context())
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    assert order["wait_tensor_default"] < order["reduce_scatter_tensor_default_1"]
