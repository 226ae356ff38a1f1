"""The ``remat`` pass (``Config.remat``): its plan on small synthetic graphs, the rewrite, and whole steps.

A recomputed deterministic op gives the same bits on the same inputs, and random draws are saved, never drawn
again: with either policy, losses and parameters are bitwise those of the step without recomputation, at every
ZeRO stage, on one rank and on two, and in split mode. Recomputing lowers the step's estimated peak where
activations dominate.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from pass_graphs import Builder, aten, context, count
from remat_cases import POLICIES, Net, batches, step, train, train_split

import zgraph
from zgraph.binding.arguments import StepCall
from zgraph.errors import PassError
from zgraph.graph import BACKWARD, BLOCK, CUSTOM, MADE_BY, PHASE, GraphOutput
from zgraph.inspect.estimate import prepare
from zgraph.inspect.variants import estimate_variants
from zgraph.passes import Pass, run_passes
from zgraph.passes.remat import plan_recompute, remat

STAGES = [0, 1, 2, 3]
SPLIT_STAGES = {1: [], 2: [3]}  # split mode: stage 3 on 2 ranks (and below, without a process group)


# ------------------------------------------------------------------------------------------ synthetic graphs
def _in_block(node, name):
    node.meta[CUSTOM] = {BLOCK: name}
    return node


def _two_blocks(blocks: bool = True):
    """Two blocks (``mm``, ``relu``/``tanh``, a dropout mask in the second, a residual add), a sum outside them,
    and a backward that reads what autograd's formulas would read."""
    b = Builder()
    x = b.input("x", (4, 8))
    w0 = b.input("w0", (8, 8), "param", 0)
    w1 = b.input("w1", (8, 8), "param", 1)
    mark = _in_block if blocks else (lambda node, name: node)
    h0 = mark(b.op(aten.mm.default, x, mark(b.op(aten.t.default, w0), "b0")), "b0")
    a0 = mark(b.op(aten.relu.default, h0), "b0")
    o0 = mark(b.op(aten.add.Tensor, x, a0), "b0")
    h1 = mark(b.op(aten.mm.default, o0, w1), "b1")
    a1 = mark(b.op(aten.tanh.default, h1), "b1")
    mask = mark(b.op(aten.bernoulli.p, a1, 0.5), "b1")
    o1 = mark(b.op(aten.mul.Tensor, a1, mask), "b1")
    loss = b.op(aten.sum.default, o1)
    g = b.op(aten.ones_like.default, o1, phase=BACKWARD)
    g = b.op(aten.mul.Tensor, g, mask, phase=BACKWARD)
    g = b.op(aten.tanh_backward.default, g, a1, phase=BACKWARD)
    gw1 = b.op(aten.mm.default, b.op(aten.t.default, o0, phase=BACKWARD), g, phase=BACKWARD)
    g = b.op(aten.mm.default, g, b.op(aten.t.default, w1, phase=BACKWARD), phase=BACKWARD)
    g = b.op(aten.threshold_backward.default, g, a0, 0, phase=BACKWARD)
    gw0 = b.op(aten.mm.default, b.op(aten.t.default, x, phase=BACKWARD), g, phase=BACKWARD)
    nodes = {"t": h0.args[1], "h0": h0, "a0": a0, "o0": o0, "h1": h1, "a1": a1, "mask": mask, "o1": o1}
    outs = [(loss, GraphOutput("user", "loss", 0)), (gw0, GraphOutput("grad", "w0", 0))]
    return b.finish([*outs, (gw1, GraphOutput("grad", "w1", 1))]), nodes


def _names(nodes):
    return [n.name for n in nodes]


def test_selective_saves_matmuls_and_random_ops_and_recomputes_the_rest():
    gm, n = _two_blocks()
    # the backward reads a0 (relu), o0 (add), a1 (tanh), mask (random), o1 (mul): pointwise ones inside a block
    # are recomputed from the matmuls' outputs; the mask and the matmuls are saved, and so are o0 and o1, which
    # cross a block's edge (block 1's input, the sum's): a chain never reaches back into an earlier block
    assert _names(plan_recompute(gm, "selective")) == _names([n["a0"], n["a1"]])


def test_full_recomputes_inside_each_block_from_its_inputs():
    gm, n = _two_blocks()
    # o0 is block 1's input and o1 the sum's: saved; inside the blocks everything deterministic is recomputed,
    # matmuls included
    assert _names(plan_recompute(gm, "full")) == _names([n["t"], n["h0"], n["a0"], n["h1"], n["a1"]])


def test_a_mapping_gives_each_block_its_own_policy():
    gm, n = _two_blocks()
    assert _names(plan_recompute(gm, {"b0": "full", "b1": None})) == _names([n["t"], n["h0"], n["a0"]])
    assert _names(plan_recompute(gm, {"b0": None, "b1": "selective"})) == _names([n["a1"]])
    assert _names(plan_recompute(gm, {"b1": "full"})) == _names([n["h1"], n["a1"]]), "blocks left out are saved"
    with pytest.raises(PassError, match=r"lack: 'b7'; its blocks are 'b0', 'b1'"):
        plan_recompute(gm, {"b7": "full"})


def test_full_refuses_a_graph_without_blocks():
    gm, _ = _two_blocks(blocks=False)
    with pytest.raises(PassError, match='remat="selective"'):
        plan_recompute(gm, "full")


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_rewrite_recomputes_before_the_backward_and_keeps_results(policy):
    gm, _ = _two_blocks()
    x, w0, w1 = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8)
    torch.manual_seed(0)
    want = gm(x, w0, w1)
    planned = _names(plan_recompute(gm, policy))
    (record,) = run_passes(gm, context(), [Pass("remat", functools.partial(remat, policy=policy))], check_input=False)
    out = record.gm
    torch.manual_seed(0)
    got = out(x, w0, w1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert count(out, aten.bernoulli.p) == 1, "a random op is never recomputed"
    nodes = list(out.graph.nodes)
    first_backward = min(i for i, node in enumerate(nodes) if node.meta.get(PHASE) == BACKWARD)
    copies = [node for node in nodes if node.meta.get(MADE_BY) == "remat"]
    assert len(copies) == len(planned)
    for copy in copies:
        assert copy.meta[PHASE] == BACKWARD and nodes.index(copy) >= first_backward
        assert all(user.meta[PHASE] == BACKWARD for user in copy.users)
    originals = {node.name: node for node in nodes if node.name in planned}
    for node in originals.values():  # the forward originals are read by the forward only
        assert all(user.meta.get(PHASE) != BACKWARD for user in node.users), node.name


def test_remat_none_changes_nothing():
    gm, _ = _two_blocks()
    before = [node.target for node in gm.graph.nodes]
    assert [node.target for node in remat(gm, context(), policy=None).graph.nodes] == before


# ------------------------------------------------------------------------------------------------ the config
def test_config_remat_values():
    assert zgraph.Config(remat="full").remat == "full"
    with pytest.raises(ValueError, match="Config.remat must be one of"):
        zgraph.Config(remat="everything")
    with pytest.raises(ValueError, match=r'Config.remat="auto" .* set Config.memory_budget too'):
        zgraph.Config(remat="auto")
    assert zgraph.Config(remat="auto", memory_budget="1GiB").remat == "auto"
    given = {"layers.0": "full", "layers.1": None}
    assert zgraph.Config(remat=given).remat == given and zgraph.Config(remat=given).remat is not given
    with pytest.raises(ValueError, match=r"block names \(str\) to None, 'selective' or 'full'; got 'layers.0': 'all'"):
        zgraph.Config(remat={"layers.0": "all"})
    names = [p.name for p in zgraph.Config(remat="selective").passes()]
    assert names.index("remat") < names.index("shard_params")


# ------------------------------------------------------------------------------------------------ whole steps
def test_a_mapping_naming_no_block_is_refused_and_leaves_the_state_as_it_was():
    """The pass refuses the graph after capture made the optimizer's first state: that state goes again (a bug:
    AdamW's zeroed moments were left behind), parameters and grads untouched."""
    model, (x, y) = Net(), batches()[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = zgraph.distribute(zgraph.Config(backend="eager", remat={"model.blocks.7": "full"}))(step)
    with pytest.raises(PassError, match=r"lack: 'model.blocks.7'; its blocks are 'model.blocks.0', 'model.b"):
        compiled(model, opt, x, y)
    assert not opt.state and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    mapped = zgraph.distribute(zgraph.Config(backend="eager", remat={"model.blocks.1": "full"}))(step)
    plain = zgraph.distribute(zgraph.Config(backend="eager"))(step)
    torch.manual_seed(3)
    got = mapped(model, opt, x, y)
    model2 = Net()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    torch.manual_seed(3)
    assert torch.equal(got, plain(model2, opt2, x, y))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def _equal(got, want, what):
    losses, state, _ = got
    want_losses, want_state, _ = want
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses)), f"{what}: losses {losses} != {want_losses}"
    for key, value in want_state.items():
        assert torch.equal(state[key], value), f"{what}: parameter {key}"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from dist_harness import run_ranks

    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            path = tmp_path_factory.mktemp(f"remat{world}") / "results.pt"
            run_ranks(world, "remat_cases.run", str(path), STAGES, SPLIT_STAGES[world], timeout=600)
            cache[world] = torch.load(path, weights_only=False)
        return cache[world]

    return get


def _check(results: dict, mode: str, stage: int, policy: str, what: str) -> None:
    for key in ((mode, stage, None), (mode, stage, policy)):
        assert "error" not in results[key], results[key]["error"]
    assert results[(mode, stage, policy)][2] > 0, "the pass recomputed nothing"
    _equal(results[(mode, stage, policy)], results[(mode, stage, None)], what)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("policy", ["selective", "full"])
def test_remat_is_bitwise_equal_to_no_remat(ranks, world, stage, policy):
    _check(ranks(world), "step", stage, policy, f"{policy}, stage {stage}, {world} rank(s)")


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_remat_in_split_mode_is_bitwise_equal_on_two_ranks(ranks, policy):
    """Split mode (the backward outside the step, partitioned after the passes), at stage 3: the recomputation
    lands in the backward graph, which gathers the parameters it reads."""
    _check(ranks(2), "split", 3, policy, f"split mode, {policy}, stage 3, 2 ranks")


@pytest.fixture(scope="module")
def split_plain():
    """Split mode without recomputation (no group): what every policy must equal."""
    return train_split(zgraph.Config(backend="eager"))


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_remat_in_split_mode_without_a_group(split_plain, policy):
    got = train_split(zgraph.Config(backend="eager", remat=policy))
    assert got[2] > 0, "the pass recomputed nothing"
    _equal(got, split_plain, f"split mode, {policy}")


def test_full_remat_lowers_the_estimated_peak():
    """Wide activations (a long batch through narrow blocks): keeping only each block's input and the masks holds
    less at the peak than keeping everything the backward reads. One capture (blocks marked) estimated through each
    policy's passes, as the memory planner estimates them: the numbers ``step.estimate`` gives for each config."""
    model = Net(d_model=32, layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 64, 8), torch.randint(0, 5, (64,))
    config = zgraph.Config(backend="eager", remat="selective")
    prepared = prepare(StepCall.of(step, (model, opt, x, y), {}), config)
    estimates = estimate_variants(prepared, [dataclasses.replace(config, remat=policy) for policy in POLICIES])
    peaks = {policy: e.peak_bytes for policy, e in zip(POLICIES, estimates)}
    print(f"estimated peak bytes by Config.remat: {peaks}")
    assert peaks["full"] < peaks[None]
    assert peaks["selective"] < peaks[None]


def test_single_process_parity_without_a_group():
    """No process group (the step as a plain compiled function): every policy as without recomputation."""
    want = train(zgraph.Config(backend="eager"))
    for policy in ("selective", "full"):
        got = train(zgraph.Config(backend="eager", remat=policy))
        assert got[2] > 0
        _equal(got, want, policy)
