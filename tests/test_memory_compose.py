"""Activation recomputation (``Config.remat``: a policy everywhere, or per block as the memory planner chooses) and
activation offload composed with what else a step may use: bf16 compute, bf16 model states, fp16 with dynamic loss
scaling, checkpoints (``zgraph.save`` / ``load``), the inductor backend. Bitwise equal to the same step without
them on the eager backend; one process at stage 3 (``test_remat`` and ``test_offload_activations`` run every
stage on one and two ranks)."""

from __future__ import annotations

import pytest
import torch
from remat_cases import Net, _forward, batches, step, train, train_split

import zgraph

PER_BLOCK = {"model.blocks.0": "full", "model.blocks.1": "selective"}
MEMORY = {
    "selective": {"remat": "selective"},
    "full+offload": {"remat": "full", "offload_activations": "nvme"},
    "per-block+offload": {"remat": PER_BLOCK, "offload_activations": "nvme"},
}
PRECISION = {
    "bf16 compute": {"param_dtype": torch.bfloat16},
    "bf16 states": {
        "param_dtype": torch.bfloat16,
        "master_dtype": torch.bfloat16,
        "optimizer_state_dtype": torch.bfloat16,
    },
    "fp16 loss scaling": {
        "param_dtype": torch.float16,
        "loss_scale": zgraph.DynamicLossScale(init_scale=2.0**8, hysteresis=1),
    },
}


def _config(tmp_path, **fields) -> zgraph.Config:
    return zgraph.Config(stage=3, backend="eager", param_persistence_threshold=0, offload_dir=str(tmp_path), **fields)


def _equal(got, want) -> None:
    losses, params, _ = got
    assert all(torch.equal(a, b) for a, b in zip(losses, want[0])), (losses, want[0])
    assert all(torch.equal(params[k], v) for k, v in want[1].items())


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The step without recomputation or offload, per precision."""
    return {name: train(_config(tmp_path_factory.mktemp("plain"), **fields)) for name, fields in PRECISION.items()}


@pytest.mark.parametrize("memory", list(MEMORY))
@pytest.mark.parametrize("precision", list(PRECISION))
def test_with_low_precision_and_loss_scaling(plain, tmp_path, precision, memory):
    got = train(_config(tmp_path, **PRECISION[precision], **MEMORY[memory]))
    assert got[2] > 0, "the remat pass recomputed nothing"
    _equal(got, plain[precision])
    if precision == "bf16 states":
        assert all(v.dtype == torch.bfloat16 for v in got[1].values() if v.is_floating_point())
    assert not list(tmp_path.rglob("*.pt")) and not [p for p in tmp_path.rglob("*") if p.is_file()]


def _resumed(tmp_path, config: zgraph.Config) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], str]:
    """Two calls, ``zgraph.save``, a new model and optimizer ``zgraph.load``-ed, the third call: as ``train``'s.
    Also what the last step's ``explain()`` says."""
    losses = []
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for call, (x, y) in enumerate(batches()):
        if call == 2:
            zgraph.save(tmp_path / "ckpt", model, opt)
            model = Net()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            zgraph.load(tmp_path / "ckpt", model, opt)
        if call in (0, 2):  # a step for the model, and one for the model loaded
            compiled = zgraph.distribute(config)(step)
        torch.manual_seed(10 + call)
        losses.append(compiled(model, opt, x, y).clone())
    return losses, zgraph.full_state_dict(model), compiled.explain()


def test_save_and_load_are_unaffected(tmp_path):
    """Saved from a step that recomputes per block and offloads activations, loaded into a new model: the resumed
    run is bitwise the uninterrupted one without either."""
    (tmp_path / "tier").mkdir()
    config = _config(tmp_path / "tier", **MEMORY["per-block+offload"])
    losses, params, explained = _resumed(tmp_path, config)
    assert "remat per block (full on 1, selective on 1): " in explained
    assert "offload_activations='nvme': " in explained and "saved activations" in explained
    _equal((losses, params, None), train(_config(tmp_path / "tier")))
    assert not [p for p in (tmp_path / "tier").rglob("*") if p.is_file()], "activation files left behind"


@pytest.mark.inductor
def test_inductor_backend(tmp_path):
    """The per-block remat and the offload nodes through inductor: bitwise the inductor step without them."""
    config = zgraph.Config(backend="inductor", offload_dir=str(tmp_path), **MEMORY["per-block+offload"])
    got = train(config)
    assert got[2] > 0
    _equal(got, train(zgraph.Config(backend="inductor")))


def test_budget_in_split_mode():
    """Split mode (zgraph's forward, ``backward()`` outside it, zgraph's update), each step under a budget just
    below the forward's peak without remat: the forward recomputes, training is bitwise the unbudgeted run's."""
    model, (x, _) = Net(), batches()[0]
    forward = zgraph.distribute(zgraph.Config(backend="eager"))(_forward)
    peak = forward.estimate(model, x, memory_budget=2**40).chosen.estimate.peak_bytes
    got = train_split(zgraph.Config(backend="eager", memory_budget=peak - 1))
    assert got[2] > 0, "the plan must recompute to fit"
    _equal(got, train_split(zgraph.Config(backend="eager")))
