"""``stage_cut``: the step graph cut into pipeline stages (``Config.pipeline_parallel``), each node stamped with
where it runs.

Stages are cut between the model's repeated blocks (``node.meta[CUSTOM][BLOCK]``, marked at capture): by hand, each
name of ``split`` being the first block of a new stage (``torch.distributed.pipelining``'s split points at a
module's beginning), or else balanced, consecutive blocks grouped so the costliest stage's forward flops (a
matmul's multiply-adds, other ops' output elements) are as small as they can be. What runs before the first block
(embeddings) goes to stage 0, what runs after the last (the head, the loss) to the last stage.

Every node then gets ``node.meta[STAGE]``, a ``Placement``: its stage and its part, ``"forward"`` (run per
micro-batch), ``"backward"`` (per micro-batch, in reverse stage order) or ``"update"`` (once per step: the optimizer
and what reads the gradients summed over micro-batches). None marks a *free* node, copied into every part that reads
it: a deterministic op on free inputs only (the step's arguments, optimizer hyper-parameters, buffers the step does
not update; rotary tables, masks, the optimizer's scalars).

- Forward: a block's node runs in its block's stage; another node in its first forward reader's (a weight's
  transpose runs where the weight is used), or its inputs' if that is later; an element of a tuple with the tuple.
- A parameter (and its gradient and optimizer state) belongs to the stage whose forward reads it. A weight tied
  through a value its stage makes (the head reading the embedding's transpose) reaches a later stage as that value
  does, and its gradient comes back with the others.
- Backward: a gradient marker (``zgraph::grad_contribution``) runs in its parameter's stage; what reads a marker
  belongs to the update. Another node runs in the latest stage, no later than the stage of any gradient it reads,
  where the forward values it reads are (made there, or received there from an earlier stage), so each stage
  sends the fewest gradients down: the gradient of a stage's input is summed where it is made. A node that reads
  gradients only (a view, transpose or sum of an incoming gradient) runs in its readers' stage instead, so a
  gradient crosses once, not once per view of it.
- Update: a node runs in the one stage whose state it reads. A global gradient norm (``clip_grad_norm_``) or
  overflow check (fp16 loss scaling) over several stages is cut into per-stage partials and a total the runtime
  combines over the pipeline (``stage_totals``); what reads only it is free (what the step returns: stage 0's).

Refused (``PassError``, before anything runs): fewer blocks than stages; a ``split`` name that is not one of the
step's blocks, or names out of order; a parameter the forwards of two stages read themselves (an embedding's weight
the head reads as it is); an update that reads the state of several stages (but those two) or a
per-micro-batch value; a buffer the forward updates (BatchNorm's running statistics: batch statistics cannot be
split into micro-batches exactly); a result no stage computes.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from zgraph.errors import PassError
from zgraph.graph import BACKWARD, FORWARD, INPUT, OPTIMIZER, PHASE, VAL, output_roles, placeholders, state_key
from zgraph.ops import FLAG_TO_HOST, GRAD_CONTRIBUTION
from zgraph.passes.pass_list import PassContext
from zgraph.passes.remat import block_of, blocks_in
from zgraph.passes.sizes_from_inputs import size_arithmetic
from zgraph.passes.stage_balance import balance, block_flops, node_flops
from zgraph.passes.stage_totals import returned_totals, split_across_stages

aten = torch.ops.aten

STAGE = "zgraph_stage"
"""``node.meta``: the node's ``Placement``; None for a free node (copied where it is read)."""
STAGE_PLAN = "zgraph_stage_plan"
"""``gm.meta``: the ``StagePlan``."""
PARTS = ("forward", "backward", "update")
FREE_KINDS = ("input", "hparam", "loss_scale", "stage_total", "loss_share", "batch_count")
PER_MICRO_BATCH_RESULTS = ("user", "loss_count")  # output kinds made per micro-batch (``micro_batch_loss``)
_VIEWS = {aten.view, aten._unsafe_view, aten.reshape, aten.t, aten.transpose, aten.permute, aten.expand,
          aten.unsqueeze, aten.squeeze, aten.alias}  # fmt: skip


@dataclass(frozen=True)
class Placement:
    """Where a node runs: ``stage``, and ``part`` (one of ``PARTS``)."""

    stage: int
    part: str


@dataclass(frozen=True)
class StagePlan:
    """The cut: ``blocks`` maps each block to its stage; ``flops`` is each stage's forward cost; ``owners`` maps
    ``("param", index)`` / ``("buffer", index)`` to the stage holding it."""

    stages: int
    blocks: dict[str, int]
    flops: tuple[float, ...]
    owners: dict[tuple[str, int], int]


def stage_cut(gm: fx.GraphModule, ctx: PassContext, *, stages: int = 1, split: Sequence[str] = ()) -> fx.GraphModule:
    """Stamp every node with the pipeline stage and part it runs in (``node.meta[STAGE]``).

    ``stages``: how many (``P * v``); ``split``: the first block of each stage after the first, or empty to
    balance the blocks by cost."""
    blocks = blocks_in(gm)
    block_stage = assign_blocks(gm, blocks, stages, tuple(split))
    free = free_nodes(gm)
    where: dict[fx.Node, Placement] = {}
    _place_forward(gm, block_stage, free, where)
    owners = _owners(gm, free, where)
    _place_backward(gm, free, owners, where)
    _place_update(gm, free, owners, where)
    _check_outputs(gm, where)
    _check_edges(where)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta[STAGE] = where.get(node)
    flops = [0.0] * stages
    for node, placed in where.items():
        if placed.part == "forward":
            flops[placed.stage] += node_flops(node)
    gm.meta[STAGE_PLAN] = StagePlan(stages, block_stage, tuple(flops), owners)
    return gm


def assign_blocks(gm: fx.GraphModule, blocks: list[str], stages: int, split: tuple[str, ...]) -> dict[str, int]:
    """Each block's stage: from ``split`` (the first block of stages 1, 2, ...), else balanced by forward flops."""
    if stages == 1:
        return dict.fromkeys(blocks, 0)
    if len(blocks) < stages:
        raise PassError(
            f"a pipeline of {stages} stages needs at least {stages} repeated blocks (children of an nn.ModuleList or "
            f"nn.Sequential of one class) to cut between; this step's models have {len(blocks)}"
            f"{': ' + ', '.join(blocks) if blocks else ''}. Use fewer stages (pipeline_parallel x virtual stages)"
        )
    if split:
        firsts = [0, *(_block_index(name, blocks) for name in split)]
        if len(firsts) != stages or firsts != sorted(set(firsts)):
            raise PassError(
                f"Config.pipeline_split must name {stages - 1} blocks in forward order, each starting a stage (not "
                f"the first, {blocks[0]!r}); got {list(split)}"
            )
    else:
        firsts = balance(block_flops(gm, blocks), stages)
    bounds = [*firsts, len(blocks)]
    return {blocks[i]: s for s in range(stages) for i in range(bounds[s], bounds[s + 1])}


def _block_index(name: str, blocks: list[str]) -> int:
    """The block ``name`` names: its full name, or one ending in ``.name`` (without the step argument's label)."""
    matches = [i for i, block in enumerate(blocks) if block == name or block.endswith("." + name)]
    if len(matches) != 1:
        why = "is not one of" if not matches else "names several of"
        raise PassError(f"Config.pipeline_split name {name!r} {why} the step's blocks: {', '.join(blocks)}")
    return matches[0]


def free_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Placeholders every stage has (arguments, hyper-parameters, buffers the step does not update) and the
    deterministic ops that read only those."""
    updated = {state_key(role) for role in output_roles(gm) if role.kind == "buffer"}
    free: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = node.meta[INPUT]
            if spec.kind in FREE_KINDS or (spec.kind == "buffer" and state_key(spec) not in updated):
                free.add(node)
        elif node.op == "call_function" and _copyable(node) and all(a in free for a in node.all_input_nodes):
            free.add(node)
    return free


def _copyable(node: fx.Node) -> bool:
    if node.target in (operator.getitem, FLAG_TO_HOST) or size_arithmetic(node):  # the overflow flag, sizes: pure
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


def _phase_nodes(gm: fx.GraphModule, phase: str, free: set[fx.Node]) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get(PHASE) == phase and n not in free]


def _place_forward(
    gm: fx.GraphModule, block_stage: dict[str, int], free: set[fx.Node], where: dict[fx.Node, Placement]
) -> None:
    forward = _phase_nodes(gm, FORWARD, free)
    stage: dict[fx.Node, int] = {}
    for node in forward:
        block = block_of(node)
        inputs = [stage[a] for a in node.all_input_nodes if a in stage]
        stage[node] = block_stage[block] if block is not None else max(inputs, default=0)
    for node in reversed(forward):  # readers come later: their stages are final
        readers = [stage[u] for u in node.users if u in stage]
        if block_of(node) is None and readers and node.target is not operator.getitem:
            stage[node] = max(stage[node], min(readers))
    for node in forward:  # an element of a tuple stays with it: tuples do not cross stages
        if node.target is operator.getitem and node.args[0] in stage:
            stage[node] = stage[node.args[0]]
    for node in forward:
        for a in node.all_input_nodes:
            if a in stage and stage[a] > stage[node]:
                raise PassError(
                    f"the stage cut would send a value back: {a.name} runs in stage {stage[a]} (block "
                    f"{block_of(a)!r}) and {node.name} reads it in stage {stage[node]} (block {block_of(node)!r}); "
                    "the model's blocks must run in the order they are declared"
                )
    where.update({node: Placement(s, "forward") for node, s in stage.items()})


def _owners(gm: fx.GraphModule, free: set[fx.Node], where: dict[fx.Node, Placement]) -> dict[tuple[str, int], int]:
    """The stage holding each parameter and updated buffer: the one whose forward reads it (0 if none does)."""
    owners = {}
    for node in placeholders(gm):
        spec = node.meta[INPUT]
        if spec.kind not in ("param", "buffer") or node in free:
            continue
        stages = sorted({where[u].stage for u in node.users if u in where and where[u].part == "forward"})
        if len(stages) > 1:
            raise PassError(
                f"{spec.kind} {spec.name} is read by the forwards of stages {stages} (a weight tied between them); "
                "each stage must hold its own parameters: choose split points (Config.pipeline_split) that keep "
                "its readers in one stage, or untie it"
            )
        owners[spec.kind, spec.index] = stages[0] if stages else 0
    return owners


def _owner(node: fx.Node, owners: dict[tuple[str, int], int]) -> int | None:
    """The stage of a state placeholder (a parameter's, its gradient's and optimizer state's; a buffer's)."""
    spec = node.meta[INPUT]
    if spec.kind in ("param", "grad", "opt_state"):
        return owners.get(("param", spec.index))
    return owners.get((spec.kind, spec.index))


def _place_backward(
    gm: fx.GraphModule, free: set[fx.Node], owners: dict[tuple[str, int], int], where: dict[fx.Node, Placement]
) -> None:
    nodes = _phase_nodes(gm, BACKWARD, free)
    for node in nodes:
        if node.target is GRAD_CONTRIBUTION:
            where[node] = Placement(owners.get(("param", node.args[1]), 0), "backward")
        elif any(
            a.target is GRAD_CONTRIBUTION or (a in where and where[a].part == "update") for a in node.all_input_nodes
        ):
            where[node] = Placement(_one_stage(node, free, owners, where), "update")
        else:
            where[node] = Placement(_backward_stage(node, owners, where), "backward")
    _follow_readers(nodes, owners, where)


def _follow_readers(nodes: list[fx.Node], owners: dict[tuple[str, int], int], where: dict[fx.Node, Placement]) -> None:
    """A backward node that reads gradients only (no forward value, no state) moves to the latest stage of its
    readers where that sends no more: a view or transpose of a gradient (what crosses is its input instead, and the
    input crosses once for all its views), or a node whose inputs cross to that stage anyway (a bias gradient's sum
    of a gradient that crosses). A sum of two gradients stays where they are made. Repeated until nothing moves;
    tuples and their elements stay where they are."""
    moved = True
    while moved:
        moved = False
        for node in reversed(nodes):
            stage = _readers_stage(node, owners, where)
            if stage is not None and (_is_view(node) or _inputs_cross(node, stage, where)):
                where[node] = Placement(stage, "backward")
                moved = True


def _readers_stage(node: fx.Node, owners: dict[tuple[str, int], int], where: dict[fx.Node, Placement]) -> int | None:
    """The latest stage of a gradient-only backward node's readers, where that is before its own; else None."""
    place = where.get(node)
    if place is None or place.part != "backward" or node.target in (GRAD_CONTRIBUTION, operator.getitem):
        return None
    if isinstance(node.meta.get(VAL), (tuple, list)) or _reads_forward(node, owners, where):
        return None
    readers = [where.get(u) for u in node.users]
    if not readers or any(r is None or r.part != "backward" for r in readers):
        return None
    stage = max(r.stage for r in readers)
    return stage if stage < place.stage else None


def _is_view(node: fx.Node) -> bool:
    return getattr(node.target, "overloadpacket", None) in _VIEWS and len(node.all_input_nodes) == 1


def _inputs_cross(node: fx.Node, stage: int, where: dict[fx.Node, Placement]) -> bool:
    """Whether every input of ``node`` reaches ``stage`` for another reader anyway."""
    return all(
        any(u is not node and u in where and where[u].stage <= stage for u in value.users)
        for value in node.all_input_nodes
    )


def _reads_forward(node: fx.Node, owners: dict[tuple[str, int], int], where: dict[fx.Node, Placement]) -> bool:
    """Whether ``node`` reads a forward value or a stage's state (what ties it to a stage)."""
    return any(
        (a in where and where[a].part == "forward") or (a.op == "placeholder" and _owner(a, owners) is not None)
        for a in node.all_input_nodes
    )


def _backward_stage(node: fx.Node, owners: dict[tuple[str, int], int], where: dict[fx.Node, Placement]) -> int:
    """The latest stage no later than the gradients ``node`` reads where the forward values it reads are."""
    below = [where[a].stage for a in node.all_input_nodes if a in where and where[a].part == "backward"]
    spans = []
    for a in node.all_input_nodes:
        if a in where and where[a].part == "forward":
            readers = [where[u].stage for u in a.users if u in where and where[u].part == "forward"]
            spans.append((where[a].stage, max([where[a].stage, *readers])))
        elif a.op == "placeholder" and (owner := _owner(a, owners)) is not None:
            spans.append((owner, owner))
    if not spans:
        return min(below, default=0)
    earliest = max(first for first, _ in spans)
    stage = max(earliest, min(last for _, last in spans))
    if below and min(below) < earliest:
        raise PassError(
            f"backward node {node.name} ({node.target}) reads a gradient of stage {min(below)} and a forward value "
            f"of stage {earliest}; the stage cut cannot place it. Choose other split points (Config.pipeline_split)"
        )
    return min([stage, *below])


def _place_update(
    gm: fx.GraphModule, free: set[fx.Node], owners: dict[tuple[str, int], int], where: dict[fx.Node, Placement]
) -> None:
    """Each update node in its one stage; a global gradient norm or overflow check cut into per-stage partials
    and a total (``stage_totals``): the total, and what reads only it and free values, are free."""
    for node in _phase_nodes(gm, OPTIMIZER, free):
        if node._erased or (_copyable(node) and all(a in free for a in node.all_input_nodes)):
            free.add(node)  # erased: a norm's stack or check ``split_across_stages`` replaced
            continue
        split = split_across_stages(gm, node, where)
        if split is None:
            where[node] = Placement(_one_stage(node, free, owners, where), "update")
            continue
        where.update({new: Placement(stage, "update") for new, stage in split[0].items()})
        free.update(split[1])
    where.update((copy, Placement(0, "update")) for copy in returned_totals(gm, free))


def _one_stage(
    node: fx.Node, free: set[fx.Node], owners: dict[tuple[str, int], int], where: dict[fx.Node, Placement]
) -> int:
    """The one stage whose state and gradient sums an update node reads."""
    stages, per_micro_batch = set(), []
    for a in node.all_input_nodes:
        if a in free:
            continue
        if a.op == "placeholder":
            stages.add(_owner(a, owners) or 0)
        elif a.target is GRAD_CONTRIBUTION or where[a].part == "update":
            stages.add(where[a].stage)
        else:
            per_micro_batch.append(a)
    if per_micro_batch:
        raise PassError(
            f"{node.name} ({node.target}) updates state from {per_micro_batch[0].name}, a value each micro-batch "
            "computes anew (not a gradient); pipeline parallelism runs the update once, on the gradients summed over "
            "the micro-batches"
        )
    if len(stages) > 1:
        raise PassError(
            f"{node.name} ({node.target}) reads the state of stages {sorted(stages)}; each stage updates its own "
            "parameters, and a value across stages other than a global gradient norm (clip_grad_norm_) or the fp16 "
            "overflow check is not supported"
        )
    return stages.pop() if stages else 0


def _check_outputs(gm: fx.GraphModule, where: dict[fx.Node, Placement]) -> None:
    """State is written once per step (by the update); a buffer the forward updates cannot be. Each result comes
    from a stage."""
    for value, role in zip(gm.graph.output_node().args[0], output_roles(gm)):
        placed = where.get(value) if isinstance(value, fx.Node) else None
        if role.kind in PER_MICRO_BATCH_RESULTS and placed is None:
            raise PassError(
                f"the step returns {getattr(value, 'name', value)!r}, which no pipeline stage computes (an argument, "
                "or a value made from arguments only): return values the model computes"
            )
        if role.kind == "grad" and placed is not None and placed.part != "update":
            raise PassError(
                f"the step leaves the gradient of {role.name} in .grad after it returns (no opt.zero_grad() after "
                "opt.step(), or gradients kept for a later call): with pipeline parallelism the gradients summed "
                "over the micro-batches are consumed by the update within the step; call opt.zero_grad() after "
                "opt.step() in the step"
            )
        if role.kind not in PER_MICRO_BATCH_RESULTS and placed is not None and placed.part != "update":
            raise PassError(
                f"the {placed.part} writes {role.kind} {role.name} ({value.name}): with micro-batches it would be "
                "written once per micro-batch (BatchNorm's running statistics in training mode compute statistics "
                "over the batch, which micro-batches cannot reproduce); put such modules in eval mode"
            )


def _check_edges(where: dict[fx.Node, Placement]) -> None:
    """Forward values move to later stages, gradients to earlier ones; the update reads its own stage's."""
    for node, placed in where.items():
        for a in node.all_input_nodes:
            if a not in where:
                continue
            source = where[a]
            later = placed.stage > source.stage
            backwards = source.part == "backward" and placed.part == "backward"
            if (backwards and later) or (not backwards and placed.stage < source.stage):
                raise PassError(
                    f"the stage cut would move {a.name} ({source.part}, stage {source.stage}) to {node.name} "
                    f"({placed.part}, stage {placed.stage}) against the pipeline's flow; choose other split points"
                )
