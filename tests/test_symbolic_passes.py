"""Passes, liveness and estimates on graphs with symbolic sizes (issue 41, items 2 and 3).

A step whose sequence dim is symbolic (``zgraph.mark_dynamic``) runs through every pass a config turns on and
equals, bitwise, the static graphs captured for each size; the passes, lowering and the estimate add no guard on
the sizes (decisions use their hints, ``zgraph.graph.size_hint``); a symbolic size a pass writes into an op's
arguments is computed by the graph (``zgraph.graph.bind_sizes``); liveness gives the peak as a formula in the
symbol, equal to the bytes at every size it is evaluated at.
"""

from __future__ import annotations

import pytest
import torch
from symbolic_pass_cases import CLIP, CONFIG, eager, train_step
from torch.fx.experimental.proxy_tensor import make_fx

import zgraph
from zgraph.binding.arguments import StepCall
from zgraph.demos.models import GPT
from zgraph.graph import PHASE, VAL, fake_mode, insert
from zgraph.inspect.estimate import estimate_sizes, prepare, symbol_sizes
from zgraph.inspect.liveness import liveness
from zgraph.sizes import bind_sizes, size_symbols

aten = torch.ops.aten


def _symbolic_graph() -> torch.fx.GraphModule:
    """``x -> (x * 2).sum(0)`` traced with symbolic sizes, its nodes given a phase."""
    gm = make_fx(lambda x: (x * 2).sum(0), tracing_mode="symbolic")(torch.randn(6, 4))
    for node in gm.graph.nodes:
        node.meta[PHASE] = "forward"
    return gm


def test_bind_sizes_makes_the_graph_compute_a_symbolic_size_a_pass_wrote():
    gm = _symbolic_graph()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    doubled = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    rows = doubled.meta[VAL].shape[0]  # a SymInt: what a pass reads from a fake value
    view = insert(gm, aten.reshape.default, (doubled, [2, rows * 2]), before=out)  # 2 x (rows * 4 / 2)
    out.args = ((out.args[0], view),)
    bind_sizes(gm)
    gm.recompile()
    assert not any(isinstance(a, torch.SymInt) for n in gm.graph.nodes for a in _flat(n.args))
    for rows_now in (3, 7):
        x = torch.randn(rows_now, 4)
        total, reshaped = gm(x)
        assert torch.equal(total, (x * 2).sum(0)) and torch.equal(reshaped, (x * 2).reshape(2, rows_now * 2))


def _flat(args: object) -> list:
    flat: list = []
    torch.fx.node.map_aggregate(args, lambda a: flat.append(a))
    return flat


def test_liveness_of_a_symbolic_graph_is_a_formula_in_its_size():
    gm = _symbolic_graph()
    symbol = next(name for name, (_, dim) in size_symbols(gm).items() if dim == 0)
    for rows in (3, 50):
        live = liveness(gm, sizes={symbol: rows})
        static = liveness(make_fx(lambda x: (x * 2).sum(0))(torch.randn(rows, 4)))
        assert live.peak_bytes == static.peak_bytes and live.sizes[symbol] == rows
        assert (
            live.peak_formula.subs({s: live.sizes[str(s)] for s in live.peak_formula.free_symbols}) == live.peak_bytes
        )
    assert liveness(gm).sizes[symbol] == 6  # the hint: the size it was traced at
    with pytest.raises(ValueError, match="not size symbols"):
        liveness(gm, sizes={"s99": 3})


def _marked_call(length: int) -> StepCall:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.zeros(2, length, dtype=torch.long)
    zgraph.mark_dynamic(idx, 1)
    return StepCall.of(train_step, (model, opt, idx, idx), {})


@pytest.mark.parametrize(
    "changes",
    [
        {"stage": 3, "sequence_parallel": 2, "remat": "full", "param_persistence_threshold": 0},
        {"stage": 1, "param_dtype": torch.float16, "loss_scale": "dynamic", "max_grad_norm": 1.0, "remat": "selective"},
    ],
)
def test_passes_lowering_and_estimate_add_no_size_guard(changes):
    """Every pass, the eager lowering, liveness and the timeline at world 2 on a graph with a symbolic sequence:
    the capture's ShapeEnv ends with the guards it had (a guard would pin the graph to its hint), and the
    estimate's formulas give its bytes at other sizes."""
    config = zgraph.Config(backend="eager", **changes)
    prepared = prepare(_marked_call(16), config, world_size=2)
    env = fake_mode(prepared.captured.gm).shape_env
    before = [g.expr for g in env.guards]
    estimates = estimate_sizes(prepared, config, [{}, {("idx", 1): 64}])
    assert [g.expr for g in env.guards] == before and not env.replacements
    (symbol,) = estimates[0].size_symbols
    assert estimates[0].size_symbols[symbol] == ("idx", 1)
    for e, size in zip(estimates, (16, 64)):
        assert e.sizes == {symbol: size}
        assert e.peak_formula.subs({s: size for s in e.peak_formula.free_symbols}) == e.peak_bytes
    assert estimates[1].peak_bytes > estimates[0].peak_bytes
    assert estimates[1].activation_bytes > estimates[0].activation_bytes


def test_estimate_at_sizes_and_a_budget_planned_for_the_largest():
    call = _marked_call(16)
    step = zgraph.distribute(zgraph.Config(backend="eager", remat="selective"))(train_step)  # fewer plans to try
    model, opt, idx, _ = call.args
    plan = step.estimate(model, opt, idx, idx, memory_budget=2**40, sizes={("idx", 1): 48})
    large = plan.chosen.estimate
    (symbol,) = large.size_symbols
    assert large.sizes == {symbol: 48}
    small = large.activation_formula.subs({s: 16 for s in large.activation_formula.free_symbols})
    assert large.activation_bytes > small > 0
    with pytest.raises(ValueError, match="not a symbolic size"):
        symbol_sizes(large.size_symbols, {("targets", 0): 3})


def _close(got: dict, want: dict) -> None:
    for a, b in zip(got["losses"], want["losses"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert got["variants"] == 1


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("symbolic_passes") / "results.pt"
    names = ["sequence_parallel_remat", "offload_clip"]
    run_ranks(2, "symbolic_pass_cases.run", str(path), names, timeout=600)
    results = torch.load(path, weights_only=False)
    for name in names:
        assert "error" not in results[name], results[name].get("error")
    return results


def test_sequence_parallel_and_remat_on_a_symbolic_sequence_equal_eager(two_ranks):
    """Ulysses over 2 ranks at stage 3 with every block recomputed: each rank's slice of the sequence is a symbol,
    rank 1's positions move by a symbolic offset; every length equals eager PyTorch on the whole sequences."""
    _close(two_ranks["sequence_parallel_remat"], eager())


def test_activation_offload_remat_and_clipping_on_a_symbolic_sequence_equal_eager(two_ranks):
    """Stage 2 with saved activations stashed to files and back (their symbolic shapes computed by the graph),
    selective remat and clipping of the global gradient norm, on 2 ranks: equal eager PyTorch on the global batch."""
    _close(two_ranks["offload_clip"], eager(max_grad_norm=CLIP))
