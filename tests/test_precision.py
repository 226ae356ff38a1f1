"""Mixed precision, low-precision state, fp16 loss scaling and clipping (issue: cast passes).

Single-process checks compare with eager PyTorch bitwise (the graph runs the same ops in the same dtypes);
multi-rank checks run on 2 spawned ranks (gloo) against eager PyTorch on the global batch.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from precision_cases import LR, STEPS, batches, make_model, plain_step, reference

import zgraph

NAMES = ["mixed", "low_precision_state", "overflow", "max_grad_norm"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("precision") / "results.pt"
    run_ranks(2, "precision_cases.run", str(path), NAMES)
    results = torch.load(path, weights_only=False)
    for name, value in results.items():
        assert "error" not in value, f"{name}: {value['error']}"
    return results


# ------------------------------------------------------------------------------------------- one process
def _pair():
    model = make_model()
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def test_bf16_compute_matches_eager_mixed_precision_bitwise():
    """param_dtype=bf16 on one process: eager PyTorch that casts parameters and inputs to bf16 for the forward
    (FSDP2's mixed precision) computes the same ops on the same values."""
    model, opt = _pair()
    step = zgraph.distribute(backend="eager", param_dtype=torch.bfloat16)(plain_step)
    ref_model, ref_opt = _pair()
    for x, y in batches():
        got = step(model, opt, x, y)
        params = {n: p.to(torch.bfloat16) for n, p in ref_model.named_parameters()}
        loss = F.cross_entropy(torch.func.functional_call(ref_model, params, (x.to(torch.bfloat16),)), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert got.dtype == torch.bfloat16 and torch.equal(got, loss.detach())
    assert [p.dtype for p in model.parameters()] == [torch.float32] * 4
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_autocast_region_in_the_step_is_honoured_exactly():
    def step(model, opt, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model, opt = _pair()
    ref_model, ref_opt = copy.deepcopy(model), None
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR)
    compiled = zgraph.distribute(backend="eager")(step)
    for x, y in batches():
        assert torch.equal(compiled(model, opt, x, y), step(ref_model, ref_opt, x, y))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    casts = [n for n in compiled.graphs["captured"].graph.nodes if "bfloat16" in str(n.kwargs.get("dtype"))]
    assert casts, "autocast's casts are in the captured graph"


def test_user_clip_grad_norm_returns_eagers_total_norm_exactly():
    def step(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        opt.step()
        opt.zero_grad()
        return loss, norm

    model, opt = _pair()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR)
    compiled = zgraph.distribute(backend="eager")(step)
    for x, y in batches():
        got, want = compiled(model, opt, x, y), step(ref_model, ref_opt, x, y)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_max_grad_norm_config_matches_clip_grad_norm_exactly():
    model, opt = _pair()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR)
    compiled = zgraph.distribute(backend="eager", max_grad_norm=0.3)(plain_step)
    for x, y in batches():
        compiled(model, opt, x, y)
        loss = F.cross_entropy(ref_model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.3)
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_fp16_dynamic_loss_scale_skips_overflowing_steps_and_backs_off():
    """DeepSpeed's defaults start at 2**16, which overflows fp16 on the first backward: those steps are skipped
    (parameters untouched) and the scale halves after ``hysteresis`` overflows; then training proceeds."""
    model, opt = _pair()
    step = zgraph.distribute(backend="eager", param_dtype=torch.float16, loss_scale="dynamic")(plain_step)
    history = []
    for x, y in batches():
        before = [p.detach().clone() for p in model.parameters()]
        step(model, opt, x, y)
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        history.append((changed, float(opt._zgraph_loss_scale["scale"])))
    assert history[0] == (False, 2.0**16) and history[1] == (False, 2.0**15)
    assert all(changed for changed, _ in history[2:])
    assert history[-1][1] == 2.0**15


@pytest.mark.parametrize(
    "kwargs",
    [
        {"master_dtype": torch.bfloat16, "optimizer_state_dtype": torch.bfloat16, "param_dtype": torch.bfloat16},
        {"optimizer_state_dtype": torch.bfloat16},
    ],
)
def test_low_precision_state_dtypes_on_one_process(kwargs):
    model, opt = _pair()
    step = zgraph.distribute(backend="eager", **kwargs)(plain_step)
    for x, y in batches()[:3]:
        step(model, opt, x, y)
    master = kwargs.get("master_dtype", torch.float32)
    assert all(p.dtype == master for p in model.parameters())
    for state in opt.state.values():
        assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
        assert state["step"].dtype == torch.float32


# --------------------------------------------------------------------------------------------- two ranks
def _max_abs(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_with_clipping_matches_eager_on_two_ranks(ranks, stage):
    got = ranks["mixed"][(str(None), stage)]
    want = reference(None)
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) <= 1e-6 * abs(b)
    for a, b in zip(got["norms"], want["norms"]):
        assert abs(a - b) <= 1e-6 * abs(b), "the global norm over all shards is eager's norm"
    assert _max_abs(got["params"], want["params"]) <= 1e-6


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_compute_fp32_master_matches_eager_on_two_ranks(ranks, stage):
    """Tolerances: bf16 keeps 8 significant bits. Each rank's gradient is rounded to bf16 and the ranks average
    in bf16 (the reduce dtype), where eager rounds the global-batch gradient once, so gradients differ by a few
    bf16 ulps (<= 2**-7 relative). AdamW turns a relative gradient difference into at most about that share of
    lr per step: after STEPS steps parameters may differ by STEPS * lr * 2**-7. Losses are bf16 values
    (compared to 2 ulps), norms fp32 sums of such gradients (2**-7 relative)."""
    got = ranks["mixed"][(str(torch.bfloat16), stage)]
    want = reference(torch.bfloat16)
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) <= 2 * 2**-8 * abs(b)
    for a, b in zip(got["norms"], want["norms"]):
        assert abs(a - b) <= 2**-7 * abs(b)
    assert _max_abs(got["params"], want["params"]) <= STEPS * LR * 2**-7
    assert set(got["param_dtypes"].values()) == {"torch.float32"}


def test_collective_dtypes_follow_the_precision_config(ranks):
    fp32, bf16 = str(torch.float32), str(torch.bfloat16)
    stage3 = ranks["mixed"][(bf16, 3)]["collectives"]
    gathers = {(d, phase) for kind, d, phase in stage3 if kind == "all_gather_into_tensor"}
    assert gathers == {(bf16, "forward"), (bf16, "backward")}, "stage 3 gathers parameters in the compute dtype"
    scatters = {d for kind, d, _ in stage3 if kind == "reduce_scatter_tensor"}
    assert scatters == {bf16}, "gradients are reduced in the compute dtype (reduce_dtype default)"
    stage1 = ranks["mixed"][(bf16, 1)]["collectives"]
    assert {d for kind, d, _ in stage1 if kind == "all_reduce"} == {bf16}
    assert {d for kind, d, _ in stage1 if kind == "all_gather_into_tensor"} == {fp32}, "updated master params"
    norms = [c for c in ranks["mixed"][(bf16, 2)]["collectives"] if c[0] == "all_reduce"]
    assert len(norms) == 1 and norms[0][1] == fp32, "one all-reduce of partial squared sums for the norm"


def test_bf16_master_grads_and_states_are_stored_in_bf16(ranks):
    result = ranks["low_precision_state"]
    for name, state in result["state"].items():
        assert state["param"] == ("Parameter", str(torch.bfloat16), str(torch.bfloat16)) or state["param"][1:] == (
            str(torch.bfloat16),
            str(torch.bfloat16),
        ), name
        assert state["grad"] == ("DTensor", str(torch.bfloat16)), name
        assert state["optimizer"]["exp_avg"] == str(torch.bfloat16)
        assert state["optimizer"]["exp_avg_sq"] == str(torch.bfloat16)
    assert all(math.isfinite(loss) for loss in result["losses"])


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(ranks):
    records = ranks["overflow"]["records"]
    assert all(r["changed"] for r in records[:3]) and all(r["state_changed"] for r in records[1:3])
    skipped = records[3]
    assert not skipped["changed"] and not skipped["state_changed"], "parameters and optimizer state untouched"
    assert skipped["scale"] == records[2]["scale"] / 2
    assert records[4]["changed"]
    flags = [c for c in ranks["overflow"]["collectives"] if c[0] == "all_reduce" and c[1] == str(torch.int32)]
    assert len(flags) == 1, "one all-reduce of the overflow flag"


def test_max_grad_norm_on_sharded_gradients_matches_eager(ranks):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for x, y in batches():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        opt.step()
        opt.zero_grad()
    want = {n: p.detach() for n, p in model.named_parameters()}
    assert _max_abs(ranks["max_grad_norm"]["params"], want) <= 1e-6


def test_precision_config_rejects_what_deepspeed_rejects():
    with pytest.raises(ValueError, match="optimizer_state_dtype=torch.float16"):
        zgraph.Config(optimizer_state_dtype=torch.float16)
    with pytest.raises(ValueError, match="loss_scale"):
        zgraph.Config(param_dtype=torch.float16)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        zgraph.Config(param_dtype=torch.bfloat16, master_dtype=torch.float16, loss_scale="dynamic")
    with pytest.raises(ValueError, match="less precise"):
        zgraph.Config(master_dtype=torch.bfloat16, param_dtype=torch.float32)
    with pytest.raises(ValueError, match="DynamicLossScale.backoff_factor"):
        zgraph.DynamicLossScale(backoff_factor=2.0)
    assert isinstance(
        zgraph.Config(param_dtype=torch.float16, loss_scale="dynamic").loss_scale, zgraph.DynamicLossScale
    )
