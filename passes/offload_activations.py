"""``offload_activations``: saved activations (forward values the backward reads) leave the compute device's memory
between their last forward use and their first backward use (``Config.offload_activations``): ``"nvme"`` (files
under ``offload_dir``) or ``"cpu"`` (host memory, for a model on a device; on the CPU ``"cpu"`` is the identity).

Plan (``plan_offload_activations``): the forward nodes whose value a backward node reads, in graph order, except

* graph inputs and views of them (parameters, the batch: held by the caller anyway, and parameters are the
  ``offload`` pass's), values the optimizer reads or the graph returns, and values under ``min_bytes`` or
  without elements (0-d values, tokens) at the sizes the graph was captured at (symbolic sizes: their hints);
* on ``"cpu"``, values already on the host.

Rewrite, for each planned value (``key``: its position in the plan):

* ``token = zgraph::stash(value, key)`` right after the value's last forward reader (after the value itself when
  only the backward reads it): the tier takes a copy, and nothing on the device holds the value any more;
* ``zgraph::unstash(token, key, size, stride, dtype)`` right before its first backward reader, which all its
  backward readers read instead: a new tensor, the same shape, strides, dtype, device and bits. The runtime reads
  ahead of it (in the order of the unstash nodes, within ``Config.prefetch_bytes``), so the node only waits.

The pass runs after ``remat`` (a recomputed value is not saved, so it is not offloaded; the saved values that
recomputations read are) and before the sharding passes (their gathers and reductions never see a stash). In split
mode (``ctx.split``: a joint graph cut into a forward and a backward graph run in two calls) the saved values are
autograd's, kept between the calls: the pass leaves that graph as it is. Training is bitwise the same: only
where values are kept changes, never an operation.

Later passes may rely on: stash nodes are forward-phase, unstash nodes backward-phase; no other node changed.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from zgraph.graph import BACKWARD, FORWARD, OPTIMIZER, PHASE, VAL, insert, offload_moves, tensor_bytes
from zgraph.ops import STASH, UNSTASH
from zgraph.passes.pass_list import PassContext
from zgraph.sizes import size_hint

TIERS = ("cpu", "nvme")


def offload_activations_applies(
    gm: fx.GraphModule, ctx: PassContext, *, tier: str | None = None, min_bytes: int = 0
) -> bool:
    """Whether ``offload_activations`` changes the graph: only where ``tier`` moves values off the device, in a
    whole step (``Pass.applies``)."""
    return offload_moves(tier, ctx.device_type) and not ctx.split


def offload_activations(
    gm: fx.GraphModule, ctx: PassContext, *, tier: str | None = None, min_bytes: int = 0
) -> fx.GraphModule:
    """Saved activations stashed after their last forward use and unstashed before their first backward use.

    ``tier``: ``Config.offload_activations`` (``"cpu"`` changes the graph only when ``ctx.device_type`` is not the
    CPU); ``min_bytes``: smaller values stay where they are."""
    if not offload_activations_applies(gm, ctx, tier=tier, min_bytes=min_bytes):
        return gm
    offload_values(gm, plan_offload_activations(gm, min_bytes=min_bytes, host_too=tier == "nvme"))
    return gm


def plan_offload_activations(gm: fx.GraphModule, min_bytes: int = 0, host_too: bool = True) -> list[fx.Node]:
    """The forward values to offload, in graph order (module docstring); ``host_too``: values on the CPU as well."""
    chosen = []
    for node in gm.graph.nodes:
        if _phase(node) != FORWARD or not any(_phase(u) == BACKWARD for u in node.users):
            continue
        val = node.meta.get(VAL)
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or size_hint(val.numel()) == 0:
            continue
        if tensor_bytes(val) < min_bytes or (not host_too and val.device.type == "cpu"):
            continue
        if any(_phase(u) == OPTIMIZER or u.op == "output" for u in node.users) or _views_an_input(node):
            continue
        chosen.append(node)
    return chosen


def offload_values(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    """Stash each of ``nodes`` after its last forward reader, unstash it before its first backward reader."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for key, node in enumerate(nodes):
        readers = sorted(node.users, key=order.__getitem__)
        backward = [u for u in readers if _phase(u) == BACKWARD]
        forward = [u for u in readers if _phase(u) != BACKWARD]
        token = insert(gm, STASH, (node, key), after=forward[-1] if forward else node, phase=FORWARD)
        val = node.meta[VAL]
        args = (token, key, list(val.shape), list(val.stride()), val.dtype)
        back = insert(gm, UNSTASH, args, before=backward[0], phase=BACKWARD)
        for user in backward:
            user.replace_input_with(node, back)


def _views_an_input(node: fx.Node) -> bool:
    """Whether ``node``'s value shares the memory of a graph input (a chain of views, or tuple elements, of one)."""
    while node.op == "call_function":
        source = _aliased(node)
        if source is None:
            return False
        node = source
    return node.op == "placeholder"


def _aliased(node: fx.Node) -> fx.Node | None:
    """The argument whose memory ``node``'s result shares (a view's base; a tuple element's tuple), or None."""
    if node.target is operator.getitem:
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return None
    if target._schema.returns[0].alias_info is None or target._schema.is_mutable:
        return None
    first = node.args[0] if node.args else None
    return first if isinstance(first, fx.Node) else None


def _phase(node: fx.Node) -> str | None:
    return node.meta.get(PHASE) if node.op == "call_function" else None
