"""The optimizer update on the host (``Config.offload_update="host"``, issue 43): the master parameters and the
optimizer states live in host memory, the ``host_update`` pass places the update there and the host runs it on a
thread of its own, in partitions started as the gradients arrive.

On a CPU machine ``"host"`` runs that machinery on CPU tensors (the copies are copies), so the update must equal
the update in the graph bit for bit, at stages 1-3 on 2 ranks, with bf16 parameters and fp32 master weights,
clipping and fp16 loss scaling with a step that overflows (and is skipped); ``offload_overlap="one_step"`` must
equal eager PyTorch applying each step's gradients one step late. (Stage 0 refuses offload: DeepSpeed's rule,
``tests/test_offload.py``.) What crosses between a device and the host, and reading the state where it lives, are
checked on the stand-in device (``tests/test_device_path.py``).
"""

from __future__ import annotations

import pytest
import torch
from host_update_cases import FUSED, PARITY, batches, delayed_eager, eager, model, plain_step, same, train

import zgraph
from zgraph.runtime.host_state import host_parameters
from zgraph.runtime.offload_store import OffloadError
from zgraph.runtime.state import Binding


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("host_update") / "results.pt"
    run_ranks(2, "host_update_cases.run", str(path), ["parity", "fused", "late"], timeout=600)
    results = torch.load(path, weights_only=False)
    for name in ("parity", "fused", "late"):
        assert "error" not in results[name], results[name].get("error")
    return results


@pytest.mark.parametrize("name", list(PARITY))
def test_the_update_on_the_host_equals_the_update_in_the_graph_on_two_ranks(two_ranks, name):
    """Losses, whole parameters and optimizer states after 3 steps of an ``AdamW(fused=False)``: bitwise those of
    the update in the graph (``offload_update="device"``, on a CPU machine the step without offload), op by op, in
    the layout the host's runs (stages 1 and 2 on several ranks: stage 3's, ``zgraph.binding.host_layout``); and
    within torch's own fused-vs-for-loop distance of the update in the graph at the stage asked for (there the
    global norm sums whole gradients, not shards)."""
    runs = two_ranks["parity"][name]
    device, host = runs.get("layout", runs["device"]), runs["host"]
    assert 'offload_update="host"' in host["explain"] and 'offload_update="host"' not in device["explain"]
    for part in ("losses", "params", "optim"):
        assert same(host[part], device[part]), part
        close(host[part], runs["device"][part])
    assert ("runs stage 3's layout" in host["explain"]) == ("layout" in runs)


@pytest.mark.parametrize("name", list(FUSED))
def test_the_fused_update_on_the_host_is_within_torchs_fused_distance_on_two_ranks(two_ranks, name):
    """An ``AdamW()`` (fused not refused) on the host runs torch's fused CPU kernel: within the distance torch's
    own tests accept between fused and for-loop AdamW (float32: rtol 1.3e-6, atol 1e-5) of the update in the graph,
    op by op — clipping, bf16 parameters with fp32 master weights, fp16 loss scaling skipping a step."""
    device, host = two_ranks["fused"][name]["device"], two_ranks["fused"][name]["host"]
    assert "6 of them updated by torch's fused CPU Adam/AdamW kernel" in host["explain"]
    for part in ("losses", "params", "optim"):
        close(host[part], device[part])


def close(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            close(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b, strict=True):
            close(x, y)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a.float(), b.float(), rtol=1.3e-6, atol=1e-5, equal_nan=True)
    else:
        assert a == b


def test_the_fused_update_on_the_host_is_eager_fused_adamw_on_one_process():
    """Torch's fused kernel on the host: bitwise eager ``AdamW(fused=True)`` on the CPU, whether the optimizer says
    ``fused=True`` or nothing; ``fused=False`` keeps the for-loop step, bitwise eager's."""
    for flag in (None, True):
        got = train({"stage": 1, "offload_optimizer": "cpu", "offload_update": "host"}, fused=flag)
        want = eager(fused=True)
        assert all(same(got[k], want[k]) for k in ("losses", "params", "optim")), flag
    got, want = train({"stage": 1, "offload_optimizer": "cpu", "offload_update": "host"}), eager(fused=False)
    assert all(same(got[k], want[k]) for k in ("losses", "params", "optim"))
    assert "0 of them updated by torch's fused" in got["explain"]


def test_the_update_on_the_host_on_one_process():
    """One process (no process group: nothing sharded): bitwise the update in the graph, and the state in host
    memory (on a CPU machine: where it was)."""
    got, want = (train({"stage": 1, "offload_optimizer": "cpu", "offload_update": u}) for u in ("host", "device"))
    assert same(got["losses"], want["losses"]) and same(got["params"], want["params"])
    assert same(got["optim"], want["optim"])


def test_one_step_late_equals_eager_applying_each_step_one_step_late():
    """``offload_overlap="one_step"``: each step computes with the parameters from before the previous step's
    update, which the host applies during it; a read of the state after the steps (here ``full_state_dict``)
    applies the last one. Bitwise eager PyTorch's AdamW on the CPU doing the same."""
    config = dict(offload_optimizer="cpu", offload_update="host", offload_overlap="one_step")
    got, want = train({"stage": 1, **config}), delayed_eager()
    assert same(got["losses"], want["losses"]) and same(got["params"], want["params"])
    assert same(got["optim"], want["optim"])
    assert 'offload_overlap="one_step"' in got["explain"]


def test_one_step_late_at_stage_2_on_two_ranks_equals_eager_one_step_late(two_ranks):
    """Stage 2 on several ranks runs stage 3's layout with the update on the host, so ``offload_overlap="one_step"``
    is honoured there too (it was refused: the updated shards were all-gathered within the step): eager PyTorch on
    the whole batch applying each step's gradients one step late, within the distance of two ranks' averaged
    gradients."""
    got, want = two_ranks["late"], delayed_eager(world=2)
    assert "runs stage 3's layout" in got["explain"] and 'offload_overlap="one_step"' in got["explain"]
    for part in ("params", "optim"):  # (each rank's losses are its own rows', as DDP's)
        close(got[part], want[part])


def test_stage_1_or_2_with_the_update_on_the_host_is_estimated_in_the_layout_it_runs():
    """``step.estimate`` for a GPU at stage 1 or 2 on several ranks (the update on the host): stage 3's layout,
    gathered once per step (``zgraph.binding.host_layout``), as the step runs it."""
    x, y = batches()[0]
    estimates = []
    for options in ({"stage": 1}, {"stage": 2}, {"stage": 3, "max_reuse_distance": 10**9}):
        net = model()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        config = zgraph.Config(backend="eager", offload_optimizer="cpu", param_persistence_threshold=0, **options)
        e = zgraph.distribute(config)(plain_step).estimate(net, opt, x, y, world_size=4, device="cuda")
        estimates.append((e.model_state_bytes, e.peak_bytes, e.comm_bytes))
    assert estimates[0] == estimates[1] == estimates[2]


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(stage=1, offload_update="host"), 'offload_update="host" needs offload_optimizer="cpu"'),
        (
            dict(stage=1, offload_optimizer="nvme", offload_dir=".", offload_update="host"),
            'needs offload_optimizer="cpu"',
        ),
        (dict(stage=1, offload_optimizer="cpu", offload_update="host", offload_fraction=0.5), "offload_fraction=1.0"),
        (dict(stage=1, offload_optimizer="cpu", offload_update="gpu"), "offload_update must be one of"),
        (dict(stage=1, offload_optimizer="cpu", offload_overlap="two_steps"), "offload_overlap must be one of"),
        (dict(stage=1, offload_optimizer="cpu", offload_update="device", offload_overlap="one_step"), "on the host"),
    ],
)
def test_config_refuses_what_the_update_on_the_host_cannot_do(options, message):
    with pytest.raises(ValueError, match=message):
        zgraph.Config(**options)


def _refused(optimizer: type, options: dict, step=plain_step) -> str:
    """The error of a first call with ``options`` (the model and optimizer unchanged, checked)."""
    net = model()
    opt = optimizer(net.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    config = zgraph.Config(backend="eager", offload_optimizer="cpu", **options)
    args = (net, *batches()[0]) if step.__name__ == "forward_backward" else (net, opt, *batches()[0])
    with pytest.raises(OffloadError) as error:
        zgraph.distribute(config)(step)(*args)
    assert not opt.state and all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
    return str(error.value)


def test_an_optimizer_the_host_cannot_run_is_refused_when_asked_for():
    message = _refused(torch.optim.RMSprop, dict(stage=1, offload_update="host"))
    assert "update rules for (SGD, Adam, AdamW), not opt (RMSprop)" in message and 'offload_update="device"' in message


def test_one_step_late_needs_the_update_in_the_step_and_on_the_host():
    def forward_backward(net, x, y):
        torch.nn.functional.cross_entropy(net(x), y).backward()

    def forward_backward_with(net, opt, x, y):  # the optimizer bound, not stepped
        torch.nn.functional.cross_entropy(net(x), y).backward()

    late = dict(stage=1, offload_update="host", offload_overlap="one_step")
    assert "this one has no optimizer (split mode's forward step" in _refused(torch.optim.AdamW, late, forward_backward)
    assert "this one steps no optimizer" in _refused(torch.optim.AdamW, late, forward_backward_with)
    message = _refused(torch.optim.AdamW, dict(stage=1, offload_overlap="one_step"))  # "auto" on a CPU machine
    assert "no update runs on the host here" in message


def test_auto_falls_back_to_the_device_for_an_optimizer_the_host_cannot_run():
    """With the model on a device, ``"auto"`` keeps the update there for an optimizer without an update rule,
    and says why (``explain()``); ``"host"`` refuses it."""
    net = model()
    binding = Binding([("model", net)], [("opt", torch.optim.RMSprop(net.parameters()))])
    config = zgraph.Config(stage=1, offload_optimizer="cpu")
    host, why = host_parameters(config, binding, torch.device("cuda", 0), lambda o: type(o) is torch.optim.AdamW)
    assert host == frozenset() and "not opt (RMSprop): their states are brought to the device" in why
    with pytest.raises(OffloadError, match="RMSprop"):
        host_parameters(config.replace(offload_update="host"), binding, torch.device("cuda", 0), lambda o: False)
