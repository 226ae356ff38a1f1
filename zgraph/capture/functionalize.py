"""The step traced as a functional graph, then named and tagged: the captured step graph.

The step runs under functionalization while ``make_fx`` traces it (``functionalized``): in-place ops reach the
trace as their functional forms, views as views of the new values, so the one trace yields a graph that mutates
nothing (as AOTAutograd traces under functionalization). Autograd runs above functionalization, as in eager. The
traced step returns every piece of state; nothing is written back into the inputs. Then (``functional_step``):
placeholders get their ``GraphInput`` and readable names, outputs their ``GraphOutput`` (state the step did not
change is dropped), eager's random fill order is restored (``zgraph.capture.random_layout``) and every op gets its
phase.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator

import torch
import torch.fx as fx
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from zgraph.capture.random_layout import RecordingFills, match_random_layout
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


def functionalized(fn: Callable[..., list[object]]) -> Callable[..., list[object]]:
    """``fn`` run under functionalization (torch's ``FunctionalTensorMode``, as AOTAutograd traces; in-place random
    fills recorded: ``zgraph.capture.random_layout``): its tensor inputs wrapped as functional tensors (leaves that
    require grad where the inputs do: autograd runs above functionalization, as in eager), its outputs unwrapped.
    Traced by ``make_fx``, the graph is functional: in-place ops become their functional forms and each mutated
    input's new value is the output that names it (the caller returns every piece of state; nothing is written
    back). Libraries see the functional tensors as traced (``libraries_see_the_trace``)."""

    def run(*flat: object) -> list[object]:
        with RecordingFills() as mode, libraries_see_the_trace():
            outs = fn(*[_to_functional(t, mode) for t in flat])
            return [_from_functional(o) for o in outs]

    return run


@contextlib.contextmanager
def libraries_see_the_trace() -> Iterator[None]:
    """Libraries that tell a trace by its fake tensors see the step's functional tensors (over fakes) as traced too:
    transformers' ``is_tracing(tensor)``, which skips value checks such as ``torch.all(mask == 1)`` under a trace,
    asks ``is_fake_tensor``. (Torch's own make_fx-based export says "tracing" by ``torch.compiler.is_compiling()``
    instead, which would also change the code torch.optim runs.) A library the process has not loaded is left
    alone."""
    module = sys.modules.get("transformers.utils.import_utils")
    original = getattr(module, "is_fake_tensor", None)
    if original is None:
        yield
        return
    module.is_fake_tensor = lambda x: isinstance(x, FunctionalTensor) or original(x)
    try:
        yield
    finally:
        module.is_fake_tensor = original


def _to_functional(t: object, mode: FunctionalTensorMode) -> object:
    if not isinstance(t, Tensor):
        return t
    return FunctionalTensor(torch._to_functional_tensor(t), mode).requires_grad_(t.requires_grad)


def _from_functional(t: object) -> object:
    if not isinstance(t, FunctionalTensor):
        return t
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)


def unwrapped(t: object) -> object:
    """The traced tensor a functional tensor stands for (its current value); anything else as it is."""
    return _from_functional(t) if isinstance(t, FunctionalTensor) else t


def functional_step(gm: fx.GraphModule, specs: list[GraphInput], roles: list[GraphOutput]) -> fx.GraphModule:
    """The captured step graph from the functional trace ``gm`` (see the module docstring); ``specs``: its inputs,
    ``roles``: its outputs before unchanged state is dropped. Rewrites ``gm`` in place and returns it."""
    graph = gm.graph
    graph._codegen = fx.graph.CodeGen()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, specs):
        node.meta[INPUT] = spec
    output = output_node(gm)
    values = list(output.args[0])
    profiler_nodes = [n for n in graph.nodes if n.op == "call_function" and str(n.target).startswith("profiler.")]
    for node in reversed(profiler_nodes):  # record_function enter/exit from torch.optim: no effect on values
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
    match_random_layout(gm)  # eager's random fill order on non-contiguous tensors
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
