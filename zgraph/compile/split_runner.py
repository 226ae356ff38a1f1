"""Split mode, running side: the forward graph runs in the step call, inside an ``autograd.Function`` whose
backward runs the compiled backward graph (see ``zgraph.capture.joint`` and ``zgraph.passes.partition``).

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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from zgraph.compile.variant import _unalias, finish_call, lower, reload_slots, run_offloaded
from zgraph.errors import ZGraphError
from zgraph.graph import GraphInput, GraphOutput, input_specs, output_roles, state_key
from zgraph.passes import PassRecord
from zgraph.passes.partition import partition
from zgraph.runtime.agreement import Channel, is_collective_failure, mark_broken
from zgraph.runtime.consistency import check_same_graph, digest
from zgraph.runtime.executor import Executable
from zgraph.runtime.sharded_state import StateIO, sharding_of
from zgraph.runtime.state import Binding


@dataclass
class SplitCompiled:
    """The compiled forward and backward graphs of a split step."""

    forward: Executable
    backward: Executable
    forward_records: list[PassRecord]
    backward_records: list[PassRecord]
    forward_specs: list[GraphInput]
    forward_roles: list[GraphOutput]
    backward_roles: list[GraphOutput]
    n_saved: int
    partitioned: dict[str, fx.GraphModule] = field(default_factory=dict)
    forward_reloads: tuple[int, ...] = ()  # the input slots (of the joint graph) each graph's reloads read
    backward_reloads: tuple[int, ...] = ()
    backward_digest: int | None = None  # the fingerprint the ranks compare before a backward (set on first use)


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
        self, compiled: Any, binding: Binding, user_tensors: list, name: str, anchor: Tensor, peers: Peers | None
    ):
        self.compiled = compiled
        self.peers = peers
        self.binding = binding
        self.user_tensors = user_tensors
        self.name = name
        self.params = [(r.tensor, tuple(r.tensor.shape)) for r in binding.params]
        self.plan = binding.plan
        self.anchor_node = anchor.view_as(anchor).grad_fn.next_functions[0][0]
        self.others: list[Any] = []

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
    def forward(ctx: Any, call: _Call, anchor: Tensor, *grad_inputs: Tensor) -> tuple[Tensor, ...]:
        compiled = call.compiled
        split: SplitCompiled = compiled.split
        io = StateIO(call.binding, call.binding.plan)
        inputs = [io.read(spec, call.user_tensors, {}) for spec in split.forward_specs]
        outputs = list(_run(call, io, split.forward, split.forward_reloads, inputs))
        n_out = len(outputs) - split.n_saved
        head = outputs[:n_out]
        _unalias(head, inputs, split.forward.updated_inputs)
        outputs[:n_out] = head
        user_values = []
        for value, role in zip(outputs[:n_out], split.forward_roles):
            if role.kind == "user":
                user_values.append(value)
            else:
                io.write(role, value, call.user_tensors)
        ctx.call = call
        ctx.save_for_backward(*outputs[n_out:])
        positions = compiled.captured.split.positions
        call.others = user_values
        returned = [user_values[p] for p in positions]
        # an output that is one of the Function's inputs: autograd needs a tensor of its own
        return tuple(t.clone() if any(t is i for i in grad_inputs) else t for t in returned)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple:
        call: _Call = ctx.call
        saved = ctx.saved_tensors  # PyTorch's own error when a first backward already freed them
        call.check()
        split: SplitCompiled = call.compiled.split
        info = call.compiled.captured.split
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
        return (None, None, *(input_grads.get(i) for i in info.grad_inputs))


def _run(call: _Call, io: StateIO, executable: Executable, reloads: tuple[int, ...], inputs: list) -> Any:
    """Run one of the two graphs; with offloaded parameters, with the offload tier serving its reload nodes
    (their slots are the joint graph's input positions: each one's tensor is read from the live state)."""
    store = getattr(call.binding, "offload", None)
    if store is None or not reloads:
        return executable.run(inputs)
    specs = input_specs(call.compiled.transformed)
    slots = {i: (state_key(specs[i]), io.read(specs[i], call.user_tensors, {})) for i in reloads}
    return run_offloaded(store, reloads, slots, inputs, lambda: executable.run(inputs))


def _agreed(call: _Call, peers: Peers, run: Callable[[], list]) -> list:
    """``run()``, the backward graph, once every rank agreed to run the same backward (module docstring); a
    failure while it runs marks the group broken and is recorded for the other ranks, as a step call's is."""
    channel, label = peers.channel, f"backward of {peers.label}"
    split, lines = call.compiled.split, [*call.compiled.description, "the backward of the step"]
    if split.backward_digest is None:
        split.backward_digest = digest(lines)
    channel.enter(label)
    check_same_graph(channel, peers.group_name, label, split.backward_digest, lines, device=peers.device)
    try:
        return run()
    except Exception as error:
        if channel.failures(wait=0.0) or is_collective_failure(error):
            named = channel.peer_failure(label, error)
            channel.record_failure(label, named)
            raise named from error
        mark_broken(channel.group, f"rank {channel.rank} failed in {label}: {type(error).__name__}: {error}")
        channel.record_failure(label, error)
        raise


def _accumulate(io: StateIO, binding: Binding, role: GraphOutput, value: Tensor, user_tensors: list) -> None:
    """Add a parameter's gradient to its ``.grad`` (in the layout the step stores it), as eager accumulates."""
    if binding.params[role.index].tensor.grad is not None:
        current = io.read(GraphInput("grad", role.name, role.index, layout=role.layout), user_tensors, {})
        value = current + value
    io.write(role, value, user_tensors)


def run_split(compiled: Any, binding: Binding, user_tensors: list, name: str, peers: Peers | None = None) -> Any:
    """Run a split step's forward; returns the step's result, its tensors that carry a ``grad_fn`` as outputs
    of the step's autograd Function. ``peers``: the call's other ranks (None: one process)."""
    info = compiled.captured.split
    anchor = torch.empty(0, requires_grad=True)
    call = _Call(compiled, binding, user_tensors, name, anchor, peers)
    grad_inputs = [user_tensors[i][1] for i in info.grad_inputs]
    outs = _SplitFunction.apply(call, anchor, *grad_inputs)
    values = list(call.others)
    call.others = []
    for position, out in zip(info.positions, outs):
        values[position] = out
    return finish_call(compiled, binding, user_tensors, values, grads=False)


def lower_split(transformed: fx.GraphModule, ctx: Any, backend: str, info: Any) -> SplitCompiled:
    """Partition a split step's transformed joint graph (``zgraph.passes.partition``) and lower both halves."""
    part = partition(transformed, set(info.tangents))
    forward_records, forward = lower(part.forward, ctx, backend)
    backward_records, backward = lower(part.backward, ctx, backend)
    return SplitCompiled(
        forward,
        backward,
        forward_records,
        backward_records,
        input_specs(forward_records[-1].gm),
        output_roles(forward_records[-1].gm),
        output_roles(backward_records[-1].gm),
        part.n_saved,
        {"forward": part.forward, "backward": part.backward},
        reload_slots(forward_records[-1].gm),
        reload_slots(backward_records[-1].gm),
    )
