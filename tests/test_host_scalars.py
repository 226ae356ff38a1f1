"""Numbers a step reads from a module's 0-d integer buffer (a host counter), issue 40: the host knows them before each
call (``zgraph.capture.host_scalars``), so they are symbols of the captured step, not constants of one capture.

BatchNorm with ``momentum=None`` averages its running statistics with ``1 / float(num_batches_tracked)``, a number
that changes on every call: it trains bitwise as eager PyTorch does, with one capture for training (and one for
evaluation) however many calls are made. A step's own ``.item()`` of a counter, used in arithmetic, stays symbolic:
one capture. A step's own ``int(n)`` is a plain Python number (Python's ``int()`` returns one), fixed where the step
was captured and guarded: the values stay eager's, and a new value captures the step again.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zgraph

CALLS = 4


def _batch_norm_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4, momentum=None),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16, 8),
        nn.BatchNorm1d(8, momentum=None),
        nn.BatchNorm1d(8),  # the default momentum, beside them
        nn.Linear(8, 2),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("stage", [0, 3])
def test_batch_norm_with_a_cumulative_average_equals_eager_bitwise_in_one_capture(stage):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 3, 4, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(CALLS)]
    step = zgraph.distribute(zgraph.Config(stage=stage, backend="eager"))(_train)
    model, opt = _batch_norm_model()
    got = [step(model, opt, x, y) for x, y in batches]
    reference, reference_opt = _batch_norm_model()
    want = [_train(reference, reference_opt, x, y) for x, y in batches]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert step._dispatch.variants() == 1, "1 / num_batches_tracked is a symbol: no capture per call"
    model.eval()
    reference.eval()
    assert torch.equal(step(model, opt, *batches[0]), _train(reference, reference_opt, *batches[0]))
    state, expected = zgraph.full_state_dict(model), reference.state_dict()
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    assert model[1].num_batches_tracked.item() == CALLS and step._dispatch.variants() == 2


class Counted(nn.Module):
    """Counts its calls in a 0-d integer buffer and scales its output by ``1 / (calls + 1)``, the count read with
    ``read``."""

    def __init__(self, read):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.register_buffer("calls", torch.tensor(0))
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) * (1.0 / (self.read(self.calls) + 1))


def _item(t: torch.Tensor) -> int:
    return t.item()


@pytest.mark.parametrize(("read", "captures"), [(_item, 1), (int, CALLS)], ids=["item", "int"])
def test_a_counter_read_in_arithmetic(read, captures):
    """``.item()`` is a symbol (one capture); ``int()`` a number, captured again for each new value."""

    def make():
        torch.manual_seed(0)
        model = Counted(read)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def train(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    x = torch.randn(3, 4)
    step = zgraph.distribute(zgraph.Config(backend="eager"))(train)
    model, opt = make()
    got = [step(model, opt, x) for _ in range(CALLS)]
    reference = make()
    want = [train(*reference, x) for _ in range(CALLS)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference[0].state_dict().values()))
    assert model.calls.item() == CALLS and step._dispatch.variants() == captures
