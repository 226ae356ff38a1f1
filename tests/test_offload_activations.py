"""The ``offload_activations`` pass (``Config.offload_activations``): its plan and rewrite on small synthetic graphs,
the activation tier's bookkeeping on real tensors, and whole steps with the ``"nvme"`` tier on real files.

Only where saved activations are kept changes, never an operation: losses and parameters are bitwise those of the
step without offload, at every ZeRO stage, on one rank and on two, alone and with ``remat="selective"``; each step
removes its files; the estimated peak goes down where saved activations dominate.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
from offload_activations_cases import VARIANTS, train
from pass_graphs import Builder, aten, context, count
from remat_cases import Net, step, train_split

import zgraph
from zgraph.binding.arguments import StepCall
from zgraph.graph import BACKWARD, FORWARD, PHASE, GraphOutput
from zgraph.inspect.estimate import prepare
from zgraph.inspect.variants import estimate_variants
from zgraph.ops import STASH, UNSTASH, offload_tier
from zgraph.passes import Pass, run_passes
from zgraph.passes.offload_activations import offload_activations, plan_offload_activations
from zgraph.runtime.offload_activations import ActivationFiles, ActivationHost, ActivationStash, unstash_order

STAGES = [0, 1, 2, 3]
TWO_RANK_STAGES = [1, 3]


# ------------------------------------------------------------------------------------------ synthetic graphs
def _graph():
    """A forward (a transposed weight, a matmul, a relu, a dropout mask, a sum) and the backward autograd's
    formulas would read; the loss is returned."""
    b = Builder()
    x = b.input("x", (4, 8))
    w = b.input("w", (8, 8), "param", 0)
    wt = b.op(aten.t.default, w)
    h = b.op(aten.mm.default, x, wt)
    a = b.op(aten.relu.default, h)
    mask = b.op(aten.bernoulli.p, a, 0.5)
    o = b.op(aten.mul.Tensor, a, mask)
    s = b.op(aten.sum.default, o)
    loss = b.op(aten.mul.Tensor, s, 2.0)
    g = b.op(aten.ones_like.default, o, phase=BACKWARD)
    g = b.op(aten.mul.Tensor, g, mask, phase=BACKWARD)
    g = b.op(aten.threshold_backward.default, g, a, 0, phase=BACKWARD)
    gw = b.op(aten.mm.default, b.op(aten.t.default, g, phase=BACKWARD), x, phase=BACKWARD)
    gs = b.op(aten.mul.Tensor, s, 0.0, phase=BACKWARD)  # a 0-d value the backward reads
    outs = [
        (loss, GraphOutput("user", "loss", 0)),
        (gw, GraphOutput("grad", "w", 0)),
        (gs, GraphOutput("user", "s", 1)),
    ]
    return b.finish(outs), {"wt": wt, "h": h, "a": a, "mask": mask, "o": o, "s": s}


def _names(nodes):
    return [n.name for n in nodes]


def test_plan_takes_the_saved_activations_not_inputs_views_of_them_or_scalars():
    gm, n = _graph()
    # the backward reads mask and a (and o via ones_like, s); x is an input, wt (unread by the backward) a view of
    # one, s is 0-d
    assert _names(plan_offload_activations(gm)) == _names([n["a"], n["mask"], n["o"]])
    assert _names(plan_offload_activations(gm, min_bytes=4 * 8 * 4 + 1)) == []
    assert _names(plan_offload_activations(gm, host_too=False)) == [], '"cpu" leaves values on the host alone'


def _run(gm, *inputs, tier=None):
    tier = tier or ActivationStash(ActivationHost(torch.device("cpu")), unstash_order(gm), window=1 << 20)
    torch.manual_seed(0)
    with offload_tier(tier):
        out = gm(*inputs)
    tier.finish()
    return out


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_rewrite_stashes_after_the_last_forward_use_and_keeps_results(where, tmp_path):
    gm, _ = _graph()
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch.manual_seed(0)
    want = gm(x, w)
    bound = functools.partial(offload_activations, tier="nvme")  # the same rewrite for either tier
    (record,) = run_passes(gm, context(), [Pass("offload_activations", bound)], check_input=False)
    out = record.gm
    assert count(out, STASH) == count(out, UNSTASH) == 3
    nodes = list(out.graph.nodes)
    for stash in (n for n in nodes if n.target is STASH):
        value = stash.args[0]
        assert stash.meta[PHASE] == FORWARD
        assert all(nodes.index(u) < nodes.index(stash) for u in value.users if u is not stash)
        assert all(u.meta.get(PHASE) != BACKWARD for u in value.users), "the backward reads the unstash instead"
        (back,) = stash.users
        assert back.target is UNSTASH and back.meta[PHASE] == BACKWARD
        assert all(u.meta[PHASE] == BACKWARD for u in back.users)
    backend = ActivationFiles(tmp_path) if where == "nvme" else ActivationHost(torch.device("cpu"))
    got = _run(out, x, w, tier=ActivationStash(backend, unstash_order(out), window=64))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if where == "nvme":
        assert os.listdir(backend.path) == []
        backend.close()
        assert not os.path.exists(backend.path)


def test_cpu_on_the_cpu_and_none_change_nothing():
    gm, _ = _graph()
    before = [node.target for node in gm.graph.nodes]
    for tier in (None, "cpu"):
        assert [node.target for node in offload_activations(gm, context(), tier=tier).graph.nodes] == before


def test_the_tier_restores_strides_and_reads_ahead_within_the_window(tmp_path):
    files = ActivationFiles(tmp_path)
    stash = ActivationStash(files, [1, 0], window=16 * 4)
    a, b = torch.randn(4, 4).t(), torch.randn(4, 4)
    stash.stash(0, a)
    stash.stash(1, b)  # key 1 comes back first: read ahead now; key 0 waits (the window holds one)
    assert list(stash._ahead) == [1]
    got_b = stash.unstash(1, torch.empty_strided(b.shape, b.stride(), device="meta"))
    assert list(stash._ahead) == [0]
    got_a = stash.unstash(0, torch.empty_strided(a.shape, a.stride(), device="meta"))
    assert torch.equal(got_b, b) and torch.equal(got_a, a) and got_a.stride() == a.stride()
    stash.finish()
    assert os.listdir(files.path) == []
    files.close()


def test_a_failed_run_leaves_no_files(tmp_path):
    files = ActivationFiles(tmp_path)
    stash = ActivationStash(files, [0, 1], window=1)
    stash.stash(0, torch.randn(8))
    stash.stash(1, torch.randn(8))
    stash.finish(raise_error=False)  # the graph failed before its backward
    assert os.listdir(files.path) == []
    files.close()


# ------------------------------------------------------------------------------------------------ the config
def test_config_offload_activations_values(tmp_path):
    assert zgraph.Config(offload_activations="cpu").offload_activations == "cpu"
    with pytest.raises(ValueError, match="Config.offload_activations must be"):
        zgraph.Config(offload_activations="disk")
    with pytest.raises(ValueError, match="needs offload_dir"):
        zgraph.Config(offload_activations="nvme")
    names = [p.name for p in zgraph.Config(offload_activations="nvme", offload_dir=tmp_path).passes()]
    assert names.index("remat") < names.index("offload_activations") < names.index("shard_optimizer")


# ------------------------------------------------------------------------------------------------ whole steps
def _equal(got, want, what):
    assert not isinstance(got, dict), got["error"]
    assert not isinstance(want, dict), want["error"]
    losses, state, _, _ = got
    assert all(torch.equal(a, b) for a, b in zip(losses, want[0])), f"{what}: losses {losses} != {want[0]}"
    for key, value in want[1].items():
        assert torch.equal(state[key], value), f"{what}: parameter {key}"


def test_single_process_parity_and_files_removed_after_each_step(tmp_path):
    want = train(zgraph.Config(backend="eager"))
    for name in ("nvme", "nvme+selective"):
        got = train(zgraph.Config(backend="eager", offload_dir=tmp_path, **VARIANTS[name]))
        assert got[2] > 0, "the pass offloaded nothing"
        assert got[3] == [[], [], []], "each step removes its files"
        _equal(got, want, name)


def test_composes_with_offloaded_optimizer_states(tmp_path):
    """One graph with reload / write_back and stash / unstash nodes: the activation tier passes the state's reads
    and writes on to the state's store."""
    want = train(zgraph.Config(backend="eager", stage=1))
    config = zgraph.Config(
        backend="eager", stage=1, offload_optimizer="nvme", offload_activations="nvme", offload_dir=tmp_path
    )
    got = train(config)
    assert got[2] > 0
    _equal(got, want, "with offload_optimizer")


def test_split_mode_is_left_as_it_is(tmp_path):
    """Split mode: the forward and the backward run in two calls and autograd keeps the saved values between them;
    the pass leaves the joint graph unchanged, and training is as without offload."""
    config = zgraph.Config(backend="eager", offload_activations="nvme", offload_dir=tmp_path)
    got, want = train_split(config), train_split(zgraph.Config(backend="eager"))
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    assert all(torch.equal(got[1][k], v) for k, v in want[1].items())
    assert not any(os.listdir(os.path.join(tmp_path, d)) for d in os.listdir(tmp_path))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from dist_harness import run_ranks

    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            path = tmp_path_factory.mktemp(f"actoff{world}") / "results.pt"
            directory = tmp_path_factory.mktemp(f"actoff{world}files")
            run_ranks(
                world,
                "offload_activations_cases.run",
                str(path),
                str(directory),
                STAGES if world == 1 else TWO_RANK_STAGES,
                timeout=600,
            )
            cache[world] = torch.load(path, weights_only=False)
        return cache[world]

    return get


@pytest.mark.parametrize(("world", "stage"), [(1, s) for s in STAGES] + [(2, s) for s in TWO_RANK_STAGES])
@pytest.mark.parametrize("variant", ["nvme", "nvme+selective"])
def test_offload_is_bitwise_equal_to_none(ranks, world, stage, variant):
    results = ranks(world)
    got = results[(stage, variant)]
    _equal(got, results[(stage, "none")], f"{variant}, stage {stage}, {world} rank(s)")
    assert got[2] > 0, "the pass offloaded nothing"
    assert got[3] == [[], [], []], "each step removes its files"


def test_offload_lowers_the_estimated_peak(tmp_path):
    """Wide activations (a long batch through narrow blocks): the saved values leave memory between the forward and
    the backward. One capture estimated through each config's passes, as the memory planner estimates them: the
    numbers ``step.estimate`` gives for each."""
    model = Net(d_model=32, layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 64, 8), torch.randint(0, 5, (64,))
    config = zgraph.Config(backend="eager", offload_dir=tmp_path)
    prepared = prepare(StepCall.of(step, (model, opt, x, y), {}), config)
    tiers = (None, "nvme")
    estimates = estimate_variants(prepared, [dataclasses.replace(config, offload_activations=t) for t in tiers])
    peaks = {tier: e.peak_bytes for tier, e in zip(tiers, estimates)}
    print(f"estimated peak bytes by Config.offload_activations: {peaks}")
    assert peaks["nvme"] < peaks[None]
