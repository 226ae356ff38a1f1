"""zgraph on a GPU: ZeRO stages 0-3 against DDP, split backward, fp16 loss scaling, the host-memory offload tier
and the memory estimate, on every transport this machine offers (``gpu_cases``: 2 ranks sharing the GPU over
gloo; 1 rank on NCCL, started by zgraph; one rank per GPU on NCCL where there are several).

Skipped without CUDA. ``python -m pytest tests/gpu`` runs them (a few minutes on one H100); ``python -m
benchmarks.gpu`` runs them first, then the benchmarks.

**Bounds against DDP.** DDP differs from one process on the global batch only in the order of the float
reductions, and so may zgraph: each tensor's bound (and the losses') is ``FACTOR`` times the larger of DDP's own
distance to the one-process eager run and the distance reduction order alone makes (the same eager run with the
batch's rows rotated), never below ``FLOOR`` (max |a - b| <= bound * max |b|, per tensor: an attention key bias has
a gradient that is zero but for round-off, which Adam's normalised update amplifies, so its noise dwarfs every
other tensor's). DDP itself must be within ``DDP_LOSS_LIMIT`` of eager, or the bounds it sets mean nothing.

**Estimate.** ``step.estimate``'s peak against the real call's ``torch.cuda.max_memory_allocated``, less what the
device held at the call's start beyond the training state and the batch (cuBLAS workspaces: the estimate counts
the step's tensors): within ``ESTIMATE_TOLERANCE`` (10 %). The raw ratio is reported beside it.
"""

from __future__ import annotations

import json
import os

import gpu_cases
import gpu_memory_cases
import pytest
import torch

import zgraph
from zgraph.runtime.devices import served_backend

pytestmark = pytest.mark.skipif(gpu_cases.device_type() is None, reason=gpu_cases.SKIP_REASON)

TRANSPORTS = ("gloo-2", "nccl-1", "nccl-all")
FACTOR = 10
FLOOR = {"fp32": 1e-6, "bf16": 2**-8}
DDP_LOSS_LIMIT = {"fp32": 1e-4, "bf16": 2**-5}
ESTIMATE_TOLERANCE = 0.10
REPORT_ENV = "ZGRAPH_GPU_REPORT"


def report(test: str, **numbers: object) -> None:
    """Print what a test measured; with ``ZGRAPH_GPU_REPORT=<file>`` also append it there as a JSON line (what
    ``python -m benchmarks.gpu`` collects)."""
    print(f"{test}: {json.dumps(numbers, default=str)}")
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **numbers}, default=str) + "\n")


def check(results, transport: str, name: str) -> dict:
    """The result of check ``name`` on ``transport`` (skipped where this machine lacks the transport)."""
    if transport not in gpu_cases.transports():
        pytest.skip(f"{transport}: needs 2 or more GPUs (torch.cuda.device_count() is {torch.cuda.device_count()})")
    result = results(transport)[name]
    assert "error" not in result, f"{name} on {transport} failed:\n{result.get('error')}"
    return result


def ok(run: dict | None, what: str) -> dict:
    assert run is not None, f"{what}: not run"
    assert "error" not in run, f"{what} failed:\n{run['error']}"
    return run


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 for equal non-float tensors, inf for different ones)."""
    if not expected.is_floating_point() or not expected.numel():
        return 0.0 if torch.equal(actual, expected) else float("inf")
    diff = (actual.double() - expected.double()).abs().max()
    return (diff / expected.double().abs().max().clamp_min(1e-12)).item()


def loss_rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def bounds(runs: dict, floor: float) -> tuple[float, dict[str, float]]:
    """The losses' bound and each state tensor's: ``FACTOR`` times the larger of DDP's distance to eager and
    reduction order's (eager with rotated rows), never below ``floor``."""
    eager = ok(runs["eager"], "eager")
    noisy = [ok(runs["ddp"], "DDP"), ok(runs["rotated"], "eager, rows rotated")]
    loss_noise = max(loss_rel(a, b) for run in noisy for a, b in zip(run["losses"], eager["losses"], strict=True))
    state = {k: max(rel(run["state"][k], v) for run in noisy) for k, v in eager["state"].items()}
    return max(floor, FACTOR * loss_noise), {k: max(floor, FACTOR * n) for k, n in state.items()}


def assert_within(got: dict, want: dict, loss_bound: float, state_bounds: dict[str, float], what: str) -> dict:
    """``got`` equals ``want`` within the bounds; returns the worst error and the worst share of its bound."""
    assert len(got["losses"]) == len(want["losses"]) == gpu_cases.STEPS, what
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert loss_rel(a, b) <= loss_bound, f"{what}: loss of step {i}: {a} vs {b} (bound {loss_bound:.2e})"
    assert got["state"].keys() == want["state"].keys(), f"{what}: {sorted(got['state'])} vs {sorted(want['state'])}"
    worst, share = 0.0, 0.0
    for key, value in want["state"].items():
        actual, limit = got["state"][key], state_bounds[key]
        assert actual.shape == value.shape and actual.dtype == value.dtype, f"{what}: {key}"
        err = rel(actual, value)
        assert err <= limit, f"{what}: {key}: max |diff| is {err:.2e} of max |want| (bound {limit:.2e})"
        worst, share = max(worst, err), max(share, err / limit)
    return {"worst_rel": worst, "worst_share_of_bound": share, "loss_bound": loss_bound}


# ------------------------------------------------------------------------------------------------ group
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_backend_follows_the_model_device(results, transport):
    found = check(results, transport, "group")
    device = gpu_cases.device_type()
    want = "gloo" if transport == "gloo-2" or device == "cpu" else "nccl"
    assert served_backend(found["backend"], device) == want, found
    if transport != "gloo-2":
        assert found["started_by"] == "zgraph", found
    if device == "cuda":
        assert found["current"] == torch.device(found["device"]).index, found
    report(f"group[{transport}]", **found)


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("dtype", list(gpu_cases.DTYPES))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ddp_is_a_sound_reference(results, transport, dtype):
    runs = check(results, transport, "parity")[dtype]
    eager, ddp = ok(runs["eager"], "eager"), ok(runs["ddp"], "DDP")
    worst = max(loss_rel(a, b) for a, b in zip(ddp["losses"], eager["losses"], strict=True))
    report(f"ddp_vs_eager[{transport}-{dtype}]", worst_loss_rel=worst)
    assert worst <= DDP_LOSS_LIMIT[dtype], f"DDP vs eager: losses differ by {worst:.2e} relative"


@pytest.mark.parametrize("stage", gpu_cases.STAGES)
@pytest.mark.parametrize("dtype", list(gpu_cases.DTYPES))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_zero_matches_ddp(results, transport, dtype, stage):
    runs = check(results, transport, "parity")[dtype]
    loss_bound, state_bounds = bounds(runs, FLOOR[dtype])
    got = ok(runs[stage], f"zgraph stage {stage}")
    what = f"zgraph stage {stage} vs DDP ({transport}, {dtype})"
    found = assert_within(got, ok(runs["ddp"], "DDP"), loss_bound, state_bounds, what)
    report(f"zero_vs_ddp[{transport}-{dtype}-z{stage}]", **found)


# ------------------------------------------------------------------------------------------------ split
@pytest.mark.parametrize("stage", gpu_cases.STAGES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_split_backward_matches_ddp(results, transport, stage):
    runs = check(results, transport, "split")
    loss_bound, state_bounds = bounds(runs, FLOOR["fp32"])
    got = ok(runs[stage], f"zgraph stage {stage}")
    assert all(got["grad_fns"]), "the step's outputs carry a grad_fn"
    found = assert_within(got, runs["ddp"], loss_bound, state_bounds, f"split, stage {stage} vs DDP ({transport})")
    report(f"split_vs_ddp[{transport}-z{stage}]", **found)


# ------------------------------------------------------------------------------------------------ fp16
@pytest.mark.parametrize("stage", gpu_cases.STAGES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fp16_overflow_on_one_rank_skips_the_update_everywhere(results, transport, stage):
    records = ok(check(results, transport, "fp16")[("overflow", stage)], "fp16")
    device = gpu_cases.device_type()
    assert all(r["scale_devices"] == [device] for r in records), "the loss-scale state lives on the state's device"
    call = gpu_cases.OVERFLOW_CALL
    assert all(r["params_changed"] for r in records[:call]) and all(r["state_changed"] for r in records[1:call])
    skipped = records[call]
    assert not skipped["params_changed"] and not skipped["state_changed"], "parameters and optimizer state untouched"
    assert skipped["scale"] == records[call - 1]["scale"] / 2
    assert all(r["params_changed"] for r in records[call + 1 :])
    assert all(torch.isfinite(torch.tensor(r["loss"])) for i, r in enumerate(records) if i != call)
    report(f"fp16_overflow[{transport}-z{stage}]", scales=[r["scale"] for r in records])


def deepspeed_scales(overflows: list[bool], policy: zgraph.DynamicLossScale) -> list[float]:
    """The scale after each step by DeepSpeed's dynamic loss scaling rules (``hysteresis`` overflows in a row
    before the scale backs off, refilled when it grows), given which steps overflowed."""
    scale, good, hysteresis, out = policy.init_scale, 0, policy.hysteresis, []
    for overflow in overflows:
        if overflow:
            if hysteresis <= 1:
                scale = max(scale * policy.backoff_factor, policy.min_scale)
            else:
                hysteresis -= 1
            good = 0
        else:
            good += 1
            if good % policy.growth_interval == 0:
                scale, hysteresis = scale * policy.growth_factor, policy.hysteresis
        out.append(scale)
    return out


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fp16_dynamic_loss_scaling_with_deepspeeds_defaults(results, transport, stage):
    """``Config(param_dtype=torch.float16, loss_scale="dynamic")``: a skipped step (an overflow) changes neither
    parameters nor optimizer state, the scales follow DeepSpeed's rules from the overflows seen, and training
    proceeds. (Which steps overflow depends on fp16 rounding; on one rank it is reported beside the CPU's.)"""
    records = ok(check(results, transport, "fp16")[("dynamic", stage)], "fp16, dynamic")
    history = [(r["params_changed"], r["scale"]) for r in records]
    for r in records:
        if not r["params_changed"]:
            assert not r["state_changed"], history
    assert any(r["params_changed"] for r in records), f"no step updated the parameters: {history}"
    want = deepspeed_scales([not changed for changed, _ in history], zgraph.DynamicLossScale())
    assert [scale for _, scale in history] == want, f"scales {history} vs DeepSpeed's rules {want}"
    same_as_cpu = None
    if gpu_cases.transports()[transport].world == 1:
        on_cpu = gpu_memory_cases.fp16_run(0, 1, torch.device("cpu"), stage, "dynamic", False)
        same_as_cpu = history == [(r["params_changed"], r["scale"]) for r in on_cpu]
    report(f"fp16_dynamic[{transport}-z{stage}]", history=history, same_as_cpu=same_as_cpu)


# ------------------------------------------------------------------------------------------------ offload
@pytest.mark.parametrize("case", list(gpu_cases.OFFLOAD))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_host_offload_is_bitwise_equal_to_no_offload(results, transport, case):
    runs = check(results, transport, "offload")[case]
    plain, off = ok(runs["plain"], "without offload"), ok(runs["offload"], "with offload")
    assert off["losses"] == plain["losses"], "losses"
    assert off["state"].keys() == plain["state"].keys()
    for key, value in plain["state"].items():
        assert torch.equal(off["state"][key], value), f"{key}: max |diff| {rel(off['state'][key], value):.2e}"
    assert runs["every_rank_equal"], "another rank's losses or state differ"
    if gpu_cases.device_type() == "cuda":  # on the CPU "cpu" is the identity: nothing moves
        assert off["held"] < plain["held"], "offloaded state releases its device memory between steps"
    report(f"offload[{transport}-{case}]", held_plain=plain["held"], held_offload=off["held"], explain=off["explain"])


@pytest.mark.parametrize("case", list(gpu_cases.HOST_UPDATE))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_update_on_the_host_tracks_the_update_on_the_device(results, transport, case):
    """Issue 43: the update on the host computes AdamW with the host's CPU kernels, the step without offload with
    the GPU's: the same arithmetic, rounded by other kernels (on the CPU rehearsal bitwise); master parameters and
    states leave the device."""
    runs = check(results, transport, "offload")[case]
    plain, host = ok(runs["plain"], "without offload"), ok(runs["offload"], "update on the host")
    assert max(loss_rel(a, b) for a, b in zip(host["losses"], plain["losses"])) <= 1e-4, "losses"
    assert host["state"].keys() == plain["state"].keys()
    for key, value in plain["state"].items():
        assert rel(host["state"][key], value) <= 1e-4, key
    if gpu_cases.device_type() == "cuda":
        assert host["held_on_device"] < plain["held_on_device"], "master parameters and states live in host memory"
    held = {"held_on_device_plain": plain["held_on_device"], "held_on_device_host": host["held_on_device"]}
    report(f"host_update[{transport}-{case}]", **held, explain=host["explain"])


# ------------------------------------------------------------------------------------------------ estimate
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_estimate_peak_matches_max_memory_allocated(results, transport):
    cases = check(results, transport, "estimate")
    failures = []
    for (stage, recipe), found in cases.items():
        found = ok(found, f"estimate, stage {stage} {recipe}")
        ratio = found["estimated"] / found["measured"]
        raw_ratio = found["estimated"] / found["raw_peak"]
        report(
            f"estimate[{transport}-z{stage}-{recipe}]",
            ratio=round(ratio, 4),
            raw_ratio=round(raw_ratio, 4),
            estimated_mib=round(found["estimated"] / 2**20, 2),
            measured_mib=round(found["measured"] / 2**20, 2),
            outside_mib=round(found["outside"] / 2**20, 2),
            peak_node=found["peak_node"],
            estimate_kwargs=found["estimate_kwargs"],
        )
        if abs(ratio - 1) > ESTIMATE_TOLERANCE:
            failures.append(f"stage {stage} {recipe}: estimate / measured = {ratio:.3f}")
    assert not failures, "; ".join(failures)


# ------------------------------------------------------------------------------------------------ meta
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_meta_model_is_made_real_where_the_group_computes(results, transport):
    """Issue 27: a model built on meta gets its shards on the rank's GPU under NCCL (the host under gloo), with
    the values the same model built there from the same seed has, bitwise."""
    found = check(results, transport, "meta")
    want = "cuda" if gpu_cases.device_type() == "cuda" and transport != "gloo-2" else "cpu"
    assert torch.device(found["device"]).type == want, found
    assert found["max_abs_diff"] == 0.0, found
    report(f"meta[{transport}]", **found)
