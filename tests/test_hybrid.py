"""Hybrid sharding (``Config.shard_group_size``) and hpZ (``Config.secondary_shard_group_size``) on 4 spawned gloo
ranks against eager PyTorch on the global batch, with the bound ``test_zero_parity`` measures for each case: as
2 shard groups of 2 (2x2) and as 4 groups of 1 (4x1), stages 1-3; hpZ with secondary groups of 2 at stage 3.
Also: what each collective spans and moves, clipping, 16-bit states, ``cross_group_dtype``'s error, split mode,
checkpoints saved at one layout and loaded at another, and the config checks."""

from __future__ import annotations

import os

import checkpoint_cases as cc
import pytest
import split_cases
import torch
from dist_harness import run_ranks
from test_zero_parity import assert_rel, expected

import zgraph

WORLD = 4
CASE_NAMES = ["adamw", "accumulation_loop", "tied_weights", "awkward_shapes"]
LAYOUTS = {"2x2": {"shard_group_size": 2}, "4x1": {"shard_group_size": 1}, "hpz": {"secondary_shard_group_size": 2}}
BF16 = {"param_dtype": torch.bfloat16, "master_dtype": torch.bfloat16, "optimizer_state_dtype": torch.bfloat16}


def _runs(offload_dir: str) -> list[tuple[str, int, str, dict]]:
    runs = []
    offload = {"offload_optimizer": "nvme", "offload_params": "nvme", "offload_dir": offload_dir}
    runs += [("2x2/3/offload", 3, "adamw", {**LAYOUTS["2x2"], **offload})]
    runs += [("hpz/3/offload", 3, "adamw", {**LAYOUTS["hpz"], **offload})]
    for layout, fields in LAYOUTS.items():
        for stage in [3] if layout == "hpz" else [1, 2, 3]:
            runs += [(f"{layout}/{stage}/{name}", stage, name, fields) for name in CASE_NAMES]
    runs += [(f"2x2/{stage}/clip", stage, "clip_grad_norm", LAYOUTS["2x2"]) for stage in (2, 3)]
    runs += [("hpz/3/clip", 3, "clip_grad_norm", LAYOUTS["hpz"])]
    runs += [("flat/3/bf16", 3, "adamw", BF16), ("2x2/3/bf16", 3, "adamw", {**LAYOUTS["2x2"], **BF16})]
    runs += [("hpz/3/bf16", 3, "adamw", {**LAYOUTS["hpz"], **BF16}), ("flat/3/adamw", 3, "adamw", {})]
    cross = {"cross_group_dtype": torch.bfloat16}
    runs += [
        ("2x2/3/cross", 3, "adamw", {**LAYOUTS["2x2"], **cross}),
        ("hpz/3/cross", 3, "adamw", {**LAYOUTS["hpz"], **cross}),
    ]
    return runs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid") / "results.pt"
    offload_dir = tmp_path_factory.mktemp("hybrid_nvme")
    run_ranks(WORLD, "hybrid_cases.run_layouts", str(path), _runs(str(offload_dir)), timeout=900)
    return torch.load(path, weights_only=False)


def _ok(results: dict, label: str) -> dict:
    result = results[label]
    assert "error" not in result, result.get("error")
    return result


def _assert_matches_eager(result: dict, name: str, what: str) -> None:
    from hybrid_cases import ALL_CASES
    from zero_cases import reference

    if name in ("clip_grad_norm",):
        want, bound = reference(ALL_CASES[name], WORLD), expected("adamw", WORLD)[1]
    else:
        want, bound = expected(name, WORLD)
    for i, (got, exp) in enumerate(zip(result["losses"], want["losses"], strict=True)):
        assert abs(got - exp) <= bound * max(abs(exp), 1e-12), f"{what}: loss of call {i}: {got} vs {exp}"
    for got_model, want_model in zip(result["models"], want["models"], strict=True):
        for key in want_model:
            assert_rel(got_model[key], want_model[key], f"{what}: state_dict[{key!r}]", bound)
    for got_opt, want_opt in zip(result["optimizers"], want["optimizers"], strict=True):
        for index, state in want_opt["state"].items():
            for key, value in state.items():
                assert_rel(got_opt["state"][index][key], value, f"{what}: optimizer state[{index}][{key!r}]", bound)


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("layout_stage", ["2x2/1", "2x2/2", "2x2/3", "4x1/1", "4x1/2", "4x1/3", "hpz/3"])
def test_layout_matches_eager_on_global_batch(results, layout_stage, name):
    _assert_matches_eager(_ok(results, f"{layout_stage}/{name}"), name, f"{layout_stage}/{name}")


@pytest.mark.parametrize("label", ["2x2/3/offload", "hpz/3/offload"])
def test_offload_to_nvme_under_hybrid_layouts(results, label):
    """Optimizer states and parameter shards in files between uses (hpZ: the backward reads no shard back)."""
    _assert_matches_eager(_ok(results, label), "adamw", label)


@pytest.mark.parametrize("label", ["2x2/2/clip", "2x2/3/clip", "hpz/3/clip"])
def test_clipping_sees_each_shard_once(results, label):
    """The global norm sums every shard once: each shard group holds the same shards (counted over one)."""
    _assert_matches_eager(_ok(results, label), "clip_grad_norm", label)


def test_collectives_of_hsdp_stay_in_their_groups(results):
    """2x2 at stage 3: gathers and reduce-scatters span a shard group ({0,1}), the one collective across groups
    is the all-reduce of gradient shards ({0,2}): half the gradient bytes; flat ZeRO-3 gathers over all 4."""
    found = _ok(results, "2x2/3/adamw")["collectives"]
    by_kind: dict = {}
    for kind, ranks, _ in found:
        by_kind.setdefault(kind, set()).add(ranks)
    assert by_kind["all_gather_into_tensor"] == {(0, 1)}
    assert by_kind["reduce_scatter_tensor"] == {(0, 1)}
    assert by_kind["all_reduce"] == {(0, 2)}
    scattered = sum(b for k, _, b in found if k == "reduce_scatter_tensor")
    across = sum(b for k, _, b in found if k == "all_reduce")
    assert across * 2 == scattered  # a shard of each gradient crosses, not the gradient
    flat = _ok(results, "flat/3/adamw")["collectives"]
    assert {r for k, r, _ in flat if k == "all_gather_into_tensor"} == {(0, 1, 2, 3)}


def test_hpz_backward_gathers_within_the_secondary_group(results):
    found = _ok(results, "hpz/3/adamw")["collectives"]
    gathers = [(ranks, nbytes) for kind, ranks, nbytes in found if kind == "all_gather_into_tensor"]
    assert {r for r, _ in gathers} == {(0, 1, 2, 3), (0, 1)}  # the forward over all, the backward in the group
    flat_param_bytes = sum(
        b for k, r, b in _ok(results, "flat/3/adamw")["collectives"] if k == "all_gather_into_tensor"
    )
    across = sum(b for r, b in gathers if r == (0, 1, 2, 3))
    assert across < flat_param_bytes  # the backward's re-gather left the cross-group links


@pytest.mark.parametrize("layout", ["2x2", "hpz"])
def test_bf16_states_match_flat_zero3(results, layout):
    """bf16 master weights and optimizer states: the same numbers as flat ZeRO-3 with them, up to the order of
    the fp32 gradient reductions (then rounded to bf16: within a bf16 ulp or two)."""
    flat, hybrid = _ok(results, "flat/3/bf16"), _ok(results, f"{layout}/3/bf16")
    for key, value in flat["models"][0].items():
        assert hybrid["models"][0][key].dtype == value.dtype == torch.bfloat16
        assert_rel(hybrid["models"][0][key].float(), value.float(), key, 2e-2)
    for i, (a, b) in enumerate(zip(hybrid["losses"], flat["losses"])):
        assert abs(a - b) <= 1e-2 * abs(b), f"loss {i}: {a} vs {b}"


@pytest.mark.parametrize("layout", ["2x2", "hpz"])
def test_cross_group_dtype_error_against_fp32(results, layout):
    """bf16 across groups rounds what crosses: the parameters move away from the fp32 run, by about bf16's
    precision relative to an update, never more than a few percent of their scale after 10 steps."""
    fp32, narrow = _ok(results, f"{layout}/3/adamw"), _ok(results, f"{layout}/3/cross")
    errors = []
    for key, value in fp32["models"][0].items():
        diff = (narrow["models"][0][key] - value).abs().max() / value.abs().max()
        errors.append(float(diff))
    assert 0 < max(errors) < 2e-2, errors
    crossing = [
        b for k, r, b in narrow["collectives"] if r != (0, 1) and k != "all_gather_into_tensor" or r == (0, 1, 2, 3)
    ]
    wide = [b for k, r, b in fp32["collectives"] if r != (0, 1) and k != "all_gather_into_tensor" or r == (0, 1, 2, 3)]
    assert sum(crossing) * 2 == sum(wide)  # half the bytes cross


SPLIT_NAMES = ["gradient", "accumulate", "seeds"]


@pytest.fixture(scope="module")
def split_results(tmp_path_factory):
    """The split cases at stage 3 under both layouts: one job on the ranks."""
    out = tmp_path_factory.mktemp("hybrid_split")
    layouts = {layout: LAYOUTS[layout] for layout in ("2x2", "hpz")}
    run_ranks(WORLD, "hybrid_cases.run_split", str(out), [3], SPLIT_NAMES, layouts, timeout=600)
    return {layout: torch.load(out / f"{layout}.pt", weights_only=False) for layout in layouts}


@pytest.mark.parametrize("layout", ["2x2", "hpz"])
def test_split_backward_under_hybrid_layouts(split_results, layout):
    got = split_results[layout]
    for name in SPLIT_NAMES:
        want = split_cases.reference(name, WORLD)
        for key, value in want.items():
            if value is None:
                assert got[(3, name)][key] is None, key
                continue
            err = ((got[(3, name)][key] - value).abs().max() / value.abs().max().clamp_min(1e-12)).item()
            assert err <= 1e-5, f"{layout} {name}: {key} ({err:.2e})"


# ------------------------------------------------------------------------------------------ checkpoints
PAIRS = [("hsdp", "flat"), ("flat", "hsdp"), ("hsdp", "hsdp_s1"), ("hpz", "hsdp")]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    state = cc.make_state()  # one process, no group: a checkpoint the 4 ranks load at HSDP
    cc.train(state, cc.zgraph_step(3), cc.batches()[: cc.BEFORE])
    zgraph.save(os.fspath(out / "one"), state[0], state[1], scheduler=state[2])
    run_ranks(WORLD, "hybrid_cases.reshard_worker", str(out), PAIRS, os.fspath(out / "one"), timeout=600)
    return out, torch.load(out / "reshard.pt", weights_only=False)


def _assert_losses(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what}, step {i}: {a} vs {b}"


@pytest.mark.parametrize("pair", [*PAIRS, ("one", "hsdp")])
def test_checkpoint_reshards_between_layouts(resharded, pair):
    """Saved at one layout on 4 ranks, loaded into a fresh model, resumed at another: the losses of the eager
    run from there on."""
    reference = cc.eager_run()["losses"][cc.BEFORE :]
    _assert_losses(resharded[1][pair], reference, f"saved at {pair[0]}, resumed at {pair[1]}")


def test_hsdp_checkpoint_resumes_on_one_process(resharded):
    state = cc.make_state()
    zgraph.load(os.fspath(resharded[0] / "saved-hsdp"), state[0], state[1], scheduler=state[2])
    losses = cc.train(state, cc.zgraph_step(3), cc.batches()[cc.BEFORE :])
    _assert_losses(losses, cc.eager_run()["losses"][cc.BEFORE :], "HSDP checkpoint resumed on one process")


# ------------------------------------------------------------------------------------------ config checks
def test_bad_group_sizes_are_refused_when_the_config_is_built(monkeypatch):
    with pytest.raises(ValueError, match="secondary_shard_group_size=2 .*zero_hpz_partition_size.* needs stage=3"):
        zgraph.Config(stage=2, secondary_shard_group_size=2)
    with pytest.raises(ValueError, match="cannot be combined"):
        zgraph.Config(stage=3, shard_group_size=2, secondary_shard_group_size=2)
    with pytest.raises(ValueError, match="Config.shard_group_size must be None or a positive int"):
        zgraph.Config(shard_group_size=0)
    with pytest.raises(ValueError, match="cross_group_dtype needs groups"):
        zgraph.Config(cross_group_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cross_group_dtype must be"):
        zgraph.Config(shard_group_size=2, cross_group_dtype=torch.float32)
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="Config.shard_group_size=4 does not divide the world size 6"):
        zgraph.Config(shard_group_size=4)
    with pytest.raises(ValueError, match="zero_hpz_partition_size.* does not divide the world size 6"):
        zgraph.Config.from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}})


def test_from_deepspeed_maps_zero_hpz_partition_size():
    config = zgraph.Config.from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})
    assert config.secondary_shard_group_size == 8
    assert (
        zgraph.Config.from_deepspeed({"zero_optimization": {"zero_hpz_partition_size": 1}}).secondary_shard_group_size
        is None
    )
    with pytest.raises(ValueError, match="needs stage=3"):
        zgraph.Config.from_deepspeed({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}})
    with pytest.raises(ValueError, match="zero_hpz_partition_size"):
        zgraph.Config.from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}})


def test_group_size_checked_again_on_the_step_group():
    from zgraph.runtime.hybrid import hybrid_group
    from zgraph.runtime.process_group import ProcessGroupInfo

    group = ProcessGroupInfo(rank=0, world_size=6, group_name="g", backend="gloo")
    with pytest.raises(ValueError, match="Config.shard_group_size=4 does not divide the world size 6"):
        hybrid_group(group, shard_group_size=4, secondary_group_size=None, timeout=5)
