"""Split mode, running side: the forward graph runs in the step call, inside an ``autograd.Function`` whose
backward runs the compiled backward graph (see ``zgraph.capture.joint``, ``zgraph.passes.partition`` and
``zgraph.compile.lower``).

The Function's inputs are an empty anchor leaf (so the outputs require grad even when only parameters do) and
the step's tensors that require grad (their gradients are what the backward returns: they flow upstream or land
in ``.grad``, as eager). Saved values are kept with ``ctx.save_for_backward``: PyTorch frees them after the
backward (unless ``retain_graph=True``) or when the outputs are dropped, and raises its own error on a second
backward. Parameter gradients are added to ``.grad`` in the layout the step stores it (whole at stage 0/1, the
rank's shard at 2/3), unless the backward is a ``torch.autograd.grad`` call that does not ask for them.

On several ranks the backward's collectives run outside the step call, so the backward takes part in the failure
protocol itself (``zgraph.runtime.agreement``): before its first collective the ranks compare a fingerprint of
the backward they are about to run (one tiny all-gather, as a step call does), so a rank that is elsewhere —
calling the step again after dropping its outputs, or backpropagating another call — makes every rank raise
``RankMismatchError`` instead of pairing mismatched collectives (gloo aborts the process on those); a rank that
fails or dies during it makes the others raise ``RankFailedError`` naming it, within ``Config.collective_timeout``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from zgraph.compile.run import finish_call, hosted, run_offloaded, unalias
from zgraph.compile.variant import CompiledStep, SplitCompiled
from zgraph.errors import ZGraphError
from zgraph.graph import GraphInput, GraphOutput, input_specs, state_key
from zgraph.runtime.agreement import Channel
from zgraph.runtime.consistency import check_same_graph, digest
from zgraph.runtime.executor import Executable
from zgraph.runtime.sharded_state import sharding_of
from zgraph.runtime.state import Binding
from zgraph.runtime.state_io import StateIO


@dataclass(frozen=True)
class Peers:
    """The other ranks of one call of a split step: where its backward agrees with them (``channel``, and the
    group and device of the fingerprint all-gather) and the call's label (``call 3 of step `encode` ``)."""

    channel: Channel
    group_name: str | None
    device: torch.device
    label: str


class _Call:
    """One call of a split step: what its backward needs besides the saved values."""

    def __init__(
        self,
        compiled: CompiledStep,
        split: SplitCompiled,
        binding: Binding,
        user_tensors: list[tuple[str, Tensor]],
        name: str,
        anchor: Tensor,
        peers: Peers | None,
    ):
        self.compiled = compiled
        self.split = split
        self.peers = peers
        self.binding = binding
        self.user_tensors = user_tensors
        self.name = name
        self.params = [(r.tensor, tuple(r.tensor.shape)) for r in binding.params]
        self.plan = binding.plan
        self.anchor_node = anchor.view_as(anchor).grad_fn.next_functions[0][0]
        self.others: list[Tensor] = []

    def check(self) -> None:
        """Raise if the parameters changed shape, were replaced or resharded since the forward ran."""
        current = {id(p) for _, root in self.binding.modules for p in root.parameters()}
        plans = [o[0] for _, root in self.binding.modules if (o := sharding_of(root)) is not None]
        resharded = any(p.stage != self.plan.stage or p.group != self.plan.group for p in plans)
        changed = [t for t, shape in self.params if id(t) not in current or tuple(t.shape) != shape]
        if changed or resharded:
            raise ZGraphError(
                f"backward of an output of step `{self.name}`: its parameters changed shape or ZeRO stage since "
                "the step ran, so its compiled backward no longer applies. Run the step again and backpropagate "
                "through its new outputs."
            )


class _SplitFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, call: _Call, anchor: Tensor, *grad_inputs: Tensor) -> tuple[Tensor, ...]:
        split = call.split
        io = StateIO(call.binding, call.binding.plan)
        inputs = [io.read(spec, call.user_tensors, {}) for spec in split.forward_specs]
        outputs = list(_run(call, io, split.forward, split.forward_reloads, inputs))
        n_out = len(outputs) - split.n_saved
        head = outputs[:n_out]
        unalias(head, inputs, split.forward.updated_inputs)
        outputs[:n_out] = head
        user_values = []
        for value, role in zip(outputs[:n_out], split.forward_roles):
            if role.kind == "user":
                user_values.append(value)
            else:
                io.write(role, value, call.user_tensors)
        ctx.call = call
        saved = outputs[n_out:]  # tensors, and the sizes a graph with symbolic sizes passes its backward
        ctx.save_for_backward(*(t for t in saved if isinstance(t, Tensor)))
        ctx.sizes = [(i, n) for i, n in enumerate(saved) if not isinstance(n, Tensor)]
        positions = split.info.positions
        call.others = user_values
        returned = [user_values[p] for p in positions]
        # an output that is one of the Function's inputs: autograd needs a tensor of its own
        return tuple(t.clone() if any(t is i for i in grad_inputs) else t for t in returned)

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Tensor) -> tuple:
        call: _Call = ctx.call
        saved = list(ctx.saved_tensors)  # PyTorch's own error when a first backward already freed them
        for i, n in ctx.sizes:
            saved.insert(i, n)
        call.check()
        split = call.split
        try:
            write_params = torch._C._will_engine_execute_node(call.anchor_node)
        except RuntimeError:
            write_params = True
        tangents = [g.contiguous() for g in grads]
        io = StateIO(call.binding, call.binding.plan)
        run = lambda: list(_run(call, io, split.backward, split.backward_reloads, [*saved, *tangents]))
        outputs = run() if call.peers is None else _agreed(call, call.peers, run)
        input_grads: dict[int, Tensor] = {}
        for value, role in zip(outputs, split.backward_roles):
            if role.kind == "input_grad":
                input_grads[role.index] = value
            elif role.kind == "grad" and write_params:
                _accumulate(io, call.binding, role, value, call.user_tensors)
        return (None, None, *(input_grads.get(i) for i in split.info.grad_inputs))


def _run(call: _Call, io: StateIO, executable: Executable, reloads: tuple[int, ...], inputs: list) -> Sequence:
    """Run one of the two graphs; with offloaded parameters, with the offload tier serving its reload nodes
    (their slots are the joint graph's input positions: each one's tensor is read from the live state)."""
    store = getattr(call.binding, "offload", None)
    graph = hosted(call.binding, executable, inputs)
    if store is None or not reloads:
        return graph()
    specs = input_specs(call.compiled.transformed)
    slots = {i: (state_key(specs[i]), io.read(specs[i], call.user_tensors, {})) for i in reloads}
    return run_offloaded(store, reloads, slots, inputs, graph)


def _agreed(call: _Call, peers: Peers, run: Callable[[], list]) -> list:
    """``run()``, the backward graph, once every rank agreed to run the same backward (module docstring); a
    failure while it runs marks the group broken and is recorded for the other ranks, as a step call's is."""
    channel, label = peers.channel, f"backward of {peers.label}"
    split, lines = call.split, [*call.compiled.description, "the backward of the step"]
    if split.backward_digest is None:
        split.backward_digest = digest(lines)
    channel.enter(label)
    check_same_graph(channel, peers.group_name, label, split.backward_digest, lines, device=peers.device)
    try:
        return run()
    except Exception as error:
        failure = channel.failed_running(label, error)
        channel.record_failure(label, failure)
        if failure is error:
            raise
        raise failure from error


def _accumulate(io: StateIO, binding: Binding, role: GraphOutput, value: Tensor, user_tensors: list) -> None:
    """Add a parameter's gradient to its ``.grad`` (in the layout the step stores it), as eager accumulates."""
    if binding.params[role.index].tensor.grad is not None:
        current = io.read(GraphInput("grad", role.name, role.index, layout=role.layout), user_tensors, {})
        value = current + value
    io.write(role, value, user_tensors)


def run_split(
    compiled: CompiledStep,
    split: SplitCompiled,
    binding: Binding,
    user_tensors: list[tuple[str, Tensor]],
    name: str,
    peers: Peers | None = None,
) -> object:
    """Run a split step's forward; returns the step's result, its tensors that carry a ``grad_fn`` as outputs
    of the step's autograd Function. ``peers``: the call's other ranks (None: one process)."""
    info = split.info
    anchor = torch.empty(0, requires_grad=True)
    call = _Call(compiled, split, binding, user_tensors, name, anchor, peers)
    grad_inputs = [user_tensors[i][1] for i in info.grad_inputs]
    outs = _SplitFunction.apply(call, anchor, *grad_inputs)
    values: list[Tensor] = list(call.others)
    call.others = []
    for position, out in zip(info.positions, outs):
        values[position] = out
    return finish_call(compiled, binding, user_tensors, values, grads=False)
