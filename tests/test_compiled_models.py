"""A model already wrapped by ``torch.compile`` (issue 40, item 2).

``model = torch.compile(model)`` before decorating the step used to fail with torch's own "Detected that you are
using FX to symbolically trace a dynamo-optimized function". zgraph now traces through every ``torch.compile``
wrapper the step reaches (``zgraph.capture.compiled``) — the whole model, ``module.compile()``, a compiled
``forward``, a compiled submodule, a ``@torch.compile`` function — and warns once per capture that the wrapper is
not used (zgraph compiles the whole step). The step equals eager PyTorch on the plain model; the model is left as
it was; ``zgraph.full_state_dict``, ``save``, ``load`` and ``consolidate`` use the keys of ``model.state_dict()``
(``_orig_mod.`` included), as torch does.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from compiled_cases import FORMS, Net, batches, compiled, eager_reference, plain_names, step
from torch._dynamo.eval_frame import OptimizedModule

import zgraph

WARNING = (
    "zgraph: `{}` reaches a torch.compile wrapper (torch.compile(model), module.compile() or a @torch.compile "
    "function): zgraph compiles the whole step, so the torch.compile wrapper is not used; the step was traced "
    "through the module or function it wraps."
)


def _wrappers(model: torch.nn.Module) -> list[tuple[object, str, object, object]]:
    """Each module's own attributes that hold torch.compile wrappers or submodules (what zgraph must leave alone):
    ``(module, name, value, a copy of the submodule dict)``."""
    return [
        (module, name, value, dict(value) if name == "_modules" else None)
        for module in model.modules()
        for name, value in vars(module).items()
        if name in ("forward", "_compiled_call_impl", "_orig_mod", "_modules")
    ]


def _zgraph_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "zgraph" in str(w.message) or "torch.compile" in str(w.message)]


@pytest.mark.parametrize("form", [*FORMS, "plain"])
def test_a_compiled_model_trains_as_eager_and_is_left_as_it_was(form):
    model = Net() if form == "plain" else compiled(form)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    before = _wrappers(model)
    train = zgraph.distribute(zgraph.Config(backend="eager"))(step)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        losses = [train(model, opt, x, y) for x, y in batches()]
    assert _zgraph_warnings(record) == ([] if form == "plain" else [WARNING.format("step")])  # one capture: one warning
    want_losses, want_params = eager_reference()
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses)), (losses, want_losses)
    names = plain_names(model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, want_params[names[key]]), key
    for module, name, value, children in before:
        assert vars(module)[name] is value, (type(module).__name__, name)
        assert children is None or vars(module)[name] == children
    assert torch._dynamo.config.error_on_nested_fx_trace
    assert OptimizedModule.__call__ is not torch.nn.Module.__call__


def test_each_capture_warns_once():
    """A new Python number among the arguments recaptures the step: a second warning, not one per call."""
    model = compiled("optimized_module")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @zgraph.distribute(zgraph.Config(backend="eager"))
    def step(model, opt, x, y, scale):
        loss = F.cross_entropy(model(x), y) * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    (x, y), *_ = batches()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for scale in (1.0, 1.0, 2.0, 2.0):
            step(model, opt, x, y, scale)
    assert _zgraph_warnings(record) == [WARNING.format(step.__qualname__)] * 2


def test_split_mode_through_compile_wrappers_equals_eager():
    """The forward alone in a step (its output's backward outside it): the joint trace goes through the wrappers."""
    model = compiled("all")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    forward = zgraph.distribute(zgraph.Config(backend="eager"))(lambda model, x: model(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, y in batches():
            F.cross_entropy(forward(model, x), y).backward()
            opt.step()
            opt.zero_grad()
    _, want_params = eager_reference()
    names = plain_names(model)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, want_params[names[key]], rtol=1e-6, atol=1e-7, msg=key)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("compiled") / "results.pt"
    run_ranks(2, "compiled_cases.run", str(path), ["stages"], timeout=600)
    results = torch.load(path, weights_only=False)
    assert "error" not in results["stages"], results["stages"].get("error")
    return results["stages"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_model_on_two_ranks_equals_eager_on_the_global_batch(two_ranks, stage):
    """Every wrapping form at once, AdamW, 2 ranks: losses and the whole parameters equal eager's on the global
    batch within round-off (the ranks' mean gradient is summed in another order); ``full_state_dict``'s keys are
    ``model.state_dict()``'s."""
    got = two_ranks[stage]
    want_losses, want_params = eager_reference()
    torch.testing.assert_close(torch.stack(got["losses"]), torch.stack(want_losses), rtol=1e-5, atol=1e-6)
    assert list(got["full"]) == got["keys"]
    assert any(key.startswith("_orig_mod.") for key in got["keys"])
    names = {key: key.replace("_orig_mod.", "") for key in got["keys"]}
    for key, value in got["full"].items():
        torch.testing.assert_close(value, want_params[names[key]], rtol=1e-5, atol=1e-6, msg=key)


def test_checkpoint_of_a_compiled_model_keeps_torch_keys(two_ranks):
    """At stage 3: ``zgraph.save`` then ``zgraph.load`` into a fresh compiled model gives the trained state under
    the same keys; ``zgraph.consolidate`` writes ``model.state_dict()``'s keys (``_orig_mod.`` included)."""
    got = two_ranks[3]
    assert list(got["loaded"]) == got["keys"] == got["consolidated"]
    for key, value in got["full"].items():
        assert torch.equal(got["loaded"][key], value), key
