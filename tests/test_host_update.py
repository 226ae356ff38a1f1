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
from host_update_cases import PARITY, batches, delayed_eager, model, plain_step, same, train

import zgraph
from zgraph.runtime.host_state import host_parameters
from zgraph.runtime.offload_store import OffloadError
from zgraph.runtime.state import Binding


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("host_update") / "results.pt"
    run_ranks(2, "host_update_cases.run", str(path), ["parity"], timeout=600)
    results = torch.load(path, weights_only=False)["parity"]
    assert "error" not in results, results.get("error")
    return results


@pytest.mark.parametrize("name", list(PARITY))
def test_the_update_on_the_host_equals_the_update_in_the_graph_on_two_ranks(two_ranks, name):
    """Losses, whole parameters and optimizer states after 3 AdamW steps: bitwise those of the update in the graph
    (``offload_update="device"``, on a CPU machine the step without offload)."""
    device, host = two_ranks[name]["device"], two_ranks[name]["host"]
    assert 'offload_update="host"' in host["explain"] and 'offload_update="host"' not in device["explain"]
    for part in ("losses", "params", "optim"):
        assert same(host[part], device[part]), part


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
