"""A pipelined step's call (``Config.pipeline_parallel``) cut into micro-batches: each tensor argument along dim 0.

The step is captured on the first micro-batch's call and run on every one's (``zgraph.compile.pipeline``)."""

from __future__ import annotations

from torch import Tensor, nn

from zgraph.binding.arguments import StepCall
from zgraph.config import Config
from zgraph.tree import iter_leaves, map_leaves


def microbatches(config: Config) -> int:
    """``Config.microbatches``, or ``P`` when it is None."""
    assert config.pipeline_parallel is not None
    return config.microbatches or config.pipeline_parallel


def split_call(call: StepCall, count: int) -> list[StepCall]:
    """``call`` cut into ``count`` calls along dim 0 of each tensor argument (0-d ones and parameters whole); a
    ``ValueError`` naming an argument ``count`` does not divide."""
    for path, leaf in (x for name, value in call.arguments for x in iter_leaves(value, name)):
        if isinstance(leaf, Tensor) and not isinstance(leaf, nn.Parameter) and leaf.dim():
            if leaf.shape[0] % count:
                raise ValueError(
                    f"Config.microbatches={count} does not divide the batch of argument `{path}` (dim 0: "
                    f"{leaf.shape[0]}): every tensor argument is cut into micro-batches along dim 0"
                )

    def piece(i: int) -> StepCall:
        def cut(_path: str, leaf: object) -> object:
            if isinstance(leaf, Tensor) and not isinstance(leaf, nn.Parameter) and leaf.dim():
                return leaf.chunk(count)[i]
            return leaf

        return StepCall.of(call.fn, map_leaves(call.args, cut), map_leaves(call.kwargs, cut))

    return [piece(i) for i in range(count)]
