"""``sizes_from_inputs`` on a small graph traced with symbolic sizes: a size read off an activation (and arithmetic on
it) is computed from the argument's size instead, by nodes ``stage_cut`` leaves free; the graph computes the same at
other sizes. ``concrete_shape``: a symbolic shape at a call's sizes."""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from zgraph.graph import INPUT, OUTPUTS, PHASE, VAL, GraphInput, GraphOutput, output_node, placeholders
from zgraph.passes import PassContext
from zgraph.passes.sizes_from_inputs import size_arithmetic, sizes_from_inputs
from zgraph.passes.stage_cut import free_nodes
from zgraph.sizes import concrete_shape, input_sizes

aten = torch.ops.aten


def _step(x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ torch.ones(4, 6))
    return h.reshape(h.shape[0] * 2, 3).sum(-1)  # a size of an activation, doubled


def _graph() -> torch.fx.GraphModule:
    """``_step`` traced with symbolic sizes, its reshape's size read off the activation (as a traced step's may
    be: make_fx reads this one off the argument)."""
    gm = make_fx(_step, tracing_mode="symbolic")(torch.randn(5, 4))
    for node in gm.graph.nodes:
        node.meta[PHASE] = "forward"
    (x,) = placeholders(gm)
    x.meta[INPUT] = GraphInput("input", "x", 0)
    output_node(gm).meta[OUTPUTS] = [GraphOutput("user", "out", 0)]
    tanh = next(n for n in gm.graph.nodes if n.target is aten.tanh.default)
    reshape = next(n for n in gm.graph.nodes if n.target is aten.view.default)
    with gm.graph.inserting_after(tanh):
        rows = gm.graph.call_function(aten.sym_size.int, (tanh, 0))
    with gm.graph.inserting_after(rows):
        doubled = gm.graph.call_function(operator.mul, (rows, 2))
    rows.meta.update({VAL: tanh.meta[VAL].shape[0], PHASE: "forward"})
    doubled.meta.update({VAL: tanh.meta[VAL].shape[0] * 2, PHASE: "forward"})
    reshape.args = (reshape.args[0], [doubled, 3])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def test_a_size_read_off_an_activation_is_computed_from_the_arguments_size():
    gm = _graph()
    read = [n for n in gm.graph.nodes if n.target is aten.sym_size.int]
    assert read and read[0].args[0].op != "placeholder", "the traced graph reads the size off the activation"
    sizes_from_inputs(gm, PassContext())
    read = [n for n in gm.graph.nodes if n.target is aten.sym_size.int]
    assert read and all(n.args[0].op == "placeholder" for n in read)
    sized = [n for n in gm.graph.nodes if isinstance(n.meta.get(VAL), torch.SymInt)]
    assert sized and all(size_arithmetic(n) for n in sized)
    assert set(sized) <= free_nodes(gm), "every size is free: copied into each stage graph that reads it"
    for rows in (3, 8):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(gm(x), _step(x))


def test_a_graph_of_static_sizes_is_left_as_it_is():
    gm = make_fx(_step)(torch.randn(5, 4))
    before = [n.format_node() for n in gm.graph.nodes]
    assert sizes_from_inputs(gm, PassContext()) is gm
    assert [n.format_node() for n in gm.graph.nodes] == before


def test_a_symbolic_shape_at_a_calls_sizes():
    gm = _graph()
    (x,) = placeholders(gm)
    table = input_sizes(gm)
    assert list(table.values()) == [(0, 0)], "the rows of argument 0"
    (symbol,) = table
    shape = x.meta[VAL].shape
    rows = shape[0] * 2
    assert concrete_shape((rows, shape[1], 3), {symbol: 7}) == (14, 4, 3)
