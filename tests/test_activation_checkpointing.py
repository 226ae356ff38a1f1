"""Activation checkpointing (``torch.utils.checkpoint``, reentrant and not) under every precision configuration.

The reference is eager PyTorch with the same casts: under ``param_dtype`` each parameter is read through a
parametrization that casts it (so the checkpoint's recomputation casts again, with autograd through the cast,
as zgraph's does) and the model's input is cast as zgraph casts it; under autocast the forward runs under
``torch.autocast``. The graph runs the same aten ops on the same values, so losses and parameters are equal
bitwise. Before the fix (issue 16), with ``param_dtype=torch.bfloat16`` the reentrant form failed when run
(``mat1 and mat2 must have the same dtype``) and the non-reentrant one at capture (recomputed values had other
dtypes): the backward, and the recomputation inside it, ran without zgraph's casts.
"""

from __future__ import annotations

import pytest
import torch
from checkpointing_cases import LR, Net, autocast_step, batches, eager_reference, step

import zgraph

CONFIGS = {
    "fp32": ({}, step),
    "bf16_params": ({"param_dtype": torch.bfloat16}, step),
    "fp16_params_loss_scale": ({"param_dtype": torch.float16, "loss_scale": 1024.0}, step),
    "autocast_config": ({"autocast_dtype": torch.bfloat16}, step),
    "autocast_in_step": ({}, autocast_step),
    "bf16_params_and_autocast": ({"param_dtype": torch.bfloat16, "autocast_dtype": torch.bfloat16}, step),
}


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_activation_checkpointing_equals_eager_with_the_same_casts(name, reentrant):
    kwargs, fn = CONFIGS[name]
    model = Net(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    compiled = zgraph.distribute(zgraph.Config(backend="eager", **kwargs))(fn)
    got = [compiled(model, opt, x, y) for x, y in batches()]
    autocast = "autocast_dtype" in kwargs or fn is autocast_step
    want, params = eager_reference(reentrant, kwargs.get("param_dtype"), autocast, kwargs.get("loss_scale"))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    for p, q in zip(model.parameters(), params):
        assert p.dtype == torch.float32 and torch.equal(p, q)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("checkpointing") / "results.pt"
    run_ranks(2, "checkpointing_cases.run", str(path), ["stages"], timeout=600)
    results = torch.load(path, weights_only=False)["stages"]
    assert "error" not in results, results.get("error")
    return results


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_activation_checkpointing_with_bf16_params_equals_eager_on_two_ranks(two_ranks, reentrant, stage):
    """Each rank's bf16 gradient is averaged in bf16 where eager computes the global batch's once: gradients
    differ by a bf16 ulp or two, so SGD's update of each parameter by about 2**-8 of itself (2**-6 allowed)."""
    got = two_ranks[(reentrant, stage)]
    want_losses, want_params = eager_reference(reentrant, torch.bfloat16, False, None)
    initial = Net(reentrant).state_dict()
    for a, b in zip(got["losses"], want_losses):
        assert abs(a - float(b)) <= 2**-7 * abs(float(b))
    for (name, start), want in zip(initial.items(), want_params):
        ratio = float((got["params"][name] - want).norm() / (want - start).norm())
        assert ratio <= 2**-6, (name, ratio)
