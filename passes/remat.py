"""``remat``: activation recomputation. Forward values the backward reads are recomputed in the backward instead of
being kept alive from the forward to the backward (``Config.remat``).

Plan, then rewrite (as inductor's bucketing): ``plan_recompute`` returns the forward nodes to recompute,
``recompute`` copies each of them (``node_copy``) right before its first backward reader (or before the first copy
that reads it) and points the backward readers at the copy; the forward original then dies after its last forward
use. Forward and optimizer readers keep reading the original.

``"selective"`` (torchtitan's default selective activation checkpointing policy): the outputs of matmul-like ops
(``mm``, ``addmm``, ``bmm``, ``baddbmm``, the ``_scaled_dot_product_*`` attentions, ``convolution``) and of random
ops are saved; every other forward value the backward reads (pointwise ops, norms, softmax, views, casts) is
recomputed from saved values and graph inputs, and so, recursively, is every such value it is computed from, up to
the values that cross a block's edge (its inputs and outputs, the residual stream between blocks): those are saved,
so a chain never reaches back into earlier blocks.

``"full"`` (``torch.utils.checkpoint`` around every block): only each block's inputs are saved, and every value
inside a block the backward reads is recomputed from them (matmuls included). Blocks are the model's repeated
modules, as capture marks them (``node.meta[CUSTOM][BLOCK]``, see ``zgraph.graph``); values outside every block are
saved as without recomputation. A graph whose backward reads forward values but that has no blocks is refused
(``PassError``): ``"selective"`` needs none.

A mapping from block names to policies (``{"layers.0": "full", "layers.1": "selective"}``, what the memory
planner chooses) applies each policy to the values of its block; blocks it leaves out, and values outside every
block, are saved. A name that is not one of the graph's blocks is refused (``PassError``).

Random ops (``nondeterministic_seeded``: dropout's ``bernoulli`` / ``native_dropout``, ``rand*``, the generator
state) and ops whose output is undefined memory (``empty*``) are never recomputed: their outputs are saved, so the
step's results stay bitwise those of the step without recomputation (a deterministic op run again on the same
inputs gives the same bits). Collectives and zgraph's own operators are not recomputed either.

The pass runs before the sharding passes: a recomputed op that reads a parameter reads the placeholder in the
backward, so stage 3's ``shard_params`` gathers it with the backward's other reads of that parameter.

Later passes may rely on: every node the pass adds is a backward-phase copy of a forward node, placed before all
of its readers; no forward node has a new reader; random draws are where they were.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping

import torch
import torch.fx as fx

from zgraph.errors import PassError
from zgraph.graph import BACKWARD, BLOCK, CUSTOM, FORWARD, PHASE
from zgraph.passes.pass_list import PassContext

aten = torch.ops.aten

POLICIES = ("full", "selective")

Policy = str | Mapping[str, str | None]

# Ops whose outputs "selective" saves (torchtitan's _save_list, by overload packet).
SAVED_OPS = frozenset(
    {
        aten.mm,
        aten.addmm,
        aten.bmm,
        aten.baddbmm,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_cudnn_attention,
        aten._scaled_mm,
        aten.convolution,
    }
)
# Ops whose output is uninitialised memory: running one again does not give the same values.
_UNDEFINED = frozenset({aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided, aten.new_empty_strided})


def remat_applies(gm: fx.GraphModule, ctx: PassContext, *, policy: Policy | None = None) -> bool:
    """Whether ``remat`` changes the graph: only with a policy (``Pass.applies``)."""
    return policy is not None


def remat(gm: fx.GraphModule, ctx: PassContext, *, policy: Policy | None = None) -> fx.GraphModule:
    """Recompute forward values in the backward instead of saving them (``Config.remat``).

    ``policy``: None (the pass does nothing), ``"selective"``, ``"full"``, or a mapping from block names to either
    (see the module's docstring)."""
    if not remat_applies(gm, ctx, policy=policy):
        return gm
    if isinstance(policy, Mapping):
        for value in policy.values():
            _check_policy(value, allow_none=True)
    else:
        _check_policy(policy, allow_none=False)
    recompute(gm, plan_recompute(gm, policy))
    return gm


def _check_policy(policy: object, *, allow_none: bool) -> None:
    if not (policy in POLICIES or (allow_none and policy is None)):
        raise ValueError(f"remat policy must be one of {POLICIES}{' or None' if allow_none else ''}; got {policy!r}")


def blocks_in(gm: fx.GraphModule) -> list[str]:
    """The names of the blocks whose forward made nodes of ``gm``, in forward order."""
    return list(dict.fromkeys(b for n in gm.graph.nodes if _is_forward(n) and (b := block_of(n)) is not None))


def plan_recompute(gm: fx.GraphModule, policy: Policy = "selective") -> list[fx.Node]:
    """The forward nodes ``policy`` recomputes in the backward, in graph order.

    From each forward value the backward reads, recomputable values are followed back through their inputs; the
    first ones that are not are saved, and so are those read outside their own block (a block's inputs and outputs);
    for ``"full"``, also those outside the reader's block."""
    read = [n for n in gm.graph.nodes if _is_forward(n) and any(_is_backward(u) for u in n.users)]
    policy_of = _policy_of(gm, policy, bool(read))
    chosen: set[fx.Node] = set()
    stack = [(n, block_of(n)) for n in read if policy_of(block_of(n)) is not None]
    while stack:
        node, block = stack.pop()
        if node not in chosen and _chosen_by(node, block, policy_of(block) == "full"):
            chosen.add(node)
            stack.extend((a, block) for a in node.all_input_nodes if _is_forward(a))
    return [n for n in gm.graph.nodes if n in chosen]


def _policy_of(gm: fx.GraphModule, policy: Policy, reads: bool) -> Callable[[str | None], str | None]:
    """The policy for the values of a block (None: values outside every block). Refuses ``"full"`` for a graph
    without blocks whose backward reads forward values, and a mapping naming blocks the graph lacks."""
    blocks = blocks_in(gm)
    if isinstance(policy, Mapping):
        unknown = [name for name in policy if name not in blocks]
        if unknown:
            raise PassError(
                f"Config.remat names blocks this step's models lack: {', '.join(map(repr, unknown))}; its blocks "
                f"are {', '.join(map(repr, blocks)) or 'none'}"
            )
        return lambda block: policy.get(block) if block is not None else None
    if policy == "full" and reads and not blocks:
        raise PassError(
            'Config.remat="full" recomputes each of the model\'s repeated blocks (the children of an nn.ModuleList '
            'or nn.Sequential of modules of one class), and this step\'s models have none; use remat="selective"'
        )
    return lambda block: policy


def _chosen_by(node: fx.Node, block: str | None, full: bool) -> bool:
    """Whether the policy recomputes ``node``, reached from a backward read of a value of ``block``."""
    if not recomputable(node, saving_matmuls=not full) or leaves_block(node):
        return False
    return not full or (block is not None and block_of(node) == block)


def leaves_block(node: fx.Node) -> bool:
    """Whether a forward value is read in the forward outside the block that made it (the next block's input, or
    the input of what follows the blocks): both policies save it."""
    return any(_is_forward(u) and block_of(u) != block_of(node) for u in node.users)


def block_of(node: fx.Node) -> str | None:
    """The block (a repeated module) whose forward made ``node``, or None."""
    return (node.meta.get(CUSTOM) or {}).get(BLOCK)


def recomputable(node: fx.Node, *, saving_matmuls: bool = True) -> bool:
    """Whether a forward node may be recomputed: a deterministic aten op (not a matmul-like one where
    ``saving_matmuls``), or an element of the tuple of one; never a random op, a collective or one of zgraph's own
    operators."""
    if node.target is operator.getitem:
        source = node.args[0]
        return (
            isinstance(source, fx.Node) and _is_forward(source) and recomputable(source, saving_matmuls=saving_matmuls)
        )
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if saving_matmuls and target.overloadpacket in SAVED_OPS:
        return False
    return target.overloadpacket not in _UNDEFINED


def recompute(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    """Copy each of ``nodes`` (forward nodes, in graph order) into the backward, before its first backward reader
    or the first copy that reads it, and point the backward readers at the copies."""
    if not nodes:
        return
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    chosen = set(nodes)
    anchor: dict[fx.Node, fx.Node] = {}
    for node in reversed(nodes):  # readers come later in graph order: their anchors are known
        places = [u for u in node.users if _is_backward(u)] + [anchor[u] for u in node.users if u in chosen]
        anchor[node] = min(places, key=order.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        with gm.graph.inserting_before(anchor[node]):
            copy = gm.graph.node_copy(node, lambda arg: copies.get(arg, arg))
        copy.meta[PHASE] = BACKWARD
        copies[node] = copy
    made = set(copies.values())
    for node, copy in copies.items():
        for user in list(node.users):
            if _is_backward(user) and user not in made:
                user.replace_input_with(node, copy)


def _is_forward(node: fx.Node) -> bool:
    return node.op == "call_function" and node.meta.get(PHASE) == FORWARD


def _is_backward(node: fx.Node) -> bool:
    return node.op == "call_function" and node.meta.get(PHASE) == BACKWARD
