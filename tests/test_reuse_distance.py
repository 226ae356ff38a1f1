"""``Config.max_reuse_distance`` (DeepSpeed's ``stage3_max_reuse_distance``): stage 3 keeps a parameter gathered
from one use region into the next when few enough elements of other parameters are gathered in between.

Unit tests of ``shard_params`` and ``bucket`` on small synthetic graphs, then 2 gloo ranks against eager PyTorch
on the global batch (the bound of ``test_zero_parity``), with the all-gathers of the final graph counted."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from estimate_cases import train_step
from pass_graphs import Builder, context, param
from test_zero_parity import assert_rel, expected

import zgraph
from zgraph.demos.models import BENCH_GPT, GPT
from zgraph.graph import BACKWARD, FORWARD, OPTIMIZER, PHASE, GraphOutput, collective_kind
from zgraph.ops import REDUCE, REDUCE_SHARD, UNSHARD
from zgraph.passes.bucket import plan_buckets
from zgraph.passes.shard_params import shard_params

aten = torch.ops.aten


def _updated(b: Builder, g0, w1, w2, shapes: tuple) -> tuple:
    """Finish a two-layer graph: both parameters updated, ``g0`` returned; the graph and its pass context."""
    new1 = b.op(aten.mul.Tensor, w1, 0.5, phase=OPTIMIZER)
    new2 = b.op(aten.mul.Tensor, w2, 0.5, phase=OPTIMIZER)
    outputs = [(g0, GraphOutput("user", "g0", 0))]
    outputs += [(new1, GraphOutput("param", "w1", 0)), (new2, GraphOutput("param", "w2", 1))]
    return b.finish(outputs), context(tuple(param(i, shape) for i, shape in enumerate(shapes)))


def _two_layers():
    """``x @ w1 @ w2`` forward, its backward through ``t(w2)`` then ``t(w1)``, and both updates: w1 (32
    elements) has w2 (16) gathered between its forward and backward reads; w2 has nothing in between."""
    b = Builder()
    w1 = b.input("w1", (8, 4), "param", 0)
    w2 = b.input("w2", (4, 4), "param", 1)
    x = b.input("x", (2, 8))
    y1 = b.op(aten.mm.default, x, w1)
    y2 = b.op(aten.mm.default, y1, w2)
    g1 = b.op(aten.mm.default, y2, b.op(aten.t.default, w2, phase=BACKWARD), phase=BACKWARD)
    g0 = b.op(aten.mm.default, g1, b.op(aten.t.default, w1, phase=BACKWARD), phase=BACKWARD)
    return _updated(b, g0, w1, w2, ((8, 4), (4, 4)))


def _two_linear_layers():
    """As ``_two_layers``, written as ``F.linear`` traces: the forward reads ``t(w)``, the backward reads a view
    of that view, ``t(t(w))`` (so after sharding, a backward view of the forward gather is left with no readers)."""
    b = Builder()
    w1 = b.input("w1", (4, 8), "param", 0)
    w2 = b.input("w2", (4, 4), "param", 1)
    x = b.input("x", (2, 8))
    t1 = b.op(aten.t.default, w1)
    t2 = b.op(aten.t.default, w2)
    y2 = b.op(aten.mm.default, b.op(aten.mm.default, x, t1), t2)
    g1 = b.op(aten.mm.default, y2, b.op(aten.t.default, t2, phase=BACKWARD), phase=BACKWARD)
    g0 = b.op(aten.mm.default, g1, b.op(aten.t.default, t1, phase=BACKWARD), phase=BACKWARD)
    return _updated(b, g0, w1, w2, ((4, 8), (4, 4)))


def _gathers(gm) -> dict[str, list[str]]:
    """Per parameter, the phases its gathers' readers run in (one list per gather)."""
    out: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.target is UNSHARD:
            phases = sorted({u.meta[PHASE] for u in node.users} | {node.meta[PHASE]})
            out.setdefault(node.args[0].name, []).append("+".join(phases))
    return out


@pytest.mark.parametrize(
    ("distance", "want"),
    [
        (0, {"w1": ["forward", "backward"], "w2": ["forward", "backward"]}),  # default: every region gathers
        (1, {"w1": ["forward", "backward"], "w2": ["backward+forward"]}),  # only w2: nothing gathered between
        (15, {"w1": ["forward", "backward"], "w2": ["backward+forward"]}),  # w2's 16 elements are too many
        (16, {"w1": ["backward+forward"], "w2": ["backward+forward"]}),  # both gathered once
    ],
)
@pytest.mark.parametrize("graph", [_two_layers, _two_linear_layers])
def test_a_gather_is_kept_for_the_next_region_within_the_distance(graph, distance, want):
    gm, ctx = graph()
    gm = shard_params(gm, ctx, stage=3, max_reuse_distance=distance)
    gm.graph.lint()
    assert _gathers(gm) == want
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:  # each gather still sits right before its first reader
        if node.target is UNSHARD:
            assert order[node] + 1 == min(order[u] for u in node.users)


def test_a_kept_gather_is_not_bucketed_with_a_forward_only_one():
    gm, ctx = _two_layers()
    gm = shard_params(gm, ctx, stage=3, max_reuse_distance=1)  # w2 kept into the backward, w1 not
    forward = [n for n in gm.graph.nodes if n.target is UNSHARD and n.meta[PHASE] == FORWARD]
    assert len(forward) == 2
    for a, b in zip(forward, forward[1:]):  # adjacent, so only the kept one's lifetime keeps them apart
        a.append(b)
    assert plan_buckets(gm, dict.fromkeys((UNSHARD, REDUCE_SHARD, REDUCE), 1 << 30)) == []
    gm, ctx = _two_layers()
    gm = shard_params(gm, ctx, stage=3, max_reuse_distance=16)  # both kept: one bucket
    first, second = [n for n in gm.graph.nodes if n.target is UNSHARD]
    first.append(second)
    assert [len(p.members) for p in plan_buckets(gm, dict.fromkeys((UNSHARD, REDUCE_SHARD, REDUCE), 1 << 30))] == [2]


def test_the_distance_is_checked_and_mapped_from_deepspeed():
    with pytest.raises(ValueError, match="max_reuse_distance"):
        zgraph.Config(stage=3, max_reuse_distance=-1)
    with pytest.raises(ValueError, match="max_reuse_distance"):
        zgraph.Config(stage=3, max_reuse_distance=1.5)
    ds = {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 1000}}
    assert zgraph.Config.from_deepspeed(ds).max_reuse_distance == 1000
    ds = {"zero_optimization": {"stage": 3, "max_reuse_distance": 0}}
    assert zgraph.Config.from_deepspeed(ds).max_reuse_distance == 0
    assert zgraph.Config.from_deepspeed({"zero_optimization": {"stage": 3}}).max_reuse_distance == 10**9
    assert zgraph.Config().max_reuse_distance == 0


def test_the_bench_gpt_gathers_less_as_the_distance_grows():
    """On a real model's graph (``F.linear``'s views), the bytes gathered per step fall step by step with the
    distance, down to one gather per parameter; a small distance keeps only the parameters used late in the
    forward (regression: every positive distance kept every parameter)."""
    gathered = []
    for distance in (0, 1_000_000, 2_000_000, 10**9):
        torch.manual_seed(0)
        model = GPT(BENCH_GPT)
        opt = torch.optim.AdamW(model.parameters())
        idx = torch.randint(0, BENCH_GPT.vocab, (2, BENCH_GPT.seq))
        config = zgraph.Config(stage=3, backend="eager", max_reuse_distance=distance)
        e = zgraph.distribute(config)(train_step).estimate(model, opt, idx, idx, world_size=2)
        gathered.append(e.comm_bytes["all_gather_into_tensor"])
    once = e.comm_bytes["reduce_scatter_tensor"]  # each gradient reduced once: the same bytes as one gather each
    assert gathered[0] > gathered[1] > gathered[2] > gathered[3] == once, gathered


# ------------------------------------------------------------------------------------------- on 2 gloo ranks
NAMES = ["adamw", "two_backward_calls", "accumulation_loop", "autograd_grad", "two_models", "frozen", "tied_weights"]
DISTANCES = [1, 10**9]


def run_distances(rank: int, world: int, out_path: str) -> None:
    """Worker: every case of ``NAMES`` in stage 3 with each distance; rank 0 saves the results and the final
    graph's all-gathers per phase."""
    from zero_cases import CASES, run_case

    results = {}
    for distance in DISTANCES:
        for name in NAMES:
            result = run_case(CASES[name], 3, rank, world, max_reuse_distance=distance)
            step = result.pop("step")
            gathers: dict[str, int] = {}
            for node in step.graphs["final"].graph.nodes:
                if collective_kind(node) == "all_gather_into_tensor":
                    gathers[node.meta[PHASE]] = gathers.get(node.meta[PHASE], 0) + 1
            results[(distance, name)] = {**result, "gathers": gathers, "explain": step.explain()}
    if rank == 0:
        torch.save(results, out_path)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("reuse") / "results.pt"
    run_ranks(2, "test_reuse_distance.run_distances", str(path))
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("distance", DISTANCES)
@pytest.mark.parametrize("name", NAMES)
def test_kept_gathers_match_eager_on_the_global_batch(results, name, distance):
    result = results[(distance, name)]
    want, bound = expected(name, 2)
    for got, ref in zip(result["losses"], want["losses"], strict=True):
        assert abs(got - ref) <= bound * max(abs(ref), 1e-12)
    for got_model, want_model in zip(result["models"], want["models"], strict=True):
        for key in want_model:
            assert_rel(got_model[key], want_model[key], f"state_dict[{key!r}]", bound)
    for got_opt, want_opt in zip(result["optimizers"], want["optimizers"], strict=True):
        for index, state in want_opt["state"].items():
            for key, value in state.items():
                assert_rel(got_opt["state"][index][key], value, f"optimizer state[{index}][{key!r}]", bound)


def test_a_distance_as_large_as_the_model_gathers_once_per_step(results):
    for name in NAMES:
        kept = results[(10**9, name)]["gathers"]
        assert kept.get(BACKWARD, 0) == 0, (name, kept)
        assert kept.get(FORWARD, 0) > 0, (name, kept)
    # the MLP: only the last weight is read again in backward (for the hidden activation's gradient)
    assert (
        "max_reuse_distance=1000000000 elements: 1 of 4 sharded parameters stay gathered"
        in (results[(10**9, "adamw")]["explain"])
    )
