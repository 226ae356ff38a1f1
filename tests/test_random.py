"""Random numbers drawn inside the step equal eager PyTorch's, element for element (``zgraph.capture.random_layout``).

Eager in-place random ops fill a tensor in its memory order; on a non-contiguous activation (a transposed view)
functionalization's ``bernoulli.p`` used to fill a contiguous tensor instead, so dropout masks landed on other
elements. Each test seeds the global generator identically before the zgraph call and the eager one, compares
everything bitwise and the generator state after the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from parity import run_parity
from torch import nn

import zgraph

# each maps a non-contiguous activation to a tensor of its shape, drawing random numbers on the way
RANDOM_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "dropout": lambda h: F.dropout(h, 0.3),
    "rand_like": lambda h: h * torch.rand_like(h),
    "randn_like": lambda h: h + 0.1 * torch.randn_like(h),
    "bernoulli_": lambda h: h * torch.empty_like(h).bernoulli_(0.7),
    # out of place: eager's result is contiguous whatever the input's strides; must stay so
    "bernoulli(probs)": lambda h: h * torch.bernoulli(torch.full_like(h, 0.6)),
    "bernoulli(probs, p)": lambda h: h * torch.bernoulli(torch.full_like(h, 0.6), 0.4),
    "dropout of a permuted view": lambda h: F.dropout(h.permute(2, 0, 1), 0.2).permute(1, 2, 0),
    # aten.random_.from: FX cannot print its name (`from` is a keyword); traced as random_(to - from) + from
    "random_(from, to)": lambda h: h * torch.empty_like(h).random_(-2, 5),
}


class Transposed(nn.Module):
    """A linear layer applied to ``x.transpose(0, 1)`` and transposed back: its output is not contiguous."""

    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32)
        self.head = nn.Linear(32, 3)
        self.op = op

    def forward(self, x):
        h = self.a(x.transpose(0, 1)).transpose(0, 1)
        return self.head(self.op(h))


def square_loss_step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _inputs(n: int = 3) -> list[tuple]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 6, 32, generator=g),) for _ in range(n)]


@pytest.mark.parametrize("name", list(RANDOM_OPS))
def test_random_ops_on_a_transposed_activation_match_eager_bitwise(name):
    def make():
        model = Transposed(RANDOM_OPS[name])
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    run_parity(square_loss_step, make, _inputs(), seed=10)


def test_transformer_encoder_layer_batch_first_dropout_matches_eager_bitwise():
    """``nn.TransformerEncoderLayer(batch_first=True)``: dropout1 runs on the attention output, a transposed
    view."""

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
            self.head = nn.Linear(32, 3)

        def forward(self, x):
            return self.head(self.layer(x))

    def make():
        model = Encoder()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor is False with batch_first=... (torch's own warning)
        run_parity(square_loss_step, make, _inputs(), seed=20)


def test_graph_strides_are_those_the_eager_backend_computes():
    """Later passes decide copies by ``meta["val"]`` strides: after the rewrite (the mask and values computed
    from it change strides) they must still be what running the graph gives."""
    model = Transposed(RANDOM_OPS["dropout"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zgraph.distribute(zgraph.Config(backend="eager"))(square_loss_step)
    (x,) = _inputs(1)[0]
    step(model, opt, x)
    gm = step.graphs["captured"]
    assert any(n.target is torch.ops.aten.bernoulli.p for n in gm.graph.nodes)
    mismatches = []

    class Check(torch.fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            val = node.meta.get("val")
            if isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor) and out.numel() > 1:
                if out.stride() != val.stride():
                    mismatches.append((node.name, out.stride(), val.stride()))
            return out

    # any values of the inputs' shapes and dtypes do: strides do not depend on them
    vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    Check(gm).run(*[torch.rand(v.shape, dtype=v.dtype) for v in vals])
    assert not mismatches, mismatches


class _Kernel:
    def __init__(self, op):
        self.op_overload = op


class _SchedulerNode:
    """What ``KeepGeneratorOrder`` reads of an inductor scheduler node: the op it runs, its buffers, its reads."""

    def __init__(self, name: str, op):
        self.node, self.name, self.deps = _Kernel(op), name, []

    def get_nodes(self):
        return [self]

    def get_buffer_names(self):
        return {self.name}

    def add_fake_dep(self, dep):
        self.deps.append(dep)


def test_inductor_scheduler_chains_the_generator_users_in_graph_order():
    """Issue 40 (``zgraph.runtime.random_order``): each node that draws, reads or sets the generator depends on the
    one before it (an ordering-only ``WeakDep`` naming its buffer); kernels that do not use it get no dependency."""
    from torch._inductor.dependencies import WeakDep

    from zgraph.runtime.random_order import KeepGeneratorOrder

    aten, zg = torch.ops.aten, torch.ops.zgraph
    ops = [aten.mm.default, aten.bernoulli_.float, zg.rng_state.default, aten.add.Tensor, zg.set_rng_state.default]
    nodes = [_SchedulerNode(f"buf{i}", op) for i, op in enumerate(ops)]
    assert KeepGeneratorOrder()(nodes) is nodes
    assert [n.deps for n in nodes] == [
        [],
        [],
        [WeakDep("buf1", mutating_buf="buf2", is_fake=True)],
        [],
        [WeakDep("buf2", mutating_buf="buf4", is_fake=True)],
    ]
    assert KeepGeneratorOrder().uuid() == KeepGeneratorOrder().uuid()  # a stable key for inductor's cache
