"""``tag_phases``: every op node gets ``node.meta["phase"]`` in ``forward`` / ``backward`` / ``optimizer``.

Capture already tags what ran inside an autograd backward call (``backward``) and inside ``optimizer.step()``
or ``zero_grad()`` (``optimizer``). This pass tags the rest: a node that reads gradients (it depends on a
backward node or on a ``.grad`` input) and feeds no backward node is gradient post-processing such as
``clip_grad_norm_`` and belongs to ``optimizer``; everything else is ``forward``.

Provides ``phases``: later passes may rely on every ``call_function`` node having a phase.
"""

from __future__ import annotations

import torch.fx as fx

from zgraph.capture import BACKWARD, FORWARD, OPTIMIZER


def tag_phases(gm: fx.GraphModule, ctx: object) -> fx.GraphModule:
    """Tag every op with its phase: forward, backward or optimizer."""
    nodes = list(gm.graph.nodes)
    reads_grads: set[fx.Node] = set()
    for node in nodes:
        spec = node.meta.get("zgraph_input")
        if (spec is not None and spec.kind in ("grad", "input_grad")) or node.meta.get("phase") == BACKWARD:
            reads_grads.add(node)
        elif any(arg in reads_grads for arg in node.all_input_nodes):
            reads_grads.add(node)
    feeds_backward: set[fx.Node] = set()
    for node in reversed(nodes):
        if node.meta.get("phase") == BACKWARD or any(u in feeds_backward for u in node.users):
            feeds_backward.add(node)
    for node in nodes:
        if node.op != "call_function" or node.meta.get("phase"):
            continue
        node.meta["phase"] = OPTIMIZER if node in reads_grads and node not in feeds_backward else FORWARD
    return gm
