"""``Config.keep_fp32_modules`` (issue 16): with a 16-bit ``param_dtype`` the norm layers keep their parameters in
fp32 by default, so BatchNorm models train (before: ``expected scalar type BFloat16 but found Float`` on the first
call, from batch norm given bf16 weights and fp32 running statistics). Compared with eager PyTorch reading the
parameters with the same casts (``norm_precision_cases.reference``)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from norm_precision_cases import LR, batches, make_model, reference, step
from torch import nn

import zgraph
from zgraph.config import NORM_MODULES


def test_bf16_batchnorm_cnn_equals_eager_with_norms_in_fp32_bitwise():
    """One process: the same ops on the same values as eager with the policy's casts, bitwise."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    compiled = zgraph.distribute(backend="eager", param_dtype=torch.bfloat16)(step)
    losses = [float(compiled(model, opt, x, y)) for x, y in batches()]
    want = reference(1)
    assert losses == want["losses"]
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, want["params"][name]), name
    for name, b in model.named_buffers():
        assert torch.equal(b, want["buffers"][name]), name
    casts = {str(n.kwargs["dtype"]) for n in compiled.graphs["captured"].graph.nodes if "dtype" in n.kwargs}
    assert "torch.bfloat16" in casts


def test_an_empty_policy_casts_norm_layers_too():
    """``keep_fp32_modules=()``: every parameter is read in bf16 (a LayerNorm model, whose kernel accepts that)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    compiled = zgraph.distribute(backend="eager", param_dtype=torch.bfloat16, keep_fp32_modules=())(step)
    compiled(model, opt, torch.randn(4, 8), torch.randint(0, 4, (4,)))
    graph = compiled.graphs["captured"].graph
    norm = next(n for n in graph.nodes if "layer_norm" in str(n.target))
    assert norm.args[2].meta["val"].dtype == torch.bfloat16, "the LayerNorm weight is read in bf16"


def test_keep_fp32_modules_is_checked_when_the_config_is_built():
    assert zgraph.Config().keep_fp32_modules == NORM_MODULES
    for module in (nn.BatchNorm1d(2), nn.SyncBatchNorm(2), nn.InstanceNorm2d(2), nn.GroupNorm(1, 2), nn.RMSNorm(2)):
        assert isinstance(module, NORM_MODULES)
    assert zgraph.Config(keep_fp32_modules=[nn.LayerNorm]).keep_fp32_modules == (nn.LayerNorm,)
    assert zgraph.Config(keep_fp32_modules=nn.LayerNorm).keep_fp32_modules == (nn.LayerNorm,)
    for bad in ("LayerNorm", (nn.LayerNorm, int), (nn.LayerNorm(2),)):
        with pytest.raises(ValueError, match="keep_fp32_modules must be a tuple of nn.Module subclasses"):
            zgraph.Config(keep_fp32_modules=bad)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("norm_precision") / "results.pt"
    run_ranks(2, "norm_precision_cases.run", str(path), ["norms_in_fp32"], timeout=600)
    results = torch.load(path, weights_only=False)
    assert "error" not in results["norms_in_fp32"], results["norms_in_fp32"]["error"]
    return results["norms_in_fp32"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_batchnorm_cnn_equals_ddp_style_eager_on_two_ranks(ranks, stage):
    """The control: in fp32 the reference's per-rank BatchNorm statistics are zgraph's, to round-off."""
    got, want = ranks[(str(None), stage)], reference(2, None)
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) <= 1e-6 * abs(b)
    for name, p in want["params"].items():
        assert float((got["params"][name] - p).abs().max()) <= 1e-5, name
    for name, b in want["buffers"].items():
        assert torch.allclose(got["buffers"][name], b, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_batchnorm_cnn_equals_ddp_style_eager_on_two_ranks(ranks, stage):
    """The norm layers' fp32 gradients are averaged in bf16 (the reduce dtype), where the reference adds them in
    fp32: they differ by a bf16 ulp (2**-8), so SGD's update of each parameter differs by about 2**-8 of itself
    (measured: at most 0.0043; 2**-6 allowed) and the second loss by less. Over more steps bf16 rounding
    differences grow through BatchNorm as between any two bf16 runs (DDP and eager alike), so 2 steps are run."""
    got, want = ranks[(str(torch.bfloat16), stage)], reference(2)
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) <= 2**-8 * abs(b)
    for name, p in want["params"].items():
        update = p - want["initial"][name]
        ratio = float((got["params"][name] - p).norm() / update.norm())
        assert ratio <= 2**-6, (name, ratio)
    for name, b in want["buffers"].items():
        assert torch.allclose(got["buffers"][name].float(), b.float(), rtol=2**-6, atol=1e-3), name
    if stage == 3:
        assert got["gathered_dtypes"] == {"torch.bfloat16", "torch.float32"}, "norm weights are gathered in fp32"
