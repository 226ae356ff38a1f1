"""Exceptions zgraph raises for input it cannot handle.

Every error is raised before any collective runs, so a bad step fails on every rank the same way instead of
hanging the others.
"""

from __future__ import annotations


class ZGraphError(RuntimeError):
    """Base class of zgraph's own errors."""


class CaptureError(ZGraphError):
    """The training step could not be traced into one graph (data-dependent Python, untraceable optimizer...)."""


class PassError(ZGraphError, ValueError):
    """A pass cannot run: the pass list is malformed (unknown pass name, a contract that does not hold), or a pass
    refuses the step's graph, naming why."""


PipelineError = PassError
"""Deprecated alias of ``PassError`` (its name until pipeline parallelism took the word); removed in the next
release."""


class RankMismatchError(ZGraphError):
    """Ranks captured different graphs or planned different collectives."""


class RankFailedError(RankMismatchError):
    """Another rank failed, or did not arrive within ``Config.collective_timeout``; the message names the rank
    and its error, or the zgraph call each rank was last in."""


class ShardedParameterError(ZGraphError):
    """A stage-3 sharded parameter was used outside the compiled step and outside ``zgraph.gather``."""


class CheckpointError(ZGraphError):
    """A checkpoint cannot be saved or loaded: incomplete directory, or state that does not match the model."""


class MemoryBudgetError(ZGraphError):
    """No combination the memory planner may choose fits ``Config.memory_budget``: the message names the smallest
    budget that fits and what fills it."""
