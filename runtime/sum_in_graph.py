"""A pipeline stage's gradient contributions added into the micro-batch sums inside its graph (eager backend).

A stage's backward (or weight-gradient) graph returns each parameter's gradient contribution (``GraphOutput`` kind
``grad_contribution``), which ``zgraph.runtime.pipeline_run`` sums over the micro-batches. Added after the graph
returns, each sum is a second pass over every gradient of the stage, long after the graph wrote it (out of the
caches by then), and the stage's contributions are all alive at once when the graph ends. ``summing_variant``
makes the graph's twin for every micro-batch after the first: each contribution's sum is an input (``GraphInput``
kind ``grad_sum``, named by the contribution's marker, ``index`` its position among them) and
``aten.add_(sum, contribution)`` runs right after the contribution is made, as autograd's ``AccumulateGrad`` adds
a gradient into ``.grad`` as soon as it is computed; the contribution then goes (the eager backend lets a value go
after its last use) and is no longer returned. The sums must be the rank's own buffers (written in place).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zgraph.graph import OUTPUTS, VAL, GraphInput, add_input, output_node, placeholders
from zgraph.graph_copy import copy_graph_module

aten = torch.ops.aten


def summing_variant(gm: fx.GraphModule) -> fx.GraphModule | None:
    """A copy of ``gm`` adding each gradient contribution it returns into a ``grad_sum`` input (module docstring);
    None where it returns none."""
    roles = output_node(gm).meta[OUTPUTS]
    if not any(role.kind == "grad_contribution" for role in roles):
        return None
    out = copy_graph_module(gm)
    graph, node = out.graph, output_node(out)
    values, roles = list(node.args[0]), list(node.meta[OUTPUTS])
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_input = placeholders(out)[-1]
    made = order[last_input]  # a contribution after it is made by the graph; else it is an input
    kept_values, kept_roles, sums = [], [], 0
    for value, role in zip(values, roles):
        if role.kind != "grad_contribution" or not isinstance(value, fx.Node):
            kept_values.append(value)
            kept_roles.append(role)
            continue
        total = add_input(out, f"grad_sum_{sums}", GraphInput("grad_sum", role.name, sums), value.meta[VAL])
        last_input, sums = total, sums + 1
        with graph.inserting_after(value if order[value] > made else last_input):
            graph.call_function(aten.add_.Tensor, (total, value)).meta[VAL] = total.meta[VAL]
    node.args = (tuple(kept_values),)
    node.meta[OUTPUTS] = kept_roles
    out.recompile()
    return out
