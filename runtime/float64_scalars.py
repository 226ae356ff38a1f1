"""Python arithmetic on host scalars computed in float64, as eager computes it, for inductor.

An optimizer traced as written computes numbers from its hyper-parameters and step counters in Python (``1 -
beta2``, ``1 - beta2 ** step``, RAdam's rectification): in the graph, ``operator`` nodes on the ``.item()`` symbols.
Eager computes them in double and rounds the result once, where a kernel takes it. Inductor passes a float symbol
to its kernels as a 32-bit float and evaluates the expression there (``1 - beta2`` for ``beta2 = 0.999`` is then
off by 1.3e-5 of itself). ``float64_scalars`` computes each such expression from the 0-d tensors its symbols are read
from, as float64 tensor ops, and reads the result with ``.item()``: one symbol, rounded once, as eager's float. Only
expressions over tensors on the host (hyper-parameters, step counters): reading one on a device would wait for it.
The new nodes have no fake values: ``zgraph.runtime.unbacked_scalars`` makes them, right after.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from zgraph.graph import VAL

aten = torch.ops.aten
ARITHMETIC = {
    operator.add: aten.add.Tensor,
    operator.sub: aten.sub.Tensor,
    operator.mul: aten.mul.Tensor,
    operator.truediv: aten.div.Tensor,
    operator.pow: aten.pow.Tensor_Tensor,
    operator.neg: aten.neg.default,
    torch.sym_max: aten.maximum.default,
    torch.sym_min: aten.minimum.default,
}


def float64_scalars(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace each Python arithmetic node on host scalars (``ARITHMETIC``, a float result) by the ``.item()`` of
    the same arithmetic on float64 0-d tensors; in place, returns ``gm``."""
    tensors: dict[fx.Node, fx.Node] = {}  # a scalar node -> the float64 0-d tensor node it is the value of
    made = []
    for node in list(gm.graph.nodes):
        if not _convertible(node, tensors):
            continue
        with gm.graph.inserting_before(node):
            operands = tuple(_tensor(gm.graph, a, tensors) for a in node.args)
            tensor = gm.graph.call_function(ARITHMETIC[node.target], operands)
            value = gm.graph.call_function(aten._local_scalar_dense.default, (tensor,))
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)
        tensors[value] = tensor
        made.append(value)
    for value in made:  # read only by arithmetic that became tensor ops
        if not value.users:
            gm.graph.erase_node(value)
    gm.recompile()
    return gm


def _convertible(node: fx.Node, tensors: dict[fx.Node, fx.Node]) -> bool:
    """Whether ``node`` is Python arithmetic with a float result whose operands are numbers, host scalars read
    with ``.item()``, or results of arithmetic already converted."""
    if node.op != "call_function" or node.target not in ARITHMETIC or node.kwargs:
        return False
    if not isinstance(node.meta.get(VAL), torch.SymFloat):
        return False
    return all(
        (isinstance(a, (int, float)) and not isinstance(a, bool))
        or (isinstance(a, fx.Node) and a in tensors)
        or _host_item(a)
        for a in node.args
    )


def _host_item(arg: object) -> bool:
    """Whether ``arg`` is an ``.item()`` node of a number read from a tensor on the host."""
    if not isinstance(arg, fx.Node) or arg.target is not aten._local_scalar_dense.default:
        return False
    source = arg.args[0].meta.get(VAL)
    scalar = isinstance(arg.meta.get(VAL), (torch.SymFloat, torch.SymInt))
    return scalar and isinstance(source, torch.Tensor) and source.device.type == "cpu"


def _tensor(graph: fx.Graph, arg: object, tensors: dict[fx.Node, fx.Node]) -> fx.Node:
    """The float64 0-d tensor node whose value ``arg`` (an operand ``_convertible`` accepts) is."""
    if not isinstance(arg, fx.Node):
        return graph.call_function(aten.scalar_tensor.default, (float(arg),), {"dtype": torch.float64})
    if arg not in tensors:  # a host scalar's tensor, read once
        tensors[arg] = graph.call_function(aten._to_copy.default, (arg.args[0],), {"dtype": torch.float64})
    return tensors[arg]
