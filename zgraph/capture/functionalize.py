"""From the traced (mutating) graph to the captured step graph: functionalization, then naming and phases.

The graph ``make_fx`` traced still mutates its inputs in place; it is traced again through
``torch.func.functionalize``, so every change of state becomes an output. Then: placeholders get their
``GraphInput`` and readable names, outputs their ``GraphOutput`` (state the step did not change is dropped),
eager's random fill order is restored (``zgraph.capture.random_layout``) and every op gets its phase.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import traceback as fx_traceback
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from zgraph.capture.host_scalars import replay
from zgraph.capture.random_layout import match_random_layout
from zgraph.graph import (
    BACKWARD,
    CUSTOM,
    FORWARD,
    INPUT,
    OPTIMIZER,
    OUTPUTS,
    PHASE,
    GraphInput,
    GraphOutput,
    eliminate_dead_code,
    output_node,
    state_key,
)

aten = torch.ops.aten


def functionalize(
    gm1: fx.GraphModule, specs: list[GraphInput], fakes: list[Tensor], mode: FakeTensorMode, roles: list[GraphOutput]
) -> fx.GraphModule:
    """The functional step graph of ``gm1`` (see the module docstring); ``specs``: its inputs, ``roles``: its
    outputs before unchanged state is dropped."""

    def traced(*flat: Tensor) -> Any:
        return replay(gm1, *flat)

    plain = [f.detach() for f in fakes]
    with fx_traceback.preserve_node_meta(), mode, _use_lazy_graph_module(True):
        gm = make_fx(torch.func.functionalize(traced, remove="mutations"), tracing_mode="fake")(*plain)
    graph = gm.graph
    graph._codegen = fx.graph.CodeGen()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, specs):
        node.meta[INPUT] = spec
    output = output_node(gm)
    values = list(output.args[0])
    # copy_ into inputs at the end is functionalization's write-back; the new values are already outputs.
    profiler_nodes = []
    for node in list(graph.nodes):
        if node.target is aten.copy_.default and node.args[0].op == "placeholder" and not node.users:
            graph.erase_node(node)
        elif node.op == "call_function" and str(node.target).startswith("profiler."):
            profiler_nodes.append(node)  # record_function enter/exit from torch.optim: no effect on values
    for node in reversed(profiler_nodes):
        graph.erase_node(node)
    kept_values, kept_roles = [], []
    placeholder_of = {state_key(n.meta[INPUT]): n for n in placeholders}
    for value, role in zip(values, roles):
        if role.kind != "user" and placeholder_of.get(state_key(role)) is value:
            continue  # state the step did not change
        kept_values.append(value)
        kept_roles.append(role)
    output.args = (tuple(kept_values),)
    output.meta[OUTPUTS] = kept_roles
    _name_placeholders(graph, placeholders)
    eliminate_dead_code(graph)
    match_random_layout(gm, gm1)  # eager's random fill order on non-contiguous tensors
    _tag_phases(graph)
    gm.recompile()
    return gm


def _tag_phases(graph: fx.Graph) -> None:
    """Give every op node ``meta["phase"]``.

    The trace tagged what ran inside an autograd backward call (``backward``) and inside ``optimizer.step()``
    or ``zero_grad()`` (``optimizer``). Of the rest, a node that reads gradients (it depends on a backward
    node or a ``.grad`` input) and feeds no backward node is gradient post-processing, such as
    ``clip_grad_norm_``, and belongs to ``optimizer``; everything else is ``forward``.
    """
    nodes = list(graph.nodes)
    for node in nodes:
        tagged = (node.meta.get(CUSTOM) or {}).get(PHASE)
        if tagged is not None:
            node.meta[PHASE] = tagged
    reads_grads: set[fx.Node] = set()
    for node in nodes:
        spec = node.meta.get(INPUT)
        if (spec is not None and spec.kind in ("grad", "input_grad")) or node.meta.get(PHASE) == BACKWARD:
            reads_grads.add(node)
        elif any(arg in reads_grads for arg in node.all_input_nodes):
            reads_grads.add(node)
    feeds_backward: set[fx.Node] = set()
    for node in reversed(nodes):
        if node.meta.get(PHASE) == BACKWARD or any(u in feeds_backward for u in node.users):
            feeds_backward.add(node)
    for node in nodes:
        if node.op == "call_function" and PHASE not in node.meta:
            node.meta[PHASE] = OPTIMIZER if node in reads_grads and node not in feeds_backward else FORWARD


def _readable_name(spec: GraphInput) -> str:
    if spec.kind in ("opt_state", "hparam"):
        owner = spec.name.rsplit(":", 1)[0]
        return f"{spec.field}_{owner}"
    if spec.kind == "grad":
        return f"grad_{spec.name}"
    if spec.kind == "loss_scale":
        return f"loss_scale_{spec.field}"
    return spec.name


def _name_placeholders(graph: fx.Graph, placeholders: list[fx.Node]) -> None:
    for node in placeholders:
        base = _readable_name(node.meta[INPUT])
        ident = re.sub(r"\W+", "_", base).strip("_") or "input"
        if ident[0].isdigit():
            ident = "_" + ident
        node._rename(ident)
        node.target = node.name
