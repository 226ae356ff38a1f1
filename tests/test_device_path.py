"""The CUDA/NCCL path, checked on a machine without a GPU.

The rules themselves (which backend serves which device, where control traffic goes, what a model spread over
devices or an offload tier the device lacks gets) are tested directly; the runtime as a whole runs on the stand-in
accelerator of ``tests/standin.py`` (state on the meta device, a backend that serves only it, as NCCL serves only
CUDA, and an audit of host/device mixing and device-to-host reads), on 2 spawned ranks.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from standin_cases import config_of, model_on, plain_step

import zgraph
from zgraph.runtime import cost_model, devices
from zgraph.runtime.devices import DeviceError
from zgraph.runtime.offload import OffloadError, check_offload_device
from zgraph.runtime.process_group import duplicate_devices

ALLOWED_READS = {
    "graph fingerprints",
    "the loss-scale overflow flag",
    "offload: a state's first copy to host memory",
    "offload: a write-back to host memory",
    "host update: state moved to host memory",
    "host update: a value copied to the host",
}


# ------------------------------------------------------------------------------------------ the rules
def test_backend_strings_are_read_per_device():
    assert devices.backend_devices("nccl") == {"cuda": "nccl"}
    assert devices.backend_devices("gloo")["cpu"] == "gloo"
    assert devices.backend_devices("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert devices.served_backend("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert devices.served_backend("nccl", "cpu") is None


def test_a_cpu_model_gets_gloo_where_cuda_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert devices.default_backend(torch.device("cpu")) == "gloo"
    assert devices.default_backend(torch.device("cuda", 1)) == "nccl"
    with pytest.raises(DeviceError, match="Initialise torch.distributed yourself"):
        devices.default_backend(torch.device("meta"))


def test_control_traffic_goes_where_the_backend_serves_it():
    assert devices.control_device("gloo", torch.device("cpu")) == torch.device("cpu")
    assert devices.control_device("cpu:gloo,cuda:nccl", torch.device("cuda", 3)) == torch.device("cpu")
    assert devices.control_device("nccl", torch.device("cuda", 3)) == torch.device("cuda", 3)


def test_a_backend_that_cannot_serve_the_model_is_refused_with_what_to_change():
    with pytest.raises(DeviceError, match=r"model is on cpu.*'nccl' serves cuda \(nccl\).*gloo"):
        devices.check_served("nccl", torch.device("cpu"))
    devices.check_served("cpu:gloo,cuda:nccl", torch.device("cpu"))


def test_ranks_sharing_one_gpu_are_found():
    assert duplicate_devices(["a GPU-0", "a GPU-1", "b GPU-0"]) == []
    assert duplicate_devices(["a GPU-0", "a GPU-0", "a GPU-1", "a GPU-1"]) == [(0, 1), (2, 3)]


def test_a_model_spread_over_devices_is_refused():
    """Two devices are refused (here the stand-in accelerator's, where meta is a device, beside the host: the
    step checks this first, before anything changes)."""
    tensors = [torch.zeros(2), torch.zeros(2, device="meta")]
    with pytest.raises(DeviceError, match="several devices .*cpu and meta"):
        devices.state_device(tensors, meta_is_device=True)


def test_a_layer_left_on_meta_is_made_real_beside_the_others():
    """Without a stand-in accelerator, meta means not yet made real (issue 27): a layer on meta beside host
    layers is initialised by its own ``reset_parameters`` on the host, the other layers keep their values."""
    model = model_on("cpu")
    model[4].to("meta")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = zgraph.distribute(config_of({"stage": 3}))(plain_step)
    before = {k: v.clone() for k, v in model.state_dict().items() if v.device.type == "cpu"}
    step(model, opt, torch.randn(4, 16), torch.zeros(4, dtype=torch.long))
    assert all(p.device.type == "cpu" for p in model.parameters())
    zgraph.materialize(model)  # nothing left to make real: the values stay
    assert set(before) < set(model.state_dict())


def test_nvme_offload_of_device_state_is_refused(tmp_path):
    """The rule the binding checks before it changes anything (``zgraph.binding.setup.lay_out``), here for the
    stand-in accelerator's device (a step on a meta model in one process now makes the model real instead)."""
    config = config_of(
        {"stage": 1, "offload_optimizer": "nvme", "offload_dir": str(tmp_path), "master_dtype": "torch.bfloat16"}
    )
    with pytest.raises(OffloadError, match='"nvme" with the model on meta is not implemented.*use "cpu"'):
        check_offload_device(config, torch.device("meta"))


def test_cost_model_times_until_the_device_is_done(monkeypatch):
    synced = []
    monkeypatch.setattr(cost_model, "synchronize", lambda device: synced.append(device))
    cost_model._fastest(lambda: None, torch.device("cuda", 0), repeats=2)
    assert synced == [torch.device("cuda", 0)] * 4  # before and after each timed call


def test_cost_model_cache_is_keyed_by_device_and_the_backend_serving_it():
    paths = {cost_model._cache_path(b, d, 4) for b, d in [("gloo", "cpu"), ("nccl", "cuda"), ("gloo", "cuda")]}
    assert len(paths) == 3
    model = cost_model.fit_cost_model(
        zgraph.runtime.process_group.ProcessGroupInfo(0, 2, "g", "cpu:gloo,cuda:nccl"), torch.device("cuda"), False
    )
    assert model.collectives == cost_model.analytical_cost_model("nccl").collectives


def test_cuda_autocast_is_part_of_the_guard_key():
    model = model_on("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = zgraph.distribute(config_of({}))(plain_step)
    x, y = torch.randn(4, 16), torch.zeros(4, dtype=torch.long)
    step(model, opt, x, y)
    torch.set_autocast_enabled("cuda", True)  # what torch.autocast("cuda") does on a machine with CUDA
    try:
        step(model, opt, x, y)
    finally:
        torch.set_autocast_enabled("cuda", False)
    assert len(step._dispatch.cache) == 2


# --------------------------------------------------------------------------- the runtime on the stand-in
RUNS = {
    "stage 0": {"options": {"stage": 0}},
    "stage 1": {"options": {"stage": 1}},
    "stage 2, fp16 dynamic loss scaling, clipping": {
        "options": {"stage": 2, "param_dtype": "torch.float16", "loss_scale": "dynamic", "max_grad_norm": 1.0}
    },
    "stage 3, bf16 compute and master": {
        "options": {"stage": 3, "param_dtype": "torch.bfloat16", "master_dtype": "torch.bfloat16"}
    },
    "stage 1, optimizer offloaded to host memory": {
        "options": {"stage": 1, "offload_optimizer": "cpu", "offload_update": "device"}
    },
    "stage 3, parameters and optimizer offloaded, fp16": {
        "options": {
            "stage": 3,
            "offload_optimizer": "cpu",
            "offload_params": "cpu",
            "param_dtype": "torch.float16",
            "loss_scale": "dynamic",
            "offload_update": "device",
        }
    },
    "stage 3, update on the host, bf16": {
        "options": {"stage": 3, "offload_optimizer": "cpu", "param_dtype": "torch.bfloat16"},
        "checkpoint": True,
    },
    "stage 3, update on the host, fp32": {"options": {"stage": 3, "offload_optimizer": "cpu"}},
    "stage 2, update on the host, fp16 loss scaling, clipping": {
        "options": {
            "stage": 2,
            "offload_optimizer": "cpu",
            "param_dtype": "torch.float16",
            "loss_scale": "dynamic",
            "max_grad_norm": 1.0,
        }
    },
    "stage 3, update on the host one step late, parameters offloaded": {
        "options": {
            "stage": 3,
            "offload_optimizer": "cpu",
            "offload_params": "cpu",
            "param_dtype": "torch.bfloat16",
            "offload_overlap": "one_step",
        }
    },
    "stage 3, split backward": {"options": {"stage": 3}, "split": True},
    "stage 1, update on the host one step late, bf16": {
        "options": {
            "stage": 1,
            "offload_optimizer": "cpu",
            "param_dtype": "torch.bfloat16",
            "offload_overlap": "one_step",
        }
    },
}


@pytest.fixture(scope="module")
def standin_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("standin") / "runs.json")
    run_ranks(2, "standin_cases.cases", out, list(RUNS.values()), init_group="standin", timeout=600)
    with open(out) as f:
        return dict(zip(RUNS, json.load(f)))


@pytest.mark.parametrize("name", list(RUNS))
def test_the_runtime_runs_on_a_device_only_backend(standin_runs, name):
    """Binding, the initial broadcast, fingerprints, executor, loss scaling, clipping, offload and split mode on
    a backend that serves only the device: no host tensor crosses a collective, no op mixes host and device
    tensors, nothing is read on the host but what zgraph reads on purpose, and state stays where it belongs."""
    seen = standin_runs[name]
    assert "error" not in seen, seen.get("error")
    where = ["cpu"] if "on the host" in name else ["meta"]  # the update on the host keeps them in host memory
    assert seen["param_devices"] == where and seen["state_devices"] == where
    assert seen["step_devices"] == ["cpu"]  # torch.optim keeps `step` on the host
    assert seen["variants"] == 1  # no retrace: every input is where the graph was compiled for
    assert set(seen["reads"]) <= ALLOWED_READS and "graph fingerprints" in seen["reads"]
    assert seen["graph_host_reads"] == []  # the graph audit
    scaling = "loss_scale" in RUNS[name]["options"]
    assert seen["loss_scale_devices"] == (["meta"] if scaling else [])
    assert bool(seen["flag_to_host"]) == scaling  # the one documented host read, only with loss scaling
    if "offload" in name and "on the host" not in name:
        assert "host memory (copied synchronously, for state on meta)" in seen["explain"]
    if "on the host" in name:
        assert 'offload_update="host": the master values and optimizer states of 6 parameters' in seen["explain"]


# each rank's shard of the stand-in model's parameters at stage 3 on 2 ranks (every tensor cut in halves): the
# Linear layers' elements, the LayerNorm's (which the forward reads in fp32, as zgraph.config.NORM_MODULES says)
LINEAR_SHARD, NORM_SHARD = (64 * 16 + 64 + 8 * 64 + 8) // 2, 2 * 64 // 2


@pytest.mark.parametrize(
    ("name", "dtype_bytes", "scalars"),
    [
        ("stage 3, update on the host, bf16", 2, 0),
        ("stage 3, update on the host, fp32", 4, 0),
        ("stage 2, update on the host, fp16 loss scaling, clipping", 2, 32),
        ("stage 1, update on the host one step late, bf16", 2, 0),
    ],
)
def test_the_update_on_the_host_copies_the_compute_dtype_only(standin_runs, name, dtype_bytes, scalars):
    """Issue 43: a step of the update on the host copies each gradient shard to the host once, in the reduce dtype,
    and each parameter shard to the device once, in the dtype the forward reads (the LayerNorm's in fp32): 4.1
    bytes per parameter for bf16 (4 with no norm layer), 8 for fp32 — where the states brought to the device for
    the update and back copy 16 (AdamW's two fp32 states each way; more with parameter shards offloaded too).
    Stages 1 and 2 on several ranks copy what stage 3 does (they run its layout, ``zgraph.binding.host_layout``;
    they copied 18.3 bytes per shard element, the whole fp32 master all-gathered through the device); loss scaling
    and clipping add ``scalars`` bytes at most (0-d values: the overflow flag, the clipping coefficient)."""
    fingerprints = standin_runs["stage 0"]["moved"]  # what every step reads on the host (the graph's fingerprint)
    step, today = (
        {k: v - fingerprints[k] for k, v in standin_runs[run]["moved"].items()}
        for run in (name, "stage 1, optimizer offloaded to host memory")
    )
    shard = LINEAR_SHARD + NORM_SHARD
    assert shard * dtype_bytes <= step["to_host"] <= shard * dtype_bytes + scalars
    assert step["to_device"] == LINEAR_SHARD * dtype_bytes + NORM_SHARD * 4
    assert (step["to_host"] + step["to_device"]) / shard <= 2.1 * dtype_bytes
    assert (today["to_host"] + today["to_device"]) / shard == 16
    assert ("runs stage 3's layout" in standin_runs[name]["explain"]) == (RUNS[name]["options"]["stage"] < 3)


def test_host_resident_state_is_read_without_the_device(standin_runs):
    """``optimizer.state_dict()``, ``zgraph.save`` and ``zgraph.load`` read and write the states and parameters
    where they live, in host memory (the states never need to fit on the device); ``full_state_dict`` gathers each
    sharded tensor through the device, one at a time, to the host."""
    reads = standin_runs["stage 3, update on the host, bf16"]["state_reads"]
    assert reads["state_dict_devices"] == ["cpu"] and reads["full_state_dict_devices"] == ["cpu"]
    assert reads["moved_by_state_dict_save_load"] == {"to_host": 0, "to_device": 0}
    shards = (LINEAR_SHARD + NORM_SHARD) * 4 * 3  # fp32 parameters and AdamW's two states: a shard of each
    assert reads["moved_by_full_state_dict"] == {"to_host": 2 * shards, "to_device": shards}


def test_bad_input_on_a_device_only_backend_is_refused_before_anything_changes(tmp_path):
    run_ranks(2, "standin_cases.refusals", str(tmp_path), init_group="standin", timeout=300)
    seen = json.loads((tmp_path / "refusals.json").read_text())
    host = seen["host model on a device-only group"]
    assert "model is on cpu, but the process group's backend 'standin' serves meta" in host["error"], host
    nvme = seen["nvme offload of device state"]
    assert '"nvme" with the model on meta is not implemented' in nvme["error"], nvme
    assert host["unchanged"] and nvme["unchanged"]
    memory = seen["too little host memory for the update on the host"]
    assert "OffloadError" in memory["error"] and "bytes of host memory" in memory["error"], memory
    rmsprop = seen["an optimizer the host cannot run"]
    assert 'offload_update="host"' in rmsprop["error"] and "not opt (RMSprop)" in rmsprop["error"], rmsprop
    assert memory["unchanged"] and rmsprop["unchanged"]
