"""Provenance by hook: every node a pass creates carries ``node.meta[MADE_BY]``, the pass's name, however it was
created (``run_pass``, as inductor's ``GraphTransformObserver`` stamps its nodes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx

from zgraph.graph import MADE_BY

_KEPT = "zgraph_kept"  # node.meta, only while ``run_pass`` runs a pass: the node is one of the graph it received


def run_pass(name: str, gm: fx.GraphModule, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(gm, *args, **kwargs)`` (a pass), with ``node.meta[MADE_BY] = name`` on every node it creates.

    As inductor's ``GraphTransformObserver``: a create-node hook on ``gm``, and on the copies of it the pass makes
    (``copy.deepcopy`` and ``copy_graph_module`` carry it), sees each node made there — by ``insert``,
    ``graph.call_function`` / ``create_node``, ``node_copy`` — and the node is stamped when ``fn`` returns. A pass
    may instead return a module built on a graph of its own (``fx.Graph()``, then a ``GraphModule``), where no
    hook sees anything: there a node is the pass's unless it copies one of ``gm``'s (``node_copy`` copies a node's
    meta, and with it the mark ``gm``'s nodes carry while ``fn`` runs). A node that survives, in place or copied,
    keeps the stamp it had, or none."""
    created: list[fx.Node] = []
    modules = [gm]
    kept = list(gm.graph.nodes)
    gm._register_create_node_hook(created.append)
    gm._register_deepcopy_hook(modules.append)
    for node in kept:
        node.meta[_KEPT] = True
    try:
        out = fn(gm, *args, **kwargs)
        if isinstance(out, fx.GraphModule):
            modules.append(out)
            made, survivors = set(created), set(kept)
            for node in out.graph.nodes:
                if node in made or (node not in survivors and _KEPT not in node.meta):
                    node.meta[MADE_BY] = name
        return out
    finally:
        for module in modules:
            if created.append in getattr(module, "_create_node_hooks", ()):
                module._unregister_create_node_hook(created.append)
                module._unregister_deepcopy_hook(modules.append)
        for node in [*kept, *(n for module in modules for n in module.graph.nodes)]:
            node.meta.pop(_KEPT, None)
