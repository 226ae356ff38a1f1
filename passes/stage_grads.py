"""``stage_grads`` (pipeline parallelism at ZeRO stage >= 1): a stage's update graph reduces its gradients itself.

The update graph ``stage_graphs`` makes reads each parameter's gradient already reduced over every pipeline
(``GraphInput`` kind ``grad_mean``). Here each such input is read through a gradient marker
(``zgraph::grad_contribution``), as autograd's gradients are in a step without pipelines: the input becomes this
pipeline's share of the gradient, and the passes of ZeRO then run on the update graph unchanged, over the stage's
data-parallel group (the ``PassContext``'s group): ``shard_optimizer`` (each rank updates its shard of the
optimizer state, the new parameters are all-gathered), ``reduce_scatter_grads`` (each gradient averaged over the
pipelines, by a reduce-scatter where only the shard is read), ``bucket`` and ``lower_collectives``. The update runs
once per step, so each bucket is reduced once per step, whatever the micro-batch count; the runtime feeds each
``grad_mean`` input this pipeline's gradient sum divided so that its average over the pipelines is the whole
batch's gradient (``zgraph.runtime.pipeline_run``).
"""

from __future__ import annotations

import torch.fx as fx

from zgraph.graph import BACKWARD, INPUT, fake_mode, insert, placeholders
from zgraph.ops import GRAD_CONTRIBUTION
from zgraph.passes.pass_list import PassContext


def stage_grads(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Each ``grad_mean`` input of a stage's update graph read through a gradient marker of its parameter, the
    markers in input order after every input (as autograd's in a step's graph: a bucket of the collectives that
    replace them, placed before the first use of any, then reads inputs made before it)."""
    mode = fake_mode(gm)
    inputs = placeholders(gm)
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for node in inputs:
        spec = node.meta[INPUT]
        if spec.kind != "grad_mean":
            continue
        users = list(node.users)
        marker = insert(gm, GRAD_CONTRIBUTION, (node, spec.index), before=first, phase=BACKWARD, mode=mode)
        for user in users:
            user.replace_input_with(node, marker)
    return gm
