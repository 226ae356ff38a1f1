"""A first call creates the optimizer state torch.optim's first step creates, guessed before the trace so that the
step is traced once; where the guess is wrong (a parameter gets no gradient) its state is removed again and the
step traced once more; where the trace fails, all the guessed state is removed: the optimizer ends as eager
PyTorch leaves it."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from parity import WithUnused, square_step

import zgraph


def _count_traces(monkeypatch) -> list:
    module = importlib.import_module("zgraph.capture.protocol")
    traces: list = []
    trace_step = module.trace_step
    monkeypatch.setattr(module, "trace_step", lambda *a, **k: traces.append(1) or trace_step(*a, **k))
    return traces


@pytest.mark.parametrize("unused", [False, True])
@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_first_call_state_equals_eager_and_one_trace_suffices(monkeypatch, unused, optimizer):
    traces = _count_traces(monkeypatch)
    model = WithUnused() if unused else torch.nn.Sequential(torch.nn.Linear(8, 8))
    eager_model = copy.deepcopy(model)
    kw = {"lr": 0.1, "momentum": 0.9} if optimizer is torch.optim.SGD else {"lr": 0.1}
    opt, eager_opt = optimizer(model.parameters(), **kw), optimizer(eager_model.parameters(), **kw)
    step = zgraph.distribute(stage=0, backend="eager")(square_step)
    for i in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        assert torch.equal(step(model, opt, x), square_step(eager_model, eager_opt, x))
    if optimizer is torch.optim.SGD:  # its momentum buffer is the first gradient, made in the first call's graph:
        assert len(traces) == 2  # an input from the second call on, which is traced again
    else:  # guessed; or guessed, then again without the state of the parameter that got no gradient
        assert len(traces) == (2 if unused else 1)
    got, want = opt.state_dict(), eager_opt.state_dict()
    assert got["state"].keys() == want["state"].keys()
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), (index, key)
    for p, q in zip(model.parameters(), eager_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_failing_first_trace_leaves_no_guessed_state():
    def failing(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        raise ValueError("the user's own error")

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    step = zgraph.distribute(stage=0, backend="eager")(failing)
    with pytest.raises(Exception, match="the user's own error"):
        step(model, opt, torch.randn(4, 8))
    assert not opt.state


def test_the_collector_is_paused_while_a_step_is_built_and_restored_after(monkeypatch):
    """Capture and the passes run with Python's cyclic collector paused (a full collection would walk every fake
    tensor and node again); it is on again after the call, after a failed capture too."""
    import gc

    import zgraph.capture.protocol as protocol

    seen = []
    trace_step = protocol.trace_step
    monkeypatch.setattr(protocol, "trace_step", lambda *a, **k: seen.append(gc.isenabled()) or trace_step(*a, **k))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zgraph.distribute(stage=0, backend="eager")(square_step)
    step(model, opt, torch.randn(4, 8))
    assert seen and not any(seen) and gc.isenabled()

    def branches(model, x):
        return model(x).sum() if model(x).sum() > 0 else None  # a branch on a value only the run knows

    with pytest.raises(zgraph.CaptureError):
        zgraph.distribute(stage=0, backend="eager")(branches)(model, torch.randn(4, 8))
    assert gc.isenabled()


def test_what_is_made_while_the_collector_is_paused_goes_to_the_oldest_generation():
    """The young generations' collections do not walk a step's graphs after it is built (they live as long as the
    step); nothing stays frozen, and what the program froze itself stays frozen."""
    import gc

    from zgraph.compile.build import collector_paused

    with collector_paused():
        made = [[] for _ in range(3)]
    assert any(o is made for o in gc.get_objects(generation=2)) and gc.get_freeze_count() == 0
    gc.freeze()
    gc.disable()  # no collection moves ``young`` before it is looked for
    try:
        frozen = gc.get_freeze_count()
        with collector_paused():
            young = [[]]
        assert gc.get_freeze_count() == frozen and any(o is young for o in gc.get_objects(generation=0))
    finally:
        gc.unfreeze()
        gc.enable()
