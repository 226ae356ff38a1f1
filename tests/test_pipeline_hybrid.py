"""Hybrid sharding within pipeline stages (issue 42, item 2): P=2 x D=4 on eight gloo ranks,
``Config.shard_group_size=2`` (shard groups of 2 of each stage's 4 data-parallel ranks, replicated across 2) at ZeRO 2
and 3 against eager PyTorch on the global batch; each stage's state held as 1 / (P x N); one reduce-scatter within
the shard group and one all-reduce across the groups per bucket per stage per step; with sequence parallelism
(P=2 x SP=2 x D=2, N=2 of each stage's 4 ranks) the same; what is refused."""

from __future__ import annotations

import pytest
import torch
from pipeline_cases import Net

pytestmark = pytest.mark.eight_ranks  # outside the default suite (its groups have 2 and 4 ranks): .ci/run runs it
PARAMS = [name for name, _ in Net().named_parameters()]
P, N = 2, 2


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory):
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("pipeline_hybrid") / "results.pt"
    run_ranks(8, "pipeline_hybrid_cases.run", str(path), ["hybrid", "hybrid_by_sequence", "refused"], timeout=300)
    results = torch.load(path, weights_only=False)
    for result in results.values():
        assert not (isinstance(result, dict) and "error" in result), result.get("error")
    return results


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_sharding_within_each_stage_equals_eager_and_holds_a_quarter_of_the_state(eight_ranks, stage):
    """Every parameter after 3 steps, and the whole model (``zgraph.full_state_dict``), as eager's on the global
    batch; each rank holds 1 / (P x N) = a quarter of the optimizer state (stage 3: and of the parameters), not the
    eighth ZeRO over the whole data-parallel group would; stage 3: the whole optimizer state, ``zgraph.gather``
    and ``zgraph.save`` / ``load`` as eager's."""
    runs = [rank[[2, 3].index(stage)] for rank in eight_ranks["hybrid"]]
    for r in runs:
        assert r["distance"] < 1e-6 and r["whole"] < 1e-6, r
        assert r["eager_optimizer"] / 4 * 0.9 < r["optimizer"] < r["eager_optimizer"] / 4 * 1.1, r
        if stage == 3:
            assert r["eager_params"] / 4 * 0.9 < r["params"] < r["eager_params"] / 4 * 1.1, r
            assert r["whole_optim"] < 1e-6 and r["gathered"] < 1e-6 and r["loaded"] < 1e-6, r
    assert sorted(n for r in runs[:2] for n in r["owned"]) == sorted(PARAMS)
    assert all(runs[rank]["owned"] == runs[rank % P]["owned"] for rank in range(8)), "a stage per place"


@pytest.mark.parametrize("stage", [2, 3])
def test_each_stage_bucket_is_reduce_scattered_in_its_shard_group_and_all_reduced_across_groups(eight_ranks, stage):
    """Per step and stage: one reduce-scatter (on gloo an ``all_to_all_single``) within the shard group and one
    all-reduce of its shard across the groups (the stage's one bucket), the parameters all-gathered once (stage 2:
    by the update, 3: by the gather graph); ``explain()`` names the shard group and the data-parallel group."""
    for rank, r in enumerate(eight_ranks["hybrid"]):
        r = r[[2, 3].index(stage)]
        assert r["comm"] == {"all_to_all_single": 1, "all_reduce_": 1, "all_gather_into_tensor_coalesced": 1}, r
        count = [1] if "head.weight" in r["owned"] else []  # the token count: the last stage's ranks
        assert r["reduce_scatters"] == [1] and sorted(r["sizes"]) == [1, *count], r  # + the loss's
        place, pipeline = rank % P, rank // P
        shard = [place + P * (pipeline // N * N + k) for k in range(N)]
        data = [place + P * k for k in range(4)]
        hybrid = next(line for line in r["sharding"] if line.startswith("ZeRO"))
        assert f"over the {N} ranks of its shard group (here global ranks {shard})" in hybrid, hybrid
        assert f"replicated across the 2 shard groups of its data-parallel group (global ranks {data})" in hybrid


def test_a_group_size_not_dividing_the_data_parallel_group_and_hpz_are_refused(eight_ranks):
    """``shard_group_size=8`` divides the world (8) but not D (4): refused naming both; hpZ with pipelines: refused
    saying why (a stage's parameters are gathered from the primary shards: no secondary copy to serve)."""
    for too_big, hpz in eight_ranks["refused"]:
        assert "shard_group_size=8 must divide the 4 ranks of each stage's data-parallel group (world size 8 /" in (
            too_big
        ), too_big
        assert "does not combine with secondary_shard_group_size=2" in hpz and "no secondary copy to serve" in hpz, hpz


def test_hybrid_sharding_with_sequence_parallelism_shards_over_each_pipelines_slices(eight_ranks):
    """P=2 x SP=2 x D=2, ``shard_group_size=2`` at ZeRO 3: a stage's parameters sharded over the 2 sequence ranks of
    its place in one pipeline (its shard group) and replicated across the 2 pipelines: a quarter (1 / (P x N)) per
    rank; as eager on the whole batch after 3 steps; per step one all-gather, one reduce-scatter within the shard
    group, one all-reduce across."""
    for rank, r in enumerate(eight_ranks["hybrid_by_sequence"]):
        torch.testing.assert_close(torch.tensor(r["got"]), torch.tensor(r["want"]), rtol=1e-6, atol=1e-6)
        assert r["distance"] < 1e-6, r["distance"]
        assert r["eager_params"] / 4 * 0.9 < r["params"] < r["eager_params"] / 4 * 1.1, r
        assert r["comm"] == {"all_gather_into_tensor_coalesced": 1, "all_to_all_single": 1, "all_reduce_": 1}, r
        shard = [rank - rank % 2, rank - rank % 2 + 1]  # ranks R[(d * P + p) * SP + s]: this pipeline's slices
        assert f"over the 2 ranks of its shard group (here global ranks {shard})" in r["sharding"], r["sharding"]
