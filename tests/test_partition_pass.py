"""The ``partition`` pass (split mode: a joint graph cut into a forward and a backward graph) on small synthetic
graphs (``pass_graphs``)."""

from __future__ import annotations

from pass_graphs import Builder, aten, targets

from zgraph.graph import BACKWARD, INPUT, GraphOutput
from zgraph.ops import RNG_STATE, SET_RNG_STATE
from zgraph.passes.partition import partition


def _user(node):
    return GraphOutput("user", node.name, 0)


def test_partition_keeps_forward_generator_reads_in_the_forward():
    """A generator state read in the forward that only the backward uses (checkpoint's saved state, set back for
    the recomputation) runs in the forward graph and reaches the backward as a saved value; the backward's own
    read (the state to restore afterwards) and draws stay in the backward."""
    b = Builder()
    x = b.input("x", (4, 4))
    tangent = b.input("tangent", (4, 4), index=1)
    saved_state = b.op(RNG_STATE, "cpu")
    y = b.op(aten.mul.Tensor, x, 2.0)
    now = b.op(RNG_STATE, "cpu", phase=BACKWARD)
    b.op(SET_RNG_STATE, saved_state, "cpu", phase=BACKWARD)
    mask = b.op(aten.bernoulli.p, x, 0.5, phase=BACKWARD)
    b.op(SET_RNG_STATE, now, "cpu", phase=BACKWARD)
    dx = b.op(aten.mul.Tensor, b.op(aten.mul.Tensor, tangent, mask, phase=BACKWARD), 2.0, phase=BACKWARD)
    gm = b.finish([(y, _user(y)), (dx, GraphOutput("input_grad", "x", 0))])
    split = partition(gm, tangents={1})
    assert targets(split.forward).count(RNG_STATE) == 1 and SET_RNG_STATE not in targets(split.forward)
    assert targets(split.backward).count(RNG_STATE) == 1 and targets(split.backward).count(SET_RNG_STATE) == 2
    saved = [n for n in split.backward.graph.nodes if n.op == "placeholder" and n.meta[INPUT].kind == "saved"]
    first_set = next(n for n in split.backward.graph.nodes if n.target is SET_RNG_STATE)
    assert first_set.args[0] in saved
