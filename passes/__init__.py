"""zgraph's graph passes (installed as ``zgraph.passes``): each one file, ``fn(gm, ctx) -> gm``.

``default_pipeline()`` is the ordered list ``@zgraph.distribute`` runs; see each pass's module docstring for
what it does and what later passes may rely on.
"""

from __future__ import annotations

from zgraph.passes.bucket import bucket
from zgraph.passes.cast import cast
from zgraph.passes.clip_grad import clip_grad
from zgraph.passes.cse import eliminate_common_subexpressions
from zgraph.passes.loss_scale import loss_scale
from zgraph.passes.lower_collectives import lower_collectives
from zgraph.passes.pipeline import (
    CAPTURED_PROPERTIES,
    ParamInfo,
    Pass,
    PassContext,
    PassRecord,
    ShardSpec,
    build_pipeline,
    check_contracts,
    copy_graph_module,
    run_pipeline,
)
from zgraph.passes.reduce_scatter_grads import reduce_scatter_grads
from zgraph.passes.schedule import schedule
from zgraph.passes.shard_optimizer import shard_optimizer
from zgraph.passes.shard_params import shard_params


def default_pipeline() -> list[Pass]:
    """The passes of a distributed step, in order."""
    return [
        Pass("cse", eliminate_common_subexpressions),
        Pass("shard_optimizer", shard_optimizer, requires={"phases"}, provides={"optimizer_sharded"}),
        Pass(
            "reduce_scatter_grads",
            reduce_scatter_grads,
            requires={"phases", "grad_markers"},
            provides={"grads_reduced"},
        ),
        Pass("shard_params", shard_params, requires={"phases"}, provides={"params_sharded"}),
        Pass("cast", cast, requires={"grads_reduced"}, provides={"casts_placed"}),
        Pass("clip_grad", clip_grad, requires={"grads_reduced"}, provides={"grad_norms_sharded"}),
        Pass("loss_scale", loss_scale, requires={"grads_reduced"}, provides={"overflow_global"}),
        Pass("bucket", bucket, requires={"grads_reduced"}, provides={"bucketed"}),
        Pass("lower_collectives", lower_collectives, requires={"grads_reduced"}, provides={"collectives_lowered"}),
        Pass("schedule", schedule, requires={"collectives_lowered"}, provides={"scheduled"}),
    ]


__all__ = [
    "CAPTURED_PROPERTIES",
    "ParamInfo",
    "Pass",
    "PassContext",
    "PassRecord",
    "ShardSpec",
    "build_pipeline",
    "check_contracts",
    "copy_graph_module",
    "default_pipeline",
    "run_pipeline",
]
