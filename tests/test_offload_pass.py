"""Unit tests of the ``offload`` pass on parameter shards (stage 3, ``Config.offload_params="nvme"``) on small
synthetic graphs, and of how ``bucket`` / ``schedule`` place the reloads it inserts."""

from __future__ import annotations

import torch
from pass_graphs import Builder, aten, context, count, param

from zgraph.graph import BACKWARD, FORWARD, MADE_BY, OPTIMIZER, OUTPUTS, PHASE, GraphOutput
from zgraph.ops import RELOAD, UNSHARD, WRITE_BACK
from zgraph.passes import PassContext
from zgraph.passes.bucket import bucket
from zgraph.passes.lower_collectives import lower_collectives
from zgraph.passes.offload import offload
from zgraph.passes.provenance import run_pass
from zgraph.passes.schedule import schedule
from zgraph.passes.shard_params import shard_params

c10d = torch.ops._c10d_functional


def _user(node: torch.fx.Node) -> GraphOutput:
    return GraphOutput("user", node.name, 0)


def _stage3_step() -> tuple[torch.fx.GraphModule, PassContext]:
    """Two parameters, stage 3 (``shard_params`` ran): ``w`` sharded, read in forward, backward and the update;
    ``b`` whole (persistent), read in forward and the update."""
    b = Builder()
    w = b.input("w", (8, 4), "param", 0)
    bias = b.input("b", (4,), "param", 1)
    x = b.input("x", (2, 8))
    y = b.op(aten.add.Tensor, b.op(aten.mm.default, x, w), bias)
    gy = b.op(aten.mul.Tensor, y, 2.0, phase=BACKWARD)
    gx = b.op(aten.mm.default, gy, b.op(aten.t.default, w, phase=BACKWARD), phase=BACKWARD)
    new_w = b.op(aten.mul.Tensor, w, 0.5, phase=OPTIMIZER)
    new_b = b.op(aten.mul.Tensor, bias, 0.5, phase=OPTIMIZER)
    gm = b.finish([(gx, _user(gx)), (new_w, GraphOutput("param", "w", 0)), (new_b, GraphOutput("param", "b", 1))])
    ctx = context((param(0, (8, 4)), param(1, (4,), persistent=True)))
    return shard_params(gm, ctx, stage=3), ctx


def test_offload_params_reloads_the_shard_per_phase_and_writes_back_its_update():
    gm, ctx = _stage3_step()
    gm = run_pass("offload", gm, offload, ctx, params="nvme")
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    reloads = [n for n in nodes if n.target is RELOAD]
    assert [(n.args[1], n.meta[PHASE]) for n in reloads] == [(0, FORWARD), (0, BACKWARD), (0, OPTIMIZER)]
    w = nodes[0]
    assert set(w.users) == set(reloads)  # the placeholder is only a shape now; the persistent b stays as it was
    for r in reloads:
        readers = sorted(r.users, key=nodes.index)
        assert nodes.index(readers[0]) == nodes.index(r) + 1  # right before the phase's first read
        assert {u.meta[PHASE] for u in readers} == {r.meta[PHASE]}  # and read only within that phase
    assert [u.target for u in reloads[0].users] == [UNSHARD] and [u.target for u in reloads[1].users] == [UNSHARD]
    (write,) = [n for n in nodes if n.target is WRITE_BACK]
    assert write.args == (nodes[nodes.index(write) - 1], 0) and write.args[0].args[0] is reloads[2]
    out = nodes[-1]
    assert [r.kind for r in out.meta[OUTPUTS]] == ["user", "offloaded", "param"]
    assert all(n.meta[MADE_BY] == "offload" for n in (*reloads, write))
    for params in (None, "cpu"):  # and optimizer states only when their own tier says so
        assert count(offload(_stage3_step()[0], ctx, params=params), RELOAD) == 0


def test_offload_params_and_states_together_and_the_reloads_move_with_their_gathers():
    gm, ctx = _stage3_step()
    gm = offload(gm, ctx, tier="nvme", params="nvme")
    assert count(gm, RELOAD) == 3 and count(gm, WRITE_BACK) == 1  # no states in this graph: the shard only
    lowered = schedule(lower_collectives(bucket(gm, ctx), ctx), ctx, prefetch_bytes=1)  # no prefetch
    lowered.graph.lint()
    nodes = list(lowered.graph.nodes)
    forward, backward, update = (n for n in nodes if n.target is RELOAD)
    for r in (forward, backward):
        (gather,) = r.users  # issued together with the gather it feeds, not at the start of the step
        assert gather.target is c10d.all_gather_into_tensor.default and nodes.index(gather) == nodes.index(r) + 1
    assert nodes.index(backward) > max(nodes.index(n) for n in nodes if n.meta.get(PHASE) == FORWARD)
    first_read = min(nodes.index(u) for u in update.users)
    assert nodes.index(update) == first_read - 1  # the update's reload: right before the update
