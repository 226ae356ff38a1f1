"""``sizes_from_inputs``: a pipelined step's symbolic sizes computed from the step's arguments, not its activations.

A step captured with symbolic sizes (a batch or sequence length that changes between calls) reads sizes off its
values: ``aten.sym_size.int`` of an activation, and Python arithmetic on such sizes, for views and new tensors. Cut
into pipeline stages, a size read in one stage and used in another would have to cross the boundary, where only
tensors travel. Each size is a formula in the size symbols, which are dimensions of the step's tensor arguments
(``zgraph.sizes``), so this pass computes every one of them from the arguments' sizes instead (torch's
``Graph.materialize_symints``, at the top of the graph): nodes that read only the step's arguments, which
``stage_cut`` leaves free and copies into each stage graph that reads them. A no-op at static sizes.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from zgraph.graph import FORWARD, PHASE, VAL, eliminate_dead_code
from zgraph.passes.pass_list import PassContext

aten = torch.ops.aten
_SIZE_OPS = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, operator.add, operator.sub,
             operator.mul, operator.floordiv, operator.mod, operator.neg, operator.pow, operator.truediv, math.ceil,
             math.floor, torch.sym_max, torch.sym_min, torch.sym_sqrt, torch.sym_float, torch.sym_int}  # fmt: skip


def size_arithmetic(node: fx.Node) -> bool:
    """Whether ``node`` computes a size from sizes (``aten.sym_size.int``, Python arithmetic on ``SymInt``s): pure,
    so a copy of it may run in any graph that has its inputs."""
    return node.target in _SIZE_OPS and isinstance(node.meta.get(VAL), (int, float, torch.SymInt, torch.SymFloat))


def sizes_from_inputs(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Every symbolic size a node computes, computed from the step's arguments' sizes instead; returns ``gm``."""
    sized = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.meta.get(VAL), torch.SymInt) and not n.meta[VAL].node.expr.is_number
    ]
    if not sized:
        return gm
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        made = gm.graph.materialize_symints([n.meta[VAL] for n in sized])
    for node in gm.graph.nodes:
        if node is first:
            break
        if node.op == "call_function":
            node.meta.setdefault(PHASE, FORWARD)
    for node, size in zip(sized, made):
        if size is not node:
            node.replace_all_uses_with(size)
    eliminate_dead_code(gm.graph)
    gm.recompile()
    return gm
