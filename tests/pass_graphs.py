"""Small synthetic step graphs for testing one pass at a time: built node by node under a FakeTensorMode, with
the graph contract's meta (``zgraph.graph``) filled in, and a hand-made ``PassContext`` (world 2, no process
group: passes only insert collectives, nothing runs them)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from zgraph.graph import (
    BACKWARD,
    FORWARD,
    INPUT,
    OUTPUTS,
    PHASE,
    VAL,
    GraphInput,
    GraphOutput,
    ParamInfo,
    ShardSpec,
    compute_val,
)
from zgraph.ops import GRAD_CONTRIBUTION
from zgraph.passes import PassContext

aten = torch.ops.aten
GROUP = "test_group"


class Builder:
    """``b.input(...)``, ``b.op(...)``, then ``b.finish([(node, GraphOutput), ...])`` -> GraphModule."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode()
        self.graph = fx.Graph()

    def input(
        self, name: str, shape: tuple, kind: str = "input", index: int = 0, dtype: torch.dtype = torch.float32, **kw
    ) -> fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta[VAL] = torch.empty(shape, dtype=dtype)
        node.meta[INPUT] = GraphInput(kind, name, index, **kw)
        return node

    def op(self, target, *args, phase: str = FORWARD, **kwargs) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        node.meta[PHASE] = phase
        compute_val(node, self.mode)
        return node

    def finish(self, outputs: list[tuple[fx.Node, GraphOutput]]) -> fx.GraphModule:
        out = self.graph.output(tuple(v for v, _ in outputs))
        out.meta[OUTPUTS] = [r for _, r in outputs]
        return fx.GraphModule(torch.nn.Module(), self.graph)


def param(index: int, shape: tuple, world: int = 2, dtype: torch.dtype = torch.float32, **kw) -> ParamInfo:
    return ParamInfo(index, (f"p{index}",), tuple(shape), dtype, True, shard=ShardSpec(tuple(shape), world), **kw)


def context(
    params: tuple[ParamInfo, ...] = (), world: int = 2, rank: int = 0, group: str = GROUP, backend: str | None = None
) -> PassContext:
    return PassContext(world_size=world, rank=rank, group_name=group, params=params, backend=backend)


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def count(gm: fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is target)


def grad_step() -> fx.GraphModule:
    """A backward that adds a rank-local gradient contribution of parameter 0 (marked) to the ``.grad`` it got."""
    b = Builder()
    g = b.input("g", (8, 4), "grad", 0)
    local = b.op(aten.mul.Tensor, b.input("x", (8, 4)), 2.0, phase=BACKWARD)
    marked = b.op(GRAD_CONTRIBUTION, local, 0, phase=BACKWARD)
    new_grad = b.op(aten.add.Tensor, g, marked, phase=BACKWARD)
    return b.finish([(new_grad, GraphOutput("grad", "p0", 0))])
