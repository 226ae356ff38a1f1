"""zgraph's graph passes (installed as ``zgraph.passes``): each one file, ``fn(gm, ctx) -> gm``.

``default_pipeline()`` is the ordered list ``@zgraph.distribute`` runs; see each pass's module docstring for
what it does and what later passes may rely on.
"""

from __future__ import annotations

from zgraph.passes.cse import eliminate_common_subexpressions
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


def default_pipeline() -> list[Pass]:
    """The passes of a distributed step, in order."""
    return [
        Pass("cse", eliminate_common_subexpressions),
        Pass(
            "reduce_scatter_grads",
            reduce_scatter_grads,
            requires={"phases", "grad_markers"},
            provides={"grads_reduced"},
        ),
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
