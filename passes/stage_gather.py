"""``stage_gather`` (pipeline parallelism at ZeRO stage 3): the graph that gathers a stage's parameters once per step.

Between steps each rank holds only its shard of its stages' parameters (cut within the stage's data-parallel
group). A stage's per-micro-batch graphs (``stage_graphs``: forward, backward, input_grad, weight_grad) read each
parameter whole; the graph made here reads the shards of every sharded parameter they read (``GraphInput`` kind
``param``, layout ``shard``) and returns them whole (``GraphOutput`` kind ``param``, layout ``full``: not written
back, handed to those graphs), one ``zgraph::unshard`` each, which ``bucket`` and ``lower_collectives`` then merge
and lower as for any step. The runtime (``zgraph.runtime.pipeline_run``) runs it once per step before the stage's
first action and keeps its results across the micro-batches, until the stage's update (which reads and writes the
shards: ``shard_params`` on the update graph). Gathering again per micro-batch under a memory plan is not done.
"""

from __future__ import annotations

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from zgraph.graph import FORWARD, INPUT, OUTPUTS, VAL, GraphOutput, fake_mode, insert, set_input_layout
from zgraph.ops import UNSHARD
from zgraph.passes.graph_utils import shard_val
from zgraph.passes.pass_list import PassContext


def stage_gather(graphs: list[fx.GraphModule], ctx: PassContext, *, stage: int = 0) -> fx.GraphModule | None:
    """The gather graph of the sharded parameters ``graphs`` (a stage's per-micro-batch graphs) read whole, over the
    context's shard group (``ctx``: the stage's data-parallel group, as the update's); None below ZeRO ``stage`` 3
    or where they read none."""
    read = _sharded_params(graphs, ctx) if stage >= 3 and ctx.distributed else {}
    if not read:
        return None
    graph = fx.Graph()
    inputs = []
    for index in sorted(read):
        node = graph.placeholder(read[index].name)
        node.meta = {VAL: read[index].meta[VAL], INPUT: read[index].meta[INPUT]}
        inputs.append(node)
    out = graph.output(tuple(inputs))
    out.meta[OUTPUTS] = [GraphOutput("param", n.meta[INPUT].name, n.meta[INPUT].index) for n in inputs]
    gm = _LazyGraphModule({}, graph)
    mode, world, group = fake_mode(graphs[0]), ctx.shard.size, ctx.shard.name
    wholes = []
    for node in inputs:
        set_input_layout(node, "shard", shard_val(node.meta[VAL], world))
        rows = ctx.params[node.meta[INPUT].index].shape[0]
        wholes.append(insert(gm, UNSHARD, (node, rows, world, group), before=out, phase=FORWARD, mode=mode))
    out.args = (tuple(wholes),)
    return gm


def _sharded_params(graphs: list[fx.GraphModule], ctx: PassContext) -> dict[int, fx.Node]:
    """The placeholders of ``graphs`` that read a parameter stage 3 shards (not persistent), one per parameter."""
    read: dict[int, fx.Node] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            spec = node.meta.get(INPUT) if node.op == "placeholder" else None
            if spec is None or spec.kind != "param" or spec.layout != "full" or spec.index in read:
                continue
            info = ctx.params[spec.index]
            if info.shard is not None and not info.persistent:
                read[spec.index] = node
    return read
