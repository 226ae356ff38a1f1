"""The ``sequence_parallel`` pass alone on small synthetic graphs (``pass_graphs``): a rank of a sequence group of 2
holding slice 1 (4 tokens of 8) of a batch of 2 sequences, 4 heads of 8 dimensions."""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
from pass_graphs import Builder, aten, context, count

from zgraph.errors import PassError
from zgraph.graph import ALL_TO_ALL, BACKWARD, VAL, Axis, GraphOutput, collective_kind
from zgraph.passes.lower_collectives import lower_collectives
from zgraph.passes.sequence_parallel import sequence_parallel
from zgraph.runtime.cost_model import analytical_cost_model, link_seconds
from zgraph.sequence_ops import HEADS_TO_SEQ, SEQ_TO_HEADS

FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQUENCE = "sequence_group"


def _ctx(size: int = 2):
    return dataclasses.replace(context(world=2, rank=1), sequence_group=Axis(size=size, rank=1, name=SEQUENCE))


def _attention(heads: int = 4, mask: bool = False, backward: bool = True):
    b = Builder()
    q, k, v = (b.input(name, (2, heads, 4, 8)) for name in "qkv")
    table = b.input("pos_ids", (16,), "buffer", 0)
    positions = b.op(aten.slice.Tensor, table, 0, 0, 4)  # the model's position table, first 4 rows
    counted = b.op(aten.arange.default, 4)
    kwargs = {"attn_mask": b.input("mask", (4, 4))} if mask else {}
    attention = b.op(FLASH, q, k, v, 0.0, True, **kwargs)
    out, lse = (b.op(operator.getitem, attention, i) for i in range(2))
    outputs = [(out, GraphOutput("user", "out", 0)), (positions, GraphOutput("user", "p", 1))]
    outputs.append((counted, GraphOutput("user", "c", 2)))
    if backward:
        grad = b.input("grad", (2, heads, 4, 8))
        saved = b.op(aten.detach.default, out, phase=BACKWARD)
        grads = b.op(FLASH_BACKWARD, grad, q, k, v, saved, lse, 0.0, True, phase=BACKWARD)
        for i in range(3):
            outputs.append((b.op(operator.getitem, grads, i, phase=BACKWARD), GraphOutput("user", f"g{i}", 3 + i)))
    return b.finish(outputs)


def _output(gm):
    return [n for n in gm.graph.nodes if n.op == "output"][0].args[0]


def test_all_to_alls_wrap_forward_and_backward_attention():
    before = [v.meta[VAL].stride() for v in _output(_attention())]
    gm = sequence_parallel(_attention(), _ctx())
    gm.graph.lint()
    assert count(gm, SEQ_TO_HEADS) == 4  # q, k, v and the output's gradient
    assert count(gm, HEADS_TO_SEQ) == 4  # the output and the gradients of q, k and v
    (attention,) = [n for n in gm.graph.nodes if n.target is FLASH]
    assert tuple(attention.meta[VAL][0].shape) == (2, 2, 8, 8)  # 2 of 4 heads, the whole sequence of 8
    (backward,) = [n for n in gm.graph.nodes if n.target is FLASH_BACKWARD]
    assert backward.args[1:4] == attention.args[:3] and backward.args[4].args[0] is attention
    out, positions, counted, *grads = _output(gm)
    for value in (out, *grads):
        assert tuple(value.meta[VAL].shape) == (2, 4, 4, 8)  # back to the slice of all heads
    for i in (0, 3, 4, 5):  # the strides the kernels gave them: their readers were traced with those
        assert _output(gm)[i].meta[VAL].stride() == before[i]


def test_positions_move_to_the_slice():
    gm = sequence_parallel(_attention(), _ctx())
    _, positions, counted, *_ = _output(gm)
    assert positions.args[2:] == (4, 8)  # rows 4..7 of the position table
    assert counted.target is aten.arange.start and counted.args == (4, 8)


def test_lowered_to_all_to_all():
    """Each exchange becomes an ``all_to_all_single``, counted as the ``all_to_all`` kind (not as a reduce-scatter,
    which gloo also runs as one) and priced as a reduce-scatter of as many bytes."""
    gm = lower_collectives(sequence_parallel(_attention(), _ctx()), _ctx())
    exchanges = [n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_to_all_single.default]
    assert len(exchanges) == 8 and {collective_kind(n) for n in exchanges} == {ALL_TO_ALL}
    assert count(gm, SEQ_TO_HEADS) == count(gm, HEADS_TO_SEQ) == 0
    model = analytical_cost_model("gloo")
    priced = model.collective_seconds("reduce_scatter_tensor", 4096)
    assert link_seconds(model, ALL_TO_ALL, 4096, False) == priced


def test_refused_inputs_name_what_is_wrong():
    with pytest.raises(PassError, match="must divide the attention's head count: .* 3 query heads"):
        sequence_parallel(_attention(heads=3), _ctx())
    with pytest.raises(PassError, match="explicit attn_mask"):
        sequence_parallel(_attention(mask=True, backward=False), _ctx())
    b = Builder()
    x = b.input("x", (2, 4, 8))
    y = b.op(aten.softmax.int, b.op(aten.bmm.default, x, b.op(aten.transpose.int, x, 1, 2)), -1, False)
    with pytest.raises(PassError, match="no scaled_dot_product_attention"):
        sequence_parallel(b.finish([(y, GraphOutput("user", "y", 0))]), _ctx())


def test_without_a_sequence_group_nothing_changes():
    gm = sequence_parallel(_attention(), context())
    assert count(gm, SEQ_TO_HEADS) == 0
