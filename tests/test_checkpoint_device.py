"""Checkpoints and ``full_state_dict`` with the state on a device, checked on the stand-in accelerator of
``tests/standin.py`` (2 spawned ranks on the ``standin`` backend, and one process without a group), plus
``full_state_dict(rank0_only=True)`` against the whole result on real gloo ranks.

- ``zgraph.load`` puts optimizer state where torch.optim keeps it: AdamW's ``step`` on the host (a 0-d CPU tensor,
  so the step does not retrace nor read it back per parameter), on the device for a ``capturable`` param group;
  the other fields on the parameter's device.
- ``zgraph.load`` stages on the host: the device holds the model and optimizer state once, plus about one tensor,
  never twice; loading reads nothing back from the device.
- ``zgraph.save`` marks its device-to-host copies (``zgraph.ops.host_read``), so the audit accepts them.
- ``zgraph.full_state_dict`` returns host tensors, streamed one at a time; with ``rank0_only`` only rank 0 holds
  the result (``{}`` / ``({}, {})`` elsewhere, torch.distributed.checkpoint's convention).

The stand-in's tensors have no values (meta): saving there writes zeros, so its checkpoints are checked for what
they hold (keys, shapes, a load back), and the loads read a checkpoint a host run wrote (real files).
"""

from __future__ import annotations

import json

import checkpoint_device_cases as cdc
import pytest
import torch
from dist_harness import run_ranks
from standin import DeviceAudit
from torch.distributed.tensor import DTensor

import zgraph

pytestmark = pytest.mark.timeout(900)

# what the device may hold while ``load`` runs, beyond the model and optimizer state: one tensor being copied in
# (as new state), plus a little (0-d states, allocator rounding does not exist on meta)
SLACK = 256
# gathering one tensor whole (``DTensor.full_tensor``) holds up to this many times its bytes: the padded all-gather
# output and its unpadded copy, and on gloo now and then a buffer of the previous gather that the collective's work
# object releases a moment later
GATHERING = 4


def load_json(path):
    return json.loads(path.read_text())


def case(seen, name):
    """What a rank saw in the case ``name``; fails with the case's own error if it raised."""
    got = seen[name]
    assert "error" not in got, f"{name}: {got['error']}"
    return got


@pytest.fixture(scope="module")
def host_checkpoints(tmp_path_factory):
    """Checkpoints written by a host run: a default AdamW, and one whose param groups say ``capturable``."""
    root = tmp_path_factory.mktemp("host_ckpt")
    cdc.write_cpu_checkpoint(str(root / "plain"))
    cdc.write_cpu_checkpoint(str(root / "capturable"), capturable=True)
    return root


# ------------------------------------------------------------------------------------------ one process
def test_load_puts_step_where_torch_optim_keeps_it_in_one_process(host_checkpoints):
    for name, kwargs, step_device in (("plain", {}, "cpu"), ("capturable", {"capturable": True}, "meta")):
        model = cdc.net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
        seen = cdc.measured_load(str(host_checkpoints / name), model, opt)
        assert seen["extra"] == {"written": "on the host"}
        assert seen["devices"] == {"step": [step_device], "other": ["meta"]}, name
        assert seen["step_dtypes"] == ["torch.float32"]
        assert seen["reads"] == [], seen["reads"]  # loading reads nothing back from the device


def test_load_holds_the_state_once_on_the_device_in_one_process(host_checkpoints):
    model = cdc.net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh = cdc.measured_load(str(host_checkpoints / "plain"), model, opt)
    # new optimizer state is made on the device one tensor at a time: the peak is the final state plus nothing
    assert fresh["peak"] <= fresh["state"] + SLACK, fresh
    again = cdc.measured_load(str(host_checkpoints / "plain"), model, opt)
    # into existing state: copied in place, nothing new on the device
    assert again["peak"] <= again["before"] + SLACK, again


def test_full_state_dict_returns_host_tensors_in_one_process():
    model = cdc.net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with DeviceAudit():
        model_state, optim_state = zgraph.full_state_dict(model, opt)
    assert {str(v.device) for v in model_state.values()} == {"cpu"}
    assert {k: v.shape for k, v in model_state.items()} == {k: v.shape for k, v in model.state_dict().items()}
    assert optim_state["param_groups"][0]["lr"] == 1e-3 and optim_state["state"] == {}


# ------------------------------------------------------------------------------------------ 2 stand-in ranks
@pytest.fixture(scope="module")
def standin_loads(host_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("standin_load")
    run_ranks(
        2,
        "checkpoint_device_cases.load_on_standin",
        str(host_checkpoints / "plain"),
        str(host_checkpoints / "capturable"),
        str(out),
        init_group="standin",
        timeout=600,
    )
    return [load_json(out / f"load.{rank}.json") for rank in range(2)]


@pytest.mark.parametrize("name", ["fresh default", "again default", "stage 1", "stage 3"])
def test_load_keeps_step_on_the_host_for_a_default_adamw(standin_loads, name):
    for seen in standin_loads:
        got = case(seen, name)
        assert got["devices"] == {"step": ["cpu"], "other": ["meta"]}, got
        assert got["extra"] == {"written": "on the host"}
        assert got["reads"] == [], got["reads"]


@pytest.mark.parametrize("name", ["fresh capturable", "again capturable"])
def test_load_puts_step_on_the_device_for_a_capturable_adamw(standin_loads, name):
    for seen in standin_loads:
        got = case(seen, name)
        assert got["devices"] == {"step": ["meta"], "other": ["meta"]}, got
        assert got["step_dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_step_after_load_does_not_retrace(standin_loads, stage):
    for seen in standin_loads:
        got = case(seen, f"stage {stage}")
        assert got["variants"] == 1, got
        assert got["devices_after_step"] == {"step": ["cpu"], "other": ["meta"]}


@pytest.mark.parametrize("name", ["fresh default", "fresh capturable"])
def test_load_makes_new_state_on_the_device_one_tensor_at_a_time(standin_loads, name):
    for seen in standin_loads:
        got = case(seen, name)
        # before any step the optimizer has no state: the device ends with the model and the new state, and
        # never held more (staged twice it would hold the model and the optimizer state once more)
        assert got["peak"] <= got["state"] + SLACK, got


@pytest.mark.parametrize("name", ["again default", "again capturable", "stage 1", "stage 3"])
def test_load_into_existing_state_holds_it_once_plus_one_tensor(standin_loads, name):
    for seen in standin_loads:
        got = case(seen, name)
        assert got["state"] <= got["before"] + SLACK, got  # the state was replaced, not added to
        assert got["peak"] <= got["before"] + got["largest"] + SLACK, got


def test_save_on_the_device_marks_its_host_copies_and_loads_back(tmp_path):
    path = tmp_path / "ckpt"
    run_ranks(2, "checkpoint_device_cases.save_on_standin", str(path), str(tmp_path), init_group="standin", timeout=600)
    for rank in range(2):
        seen = load_json(tmp_path / f"save.{rank}.json")
        assert seen["save"] is None, seen["save"]
        assert seen["save reads"] and all(r.startswith("checkpoint: ") for r in seen["save reads"]), seen
        assert seen["extra"] == {"step": 1}
        assert seen["load reads"] == [], seen["load reads"]
        assert seen["devices"] == {"step": ["cpu"], "other": ["meta"]}
        assert seen["param_devices"] == ["meta"]
    # the checkpoint holds every key of the model, whole (its values are the stand-in's zeros)
    state = zgraph.consolidate(str(path), str(tmp_path / "model.pt"))
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in cdc.net("cpu").state_dict().items()}


@pytest.fixture(scope="module")
def standin_full(tmp_path_factory):
    out = tmp_path_factory.mktemp("standin_full")
    run_ranks(2, "checkpoint_device_cases.full_state_dict_on_standin", str(out), init_group="standin", timeout=600)
    return [load_json(out / f"full.{rank}.json") for rank in range(2)]


def test_full_state_dict_returns_whole_host_tensors_on_every_rank(standin_full):
    for seen in standin_full:
        got = case(seen, "every rank")
        assert got["devices"] == ["cpu"] and got["dtensors"] == 0, got
        assert got["model"] == seen["whole"]
        assert len(got["optimizer"]) == len(seen["whole"])
        for index, fields in got["optimizer"].items():
            assert fields["exp_avg"] == fields["exp_avg_sq"] == list(seen["whole"].values())[int(index)]
            assert fields["step"] == []
        # streamed: the device holds one gathered tensor at a time, never the whole model and optimizer
        assert got["device_peak"] <= GATHERING * got["largest"] + SLACK, got
        assert got["reads"] == ["full_state_dict: a whole tensor copied to the host"]


def test_full_state_dict_rank0_only_leaves_the_result_on_rank_0(standin_full):
    rank0, rank1 = (case(seen, "rank0_only") for seen in standin_full)
    whole = standin_full[0]["whole"]
    assert rank0["model"] == whole and rank0["devices"] == ["cpu"] and rank0["dtensors"] == 0
    assert rank0["optimizer"] == case(standin_full[0], "every rank")["optimizer"] and rank0["param_groups"] == 1
    assert rank1["model"] == {} and rank1["optimizer"] == {} and rank1["bytes"] == 0
    # the result is many tensors: the bounds below tell "one tensor at a time" from "everything at once"
    assert rank0["bytes"] > 3 * GATHERING * rank0["largest"]
    # rank 0's host memory: the result and about one tensor; the other ranks' host memory: nothing at all
    assert rank0["host_peak"] <= rank0["bytes"] + rank0["largest"] + SLACK, rank0
    assert rank1["host_peak"] == 0, rank1
    for seen in (rank0, rank1):
        assert seen["device_peak"] <= GATHERING * seen["largest"] + SLACK, seen
    model0, model1 = (case(seen, "model rank0_only") for seen in standin_full)
    assert model0["model"] == whole and model0["optimizer"] is None
    assert model1["model"] == {} and model1["bytes"] == 0


# ------------------------------------------------------------------------------------------ gloo ranks
@pytest.mark.parametrize("stage", [1, 3])
def test_full_state_dict_rank0_only_equals_the_whole_result_on_gloo(tmp_path, stage):
    run_ranks(2, "checkpoint_device_cases.full_state_dict_on_gloo", str(tmp_path), stage, timeout=600)
    rank0 = torch.load(tmp_path / f"gloo{stage}.0.pt", weights_only=False)
    rank1 = torch.load(tmp_path / f"gloo{stage}.1.pt", weights_only=False)
    (model_want, optim_want), (model_got, optim_got) = rank0["everyone"], rank0["only"]
    assert model_got.keys() == model_want.keys()
    assert all(torch.equal(model_got[k], model_want[k]) for k in model_want)
    assert optim_got["param_groups"] == optim_want["param_groups"]
    assert optim_got["state"].keys() == optim_want["state"].keys()
    for index, fields in optim_want["state"].items():
        assert fields.keys() == optim_got["state"][index].keys()
        assert all(torch.equal(optim_got["state"][index][k], v) for k, v in fields.items())
    whole = cdc.net("cpu").state_dict()
    assert {k: v.shape for k, v in model_got.items()} == {k: v.shape for k, v in whole.items()}
    assert not any(isinstance(v, DTensor) for v in model_got.values())
    assert rank0["model_only"].keys() == model_want.keys()
    assert rank1["only"] == ({}, {}) and rank1["model_only"] == {}
    # streamed: rank 0 holds the result and the tensor being gathered, rank 1 only the tensor being gathered
    # (GATHERING: the gather's buffers), never the whole model and optimizer state
    result = sum(v.numel() * v.element_size() for v in model_got.values())
    result += sum(v.numel() * v.element_size() for s in optim_got["state"].values() for v in s.values())
    assert rank0["host_peak"] <= result + GATHERING * rank0["largest"] + SLACK, (rank0["host_peak"], result)
    assert rank1["host_peak"] <= GATHERING * rank1["largest"] + SLACK < result / 2, (rank1["host_peak"], result)
