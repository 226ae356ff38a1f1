"""Topology in the cost model and the estimate (issue item 4): two link classes, within a node and across nodes.

A collective whose group's ranks lie on more than one node (``ranks_per_node`` consecutive ranks per node) is
priced on the across-node class and counted in ``Estimate.link_bytes["inter_node"]``. On 8 ranks of 4 per node:
flat ZeRO-3 sends everything across nodes; hybrid sharding (``shard_group_size=4``) only the all-reduce of the
gradient shards; hpZ (``secondary_shard_group_size=4``) the forward's gathers and the reduce-scatter, its
backward's re-gathers stay within the node.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx
from torch import nn

import zgraph
from zgraph.cli import estimate as estimate_cli
from zgraph.graph import VAL, Axis
from zgraph.inspect.explain import _link_lines
from zgraph.runtime.cost_model import (
    KINDS,
    CollectiveCost,
    CostModel,
    analytical_cost_model,
    crossing_groups,
    inter_node_costs,
    with_inter_node,
)
from zgraph.runtime.process_group import ProcessGroupInfo


def test_a_collective_across_nodes_costs_more_on_a_slower_link():
    model = analytical_cost_model("nccl")
    for kind in KINDS:
        within = model.collective_seconds(kind, 2**30)
        assert model.collective_seconds(kind, 2**30, crosses_nodes=True) > within
        assert model.collective_seconds(kind, 2**30, crosses_nodes=False) == within
    slow, fast = with_inter_node(model, "nccl", gbps=100), with_inter_node(model, "nccl", gbps=400)
    kind = "all_gather_into_tensor"
    assert slow.collective_seconds(kind, 2**30, crosses_nodes=True) > fast.collective_seconds(kind, 2**30, True)
    assert fast.collective_seconds(kind, 2**30, crosses_nodes=True) == pytest.approx(30e-6 + 2**30 / 50e9)
    assert fast.bucket_bytes(kind) == model.bucket_bytes(kind)  # the within-node class is left as it was


def test_inter_node_costs_flags_and_defaults():
    costs = inter_node_costs("nccl", gbps=400, latency=5e-6)
    assert costs["all_gather_into_tensor"] == CollectiveCost(5e-6, 50e9)
    assert costs["all_reduce"] == CollectiveCost(5e-6, 25e9)  # a ring all-reduce crosses each link twice
    assert inter_node_costs("gloo") == inter_node_costs(None)
    for bad in ({"gbps": 0}, {"gbps": -1.0}, {"gbps": True}, {"latency": -1e-6}):
        with pytest.raises(ValueError):
            inter_node_costs("nccl", **bad)
    measured = CostModel(dict.fromkeys(KINDS, CollectiveCost(1e-5, 1e10)), 1e9, 1e9, "measured")
    assert measured.collective_seconds("all_reduce", 100, crosses_nodes=True) == measured.collective_seconds(
        "all_reduce", 100
    )  # no across-node class: priced as within a node
    assert with_inter_node(measured, "nccl").inter_node == inter_node_costs("nccl")


def test_crossing_groups_by_ranks_per_node():
    group = ProcessGroupInfo(0, 8, "world", "nccl")
    assert crossing_groups(group, 4) == {"world": True}
    assert crossing_groups(group, 8) == {"world": False}
    hybrid = ProcessGroupInfo(
        0,
        8,
        "world",
        "nccl",
        shard=Axis(size=4, rank=0, name="world/shard"),
        replicate=Axis(size=2, rank=0, name="world/replicate", crosses_nodes=True),
    )
    assert crossing_groups(hybrid, 4) == {"world": True, "world/shard": False, "world/replicate": True}


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _estimate(ranks_per_node: int | None = 4, inter_node_gbps: float | None = None, **config: object):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters())
    cfg = zgraph.Config(stage=3, backend="eager", measure_collectives=False, param_persistence_threshold=0, **config)
    step = zgraph.distribute(cfg)(_step)
    links = {"ranks_per_node": ranks_per_node, "inter_node_gbps": inter_node_gbps}
    return step.estimate(model, opt, torch.randn(8, 64), world_size=8, **links)


def test_link_bytes_of_flat_zero3_hybrid_sharding_and_hpz():
    flat = _estimate()
    hsdp = _estimate(shard_group_size=4)
    hpz = _estimate(secondary_shard_group_size=4)
    for e in (flat, hsdp, hpz):
        assert set(e.link_bytes) == {"intra_node", "inter_node"}
        assert sum(e.link_bytes.values()) == sum(e.comm_bytes.values())
        assert e.to_json()["link_bytes"] == dict(e.link_bytes)
    # flat ZeRO-3: every collective spans all 8 ranks, so both nodes
    assert flat.link_bytes == {"intra_node": 0, "inter_node": sum(flat.comm_bytes.values())}
    # hybrid sharding: gathers and reduce-scatters within the node; only the gradient shards' all-reduce crosses
    assert hsdp.link_bytes["inter_node"] == hsdp.comm_bytes["all_reduce"] > 0
    assert (
        hsdp.link_bytes["intra_node"]
        == hsdp.comm_bytes["all_gather_into_tensor"] + hsdp.comm_bytes["reduce_scatter_tensor"]
    )
    assert 4 * hsdp.link_bytes["inter_node"] <= flat.link_bytes["inter_node"]
    # hpZ: the same collectives as flat; its backward's re-gathers (the only within-node bytes) no longer cross
    assert hpz.comm_bytes == flat.comm_bytes
    assert 0 < hpz.link_bytes["intra_node"] < hpz.comm_bytes["all_gather_into_tensor"]
    assert hpz.link_bytes["inter_node"] == flat.link_bytes["inter_node"] - hpz.link_bytes["intra_node"]
    gathered_across = hpz.comm_bytes["all_gather_into_tensor"] - hpz.link_bytes["intra_node"]
    assert gathered_across < flat.comm_bytes["all_gather_into_tensor"]
    # across-node time: cheaper where less crosses
    assert hsdp.comm_seconds["all_gather_into_tensor"] < flat.comm_seconds["all_gather_into_tensor"]
    assert hpz.comm_seconds["all_gather_into_tensor"] < flat.comm_seconds["all_gather_into_tensor"]


def test_one_node_and_link_speed():
    one_node = _estimate(ranks_per_node=8)
    assert one_node.link_bytes["inter_node"] == 0
    slow, fast = _estimate(inter_node_gbps=1.0), _estimate(inter_node_gbps=1000.0)
    assert slow.link_bytes == fast.link_bytes
    assert slow.step_seconds > fast.step_seconds
    assert sum(slow.comm_seconds.values()) > sum(fast.comm_seconds.values())
    with pytest.raises(ValueError, match="ranks_per_node"):
        _estimate(ranks_per_node=0)


def test_cli_prints_bytes_per_link_class():
    parser = argparse.ArgumentParser()
    estimate_cli.add_arguments(parser)
    argv = ["--model", "gpt-bench", "--world", "8", "--ranks-per-node", "4", "--inter-node-gbps", "400"]
    argv += ["--stage", "3", "--shard-group-size", "4"]
    out = json.loads(estimate_cli.run(parser.parse_args([*argv, "--json"])))
    assert out["link_bytes"]["inter_node"] == out["comm_bytes"]["all_reduce"] > 0
    assert out["link_bytes"]["intra_node"] > out["link_bytes"]["inter_node"]
    table = estimate_cli.run(parser.parse_args(argv))
    assert "across nodes" in table and "shard_group_size=4" in table
    with pytest.raises(estimate_cli.EstimateInputError, match="does not divide"):
        estimate_cli.run(parser.parse_args([*argv[:-1], "3"]))


def test_explain_reports_bytes_per_link_class_where_the_step_has_groups():
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta[VAL] = torch.empty(256)  # 1 KiB
    c10d = torch.ops._c10d_functional
    within = graph.call_function(c10d.all_gather_into_tensor.default, (x, 2, "g/shard"))
    within.meta[VAL] = torch.empty(512)  # 2 KiB
    across = graph.call_function(c10d.all_reduce.default, (x, "avg", "g/replicate"))
    across.meta[VAL] = torch.empty(256)
    graph.output((within, across))
    gm = fx.GraphModule(nn.Module(), graph)
    groups = {"g": True, "g/shard": False, "g/replicate": True}
    step = SimpleNamespace(final=gm, cost_model=None, crossing=groups)
    assert _link_lines(step) == ["collective bytes per link class: within a node 2.0 KiB, across nodes 1.0 KiB"]
    assert _link_lines(SimpleNamespace(final=gm, cost_model=None, crossing={"g": True})) == []  # no groups
