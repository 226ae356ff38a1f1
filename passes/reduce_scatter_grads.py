"""``reduce_scatter_grads``: turn each rank's local gradients into the global-batch gradient.

Placeholder for the single-process case: every ``zgraph::grad_contribution`` marker is replaced by its input.
"""

from __future__ import annotations

import torch.fx as fx

from zgraph.ops import GRAD_CONTRIBUTION


def reduce_scatter_grads(gm: fx.GraphModule, ctx: object) -> fx.GraphModule:
    """Average gradient contributions across ranks (identity on one process)."""
    for node in list(gm.graph.nodes):
        if node.target is GRAD_CONTRIBUTION:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    return gm
