"""Inductor runs the ops that share a random generator in the graph's order.

Why: the step graph's random ops are compiled with ``fallback_random`` (``zgraph.runtime.executor``): each calls its
aten kernel on the global generator, so it draws eager's numbers only if every draw, every read of the generator's
state (``zgraph::rng_state``) and every write of it (``zgraph::set_rng_state``, where ``torch.utils.checkpoint``
recomputes a block) runs in the graph's order. Nothing in the data says so. Inductor's FX locality pass keeps ops
tagged ``nondeterministic_seeded`` in place, but its scheduler orders kernels by data alone: fusion moved the
buffer a dropout mask is drawn into behind the next block's masks, and ``reorder_for_peak_memory`` hoisted a state
read (it has no inputs) to the start of the step and a restore to right after the read it restores. A recomputed
block then drew other masks than its forward (issue 40: losses 2e-2 off within 3 steps, generator state wrong).

The rule (``KeepGeneratorOrder``): before fusion, each scheduler node that runs an op tagged
``nondeterministic_seeded`` gets an ordering-only dependency (a fake ``WeakDep``, which extends no buffer's life)
on the previous one, as inductor orders collectives (``comms.decide_global_ordering_of_comms``). Fusion and every
later reordering respect it; everything else is scheduled as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomSchedulerPass, get_hash_for_files
from torch._inductor.dependencies import WeakDep


def _draws(snode: Any) -> bool:
    """Whether a scheduler node (or a node fused or grouped into it) runs an op that uses a random generator."""
    return any(
        torch.Tag.nondeterministic_seeded in getattr(getattr(inner.node, "op_overload", None), "tags", ())
        for inner in snode.get_nodes()
    )


class KeepGeneratorOrder(CustomSchedulerPass):
    """Inductor's ``_pre_fusion_custom_pass``: chain the generator's users in their order (module doc)."""

    def __call__(self, nodes: list[Any]) -> list[Any]:
        users = [n for n in nodes if _draws(n)]
        for before, after in zip(users, users[1:]):
            mutating = next(iter(after.get_buffer_names()))
            for name in before.get_buffer_names():
                after.add_fake_dep(WeakDep(name, mutating_buf=mutating, is_fake=True))
        return nodes

    def uuid(self) -> bytes:
        """Part of inductor's cache key: compiled code is reused only with this rule as it is now."""
        return get_hash_for_files((__file__,))
