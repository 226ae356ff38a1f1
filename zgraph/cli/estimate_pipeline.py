"""``zgraph estimate --pipeline-parallel P`` (with ``--microbatches M``, ``--schedule``, ``--virtual-stages v``,
``--pipeline-regather``): the step cut into a pipeline (``Config.pipeline_parallel``; ``--stage`` 0 by default, 1 to
3 within each stage's data-parallel group of ``world / P`` ranks), each call taking M micro-batches of
``--micro-batch`` sequences per pipeline (``world / P`` pipelines). The table gets the predicted bubble and a row per
stage: its model state, the activations the schedule holds, what it sends, its rank's peak and idle share
(``zgraph.inspect.pipeline_estimate``).
``--budget``, ``--plan`` and ``--seq-lens`` do not combine with it yet."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from zgraph.cli.units import EstimateInputError, gib
from zgraph.inspect.estimate import Estimate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pipeline-parallel", type=int, default=None, help="Config.pipeline_parallel: ranks per pipeline"
    )
    parser.add_argument(
        "--microbatches", type=int, default=None, help="with --pipeline-parallel: micro-batches per step (default P)"
    )
    parser.add_argument(
        "--schedule", default="1f1b", help="with --pipeline-parallel: gpipe, 1f1b (default), interleaved_1f1b, zb_h1"
    )
    parser.add_argument(
        "--virtual-stages", type=int, default=1, help="with --pipeline-parallel: stages per rank (interleaved_1f1b)"
    )
    parser.add_argument(
        "--pipeline-regather",
        action="store_true",
        help="with --pipeline-parallel and --stage 3: Config.pipeline_regather, parameters gathered for each action",
    )


@dataclass(frozen=True, kw_only=True)
class PipelineFlags:
    """A pipelined estimate's flags, as ``Config`` fields."""

    parallel: int
    """``Config.pipeline_parallel``: ranks per pipeline."""
    microbatches: int
    """``Config.microbatches``."""
    schedule: str
    """``Config.schedule``."""
    virtual: int = 1
    """``Config.pipeline_virtual_stages``."""
    regather: bool = False
    """``Config.pipeline_regather``."""


def pipeline_of(args: argparse.Namespace) -> PipelineFlags | None:
    """``Setting.pipeline`` from the flags; the flags of a pipeline without ``--pipeline-parallel``, or with what it
    does not combine with yet, are refused."""
    p = args.pipeline_parallel
    if p is None:
        named = [f for f, v, d in _PIPELINE_FLAGS if getattr(args, v) != d]
        if named:
            raise EstimateInputError(f"{named[0]} is a pipeline option: add --pipeline-parallel P")
        return None
    if p < 1 or args.world % p:
        raise EstimateInputError(f"--pipeline-parallel {p} must be positive and divide --world {args.world}")
    flags = (("--budget", args.budget), ("--plan", args.plan), ("--seq-lens", getattr(args, "seq_lens", None)))
    other = [f for f, used in flags if used]
    if other:
        raise EstimateInputError(f"--pipeline-parallel does not combine with {other[0]} yet: read each stage's peak")
    return PipelineFlags(
        parallel=p,
        microbatches=args.microbatches or p,
        schedule=args.schedule,
        virtual=args.virtual_stages,
        regather=args.pipeline_regather,
    )


_PIPELINE_FLAGS = (  # flag, argument name, default
    ("--microbatches", "microbatches", None),
    ("--schedule", "schedule", "1f1b"),
    ("--virtual-stages", "virtual_stages", 1),
    ("--pipeline-regather", "pipeline_regather", False),
)


def stage_rows(e: Estimate) -> list[str]:
    """A pipelined step's rows: the bubble, then one per stage; none without a pipeline."""
    if not e.stages:
        return []
    assert e.bubble is not None
    rows = [
        f"  pipeline: predicted bubble {e.bubble:.1%} (unit costs; for GPipe and 1F1B (P - 1) / (M + P - 1)); the rows "
        "above are the rank with the largest peak's",
        f"    {'stage':>5} {'rank':>4}  {'blocks':<22}{'model state':>13}{'activations':>13}  {'in flight':>9}"
        f"{'sent/step':>13}{'rank peak':>13}{'rank idle':>10}",
    ]
    for s in e.stages:
        names = [name.partition(".")[2] or name for name in s.blocks]  # without the step argument's name
        blocks = f"{names[0]} .. {names[-1]}" if len(names) > 1 else ", ".join(names) or "none"
        rows.append(
            f"    {s.stage:>5} {s.rank:>4}  {blocks:<22}{gib(s.model_state_bytes['total']):>13}"
            f"{gib(s.activation_bytes):>13}  {s.in_flight:>9}{gib(s.send_bytes):>13}{gib(s.peak_bytes):>13}"
            f"{s.bubble:>10.1%}"
        )
    return rows


def pipeline_fields(pipeline: PipelineFlags | None) -> dict[str, object]:
    """The ``Config`` fields of ``Setting.pipeline``; none without one."""
    if pipeline is None:
        return {}
    fields = {"pipeline_parallel": pipeline.parallel, "microbatches": pipeline.microbatches}
    fields |= {"schedule": pipeline.schedule, "pipeline_virtual_stages": pipeline.virtual}
    return fields | ({"pipeline_regather": True} if pipeline.regather else {})


def describe_pipeline(pipeline: PipelineFlags | None) -> str:
    if pipeline is None:
        return ""
    stages = f" x {pipeline.virtual} stages each" if pipeline.virtual > 1 else ""
    regather = ", re-gathered per action" if pipeline.regather else ""
    m, schedule = pipeline.microbatches, pipeline.schedule
    return f", pipeline_parallel={pipeline.parallel}{stages}, {m} micro-batches, {schedule}{regather}"
