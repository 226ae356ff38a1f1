"""``zgraph.runtime.sum_in_graph``: a stage graph's twin adding its gradient contributions into their sums, on a
small synthetic graph (each contribution's ``add_`` right after it is made, the sums written in place, the
contributions no longer returned), and the twins a pipelined step runs on the eager backend."""

from __future__ import annotations

import torch
import torch.fx as fx
from pipeline_cases import LR, Net, batches, step

import zgraph
from zgraph.graph import INPUT, OUTPUTS, VAL, GraphInput, GraphOutput, input_specs, output_node, output_roles
from zgraph.runtime.sum_in_graph import summing_variant

aten = torch.ops.aten


def backward_like() -> fx.GraphModule:
    """``(saved, grad) -> (grad * saved [contribution w], grad [contribution b, an input], grad + 1 [sent on])``."""
    graph = fx.Graph()
    saved, grad = graph.placeholder("saved"), graph.placeholder("grad")
    saved.meta[INPUT], grad.meta[INPUT] = GraphInput("saved", "saved", 0), GraphInput("activation_grad", "grad", 0)
    weight = graph.call_function(aten.mul.Tensor, (grad, saved))
    sent = graph.call_function(aten.add.Tensor, (grad, 1))
    out = graph.output((weight, grad, sent))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    for node in (saved, grad, weight, sent):
        node.meta[VAL] = torch.empty(3)
    out.meta[OUTPUTS] = [
        GraphOutput("grad_contribution", "w", 0),
        GraphOutput("grad_contribution", "b", 1),
        GraphOutput("activation_grad", "grad", 0),
    ]
    return gm


def test_each_contribution_is_added_into_its_sum_as_soon_as_it_is_made():
    gm = backward_like()
    twin = summing_variant(gm)
    assert twin is not None
    specs = input_specs(twin)
    assert [(s.kind, s.name, s.index) for s in specs[2:]] == [("grad_sum", "w", 0), ("grad_sum", "b", 1)]
    assert [r.kind for r in output_roles(twin)] == ["activation_grad"]
    nodes = list(twin.graph.nodes)
    for i, node in enumerate(nodes):
        if node.target is aten.add_.Tensor and node.args[1].op != "placeholder":
            assert nodes[i - 1] is node.args[1] and node.args[1].target is aten.mul.Tensor  # right after it is made
    assert sum(node.target is aten.add_.Tensor for node in nodes) == 2
    saved, grad = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.5, 2.0])
    sums = [torch.ones(3), torch.full((3,), 10.0)]
    (sent,) = twin(saved, grad, *sums)
    torch.testing.assert_close(sums[0], 1 + grad * saved)
    torch.testing.assert_close(sums[1], 10 + grad)
    torch.testing.assert_close(sent, grad + 1)
    assert [r.kind for r in output_roles(gm)].count("grad_contribution") == 2, "the graph itself is unchanged"
    assert len(output_node(gm).args[0]) == 3


def test_a_graph_without_contributions_has_no_twin():
    gm = backward_like()
    output_node(gm).meta[OUTPUTS] = [GraphOutput("user", "", i) for i in range(3)]
    assert summing_variant(gm) is None


def test_a_pipelined_step_runs_the_twins_after_the_first_micro_batch_and_equals_eager():
    """One process, 2 stages (interleaved 1F1B), 4 micro-batches, eager backend: each stage's backward runs as
    itself for the first micro-batch and as its summing twin for the 3 others; parameters as eager's."""
    config = zgraph.Config(backend="eager", pipeline_parallel=1, pipeline_virtual_stages=2,
                           schedule="interleaved_1f1b", microbatches=4)  # fmt: skip
    eager, model = Net(), Net()
    model.load_state_dict(eager.state_dict())
    eager_opt, opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (eager, model))
    compiled = zgraph.distribute(config)(step)
    x, y = batches()[0]
    compiled(model, opt, x, y)
    step(eager, eager_opt, x, y)
    stages = compiled._compiled().pipeline.stages
    calls = {"plain": 0, "twin": 0}
    for stage in stages.values():
        for kind, part in (("plain", stage.backward), ("twin", stage.summing["backward"])):
            part.run = _counted(part.run, calls, kind)
    for x, y in batches()[1:3]:
        compiled(model, opt, x, y)
        step(eager, eager_opt, x, y)
    assert calls == {"plain": 2 * 2, "twin": 2 * 2 * 3}, calls  # 2 steps x 2 stages (x 3 micro-batches)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def _counted(run, calls: dict[str, int], kind: str):
    def counted(inputs):
        calls[kind] += 1
        return run(inputs)

    return counted
