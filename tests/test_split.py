"""Split mode (backward outside the step): every backward form against eager PyTorch on the global batch at ZeRO
stages 0-3 and worlds 1, 2, 4 (see ``split_cases``), bad input, and inspection."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from dist_harness import run_ranks
from split_cases import CASES, reference

STAGES = [0, 1, 2, 3]
WORLDS = [1, 2, pytest.param(4, marks=pytest.mark.extended)]  # 4 ranks: outside the README's suite, in .ci/run
REL = 1e-5  # fp32, a handful of reductions in another order (the ranks' average vs one batch)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            path = tmp_path_factory.mktemp(f"split{world}") / "results.pt"
            run_ranks(world, "split_cases.run_split_cases", str(path), STAGES, list(CASES), timeout=600)
            cache[world] = torch.load(path, weights_only=False)
        return cache[world]

    return get


@functools.cache
def _reference(name: str, world: int) -> dict:
    return reference(name, world)


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", list(CASES))
def test_split_backward_matches_eager(results, world, stage, name):
    got = results(world)[(stage, name)]
    want = _reference(name, world)
    assert set(got) == set(want)
    for key, value in want.items():
        if value is None:
            assert got[key] is None, key
            continue
        assert got[key] is not None, key
        assert got[key].shape == value.shape, key
        assert _rel(got[key], value) <= REL, f"{name} stage {stage} world {world}: {key}"


@pytest.mark.parametrize("world", WORLDS[1:])  # 4 ranks with the matrix they run in (extended)
def test_stage3_backward_keeps_shards_not_whole_parameters(results, world):
    """The backward gathers the parameters again (recomputed from the shards) instead of keeping the forward's
    whole copies alive between the two calls."""
    whole_weights = {(5, 4), (3, 5)}  # the encoder's weights, whole
    saved = results(world)[(3, "saved shapes")]
    assert saved and not whole_weights & set(saved), saved
    assert whole_weights & set(results(world)[(0, "saved shapes")])  # stage 0 keeps them (they are the params)


# ------------------------------------------------------------------------------------- one process, no spawn
def _encoder(stage: int = 0):
    import zgraph

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    @zgraph.distribute(stage=stage, backend="eager")  # the memory test counts the eager backend's tensors
    def encode(m, x):
        return m(x)

    return model, encode


def test_backward_twice_raises_pytorch_error():
    model, encode = _encoder()
    out = encode(model, torch.randn(5, 4))
    out.backward(torch.ones(5, 3))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.backward(torch.ones(5, 3))


def test_wrong_gradient_shape_raises_as_eager():
    model, encode = _encoder()
    out = encode(model, torch.randn(5, 4))
    eager = model(torch.randn(5, 4))
    with pytest.raises(RuntimeError, match="Mismatch in shape") as want:
        eager.backward(torch.ones(5, 4))
    with pytest.raises(RuntimeError, match="Mismatch in shape") as got:
        out.backward(torch.ones(5, 4))
    assert str(got.value).replace("SplitFunction", "").split(":")[0] == str(want.value).split(":")[0]


def test_backward_after_parameters_changed_names_the_step():
    from zgraph.errors import ZGraphError

    model, encode = _encoder()
    out = encode(model, torch.randn(5, 4))
    model[0].weight = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ZGraphError, match="encode"):
        out.backward(torch.ones(5, 3))


def test_saved_activations_freed_after_backward_or_drop():
    from zgraph.runtime.memory import LiveTensorBytes

    model, encode = _encoder()
    x = torch.randn(256, 4)
    encode(model, x).backward(torch.ones(256, 3))  # compiled outside the measurement
    for finish in ("backward", "drop"):
        with LiveTensorBytes() as live:
            out = encode(model, x)
            held = live.current
            if finish == "backward":
                out.backward(torch.ones(256, 3))
                del out
            else:
                del out
            after = live.current
        activations = 256 * 16 * 4  # the tanh output the backward reads
        assert held >= activations, (finish, held)
        assert after < activations, (finish, after)


def test_graphs_and_explain_show_forward_and_backward(tmp_path):
    model, encode = _encoder()
    encode(model, torch.randn(5, 4)).backward(torch.ones(5, 3))
    graphs = encode.graphs
    assert "forward" in graphs and "backward" in graphs
    backward_inputs = [n.name for n in graphs["backward"].graph.nodes if n.op == "placeholder"]
    assert any(name.startswith("tangents_") for name in backward_inputs)
    text = encode.explain()
    assert "forward (eager)" in text and "backward (eager)" in text
    names = [p.rsplit("/", 1)[-1] for p in encode.dump(tmp_path)]
    assert any("forward" in n for n in names) and any("backward" in n for n in names)


def test_step_that_backpropagates_itself_is_not_split():
    import zgraph

    model, _ = _encoder()

    @zgraph.distribute(backend="eager")  # whether a step is split is decided at capture, for any backend
    def train(m, x):
        loss = m(x).sum()
        loss.backward()
        return loss

    loss = train(model, torch.randn(5, 4))
    assert "backward" not in train.graphs
    assert model[0].weight.grad is not None
    assert loss.grad_fn is None


def test_gradient_flows_upstream_through_a_step_input():
    model, encode = _encoder(stage=2)
    eager_model = __import__("copy").deepcopy(model)
    leaf = torch.randn(5, 4, requires_grad=True)
    g = torch.randn(5, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = encode(model, leaf * 2)  # a non-leaf input: its gradient flows on to `leaf`
    # zgraph reads no .grad of a non-leaf (torch warns when one is read)
    assert not [w for w in caught if ".grad attribute" in str(w.message)]
    out.backward(g)
    eager_leaf = leaf.detach().clone().requires_grad_()
    eager_model(eager_leaf * 2).backward(g)
    torch.testing.assert_close(leaf.grad, eager_leaf.grad)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_another_step_on_the_same_model_between_forward_and_backward():
    import zgraph

    model, encode = _encoder()
    eager_model = __import__("copy").deepcopy(model)
    x, g = torch.randn(5, 4), torch.randn(5, 3)

    @zgraph.distribute(backend="eager")
    def train(m, x):
        m(x).sum().backward()

    out = encode(model, x)
    train(model, x)  # binds the same model again: the split backward still applies
    out.backward(g)
    eager_model(x).sum().backward()
    eager_model(x).backward(g)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
