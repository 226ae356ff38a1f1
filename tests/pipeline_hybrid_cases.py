"""Hybrid sharding within pipeline stages (issue 42, item 2): two pipeline stages by four data-parallel ranks (P=2 x
D=4, eight gloo ranks), ``Config.shard_group_size=2`` at ZeRO 2 and 3 against eager PyTorch on the global batch,
the same with sequence parallelism (P=2 x SP=2 x D=2), and what is refused (hpZ, a group size not dividing D): the
worker of ``test_pipeline_hybrid.py``."""

from __future__ import annotations

from dist_harness import all_gather_values, run_named
from pipeline_data_cases import P, _by_sequence, train

import zgraph

N = 2  # ranks per shard group, of the D = 4 of each stage's data-parallel group


def hybrid(rank: int, world: int) -> list[dict]:
    """``shard_group_size=2`` at ZeRO 2 and 3, 3 steps with 2 micro-batches each; with each run the collectives
    its update and gather graphs hold (reduce-scatters, all-reduces, all-gathers)."""
    runs = []
    for stage in (2, 3):
        run = train(rank, world, 2, steps=3, stage=stage, shard_group_size=N)
        run.pop("want"), run.pop("got")  # losses: compared through the parameters (and kept small to gather)
        runs.append(run)
    return all_gather_values(runs)


def hybrid_by_sequence(rank: int, world: int) -> list[dict]:
    """P=2 x SP=2 x D=2 at ZeRO 3, ``shard_group_size=2`` of each stage's D x SP = 4 ranks: sequence_cases' GPT,
    3 SGD steps (``pipeline_data_cases.pipeline_by_sequence``'s run)."""
    return all_gather_values(_by_sequence(3, "gpt", N))


def refused(rank: int, world: int) -> list[str]:
    """The ``ValueError`` messages of a shard group size that divides the world (8) but not D (4), and of hpZ."""
    messages = []
    for options in ({"shard_group_size": 8}, {"stage": 3, "secondary_shard_group_size": 2}):
        try:
            zgraph.Config(pipeline_parallel=P, **options)
            messages.append("not refused")
        except ValueError as error:
            messages.append(str(error))
    return all_gather_values(messages)


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    run_named(rank, world, out_path, names, globals())
