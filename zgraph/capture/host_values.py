"""Host counters: 0-d integer buffers a step may branch on, because their values are known on the host.

A module's step counter — ``AveragedModel.n_averaged``, whose ``update_parameters`` copies on the first call
(``n_averaged == 0``) and averages on later ones; BatchNorm's ``num_batches_tracked`` — is a 0-d integer buffer
the step itself advances. zgraph reads its value from the real buffer (where ``AveragedModel`` keeps it: on the
host) when it captures, and the traced step sees that value: a Python branch or conversion on a value computed
from counters alone (``bool(n == 0)``, ``int(n)``) takes the path eager would, and is recorded as a ``HostRead``,
the small graph that computes the value from the counters. The step's graph still reads and advances the counters
as inputs and outputs. On every later call each recorded value is computed again from the counters as they are
then (``HostRead.now``); a call on which one differs runs another capture of the step, kept beside the first (so
``update_parameters`` is captured twice: its first call, and every later one).

A value that depends on anything else — a loss, a parameter, a counter advanced by a data-dependent amount is
still a counter, but ``loss.item() > 1`` is not — is known only on the device once the graph runs: Python cannot
branch on it inside a step, and the trace fails as before (``zgraph.capture.diagnosis``).

How: the trace's proxy tracker holds the counters' real values as *constants* (make_fx's own constant
propagation, which it uses for ``torch.tensor(...)`` literals): every op on constants only computes its constant
too, and a read to the host of a constant (``aten._local_scalar_dense``) returns it instead of failing. A dispatch
mode (only while a step with counters is traced) records those reads and cuts each one's graph out of the trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import (
    _ProxyTensor,
    disable_proxy_modes_tracing,
    get_proxy_mode,
    get_proxy_slot,
    set_proxy_slot,
)
from torch.utils._python_dispatch import TorchDispatchMode

from zgraph.errors import CaptureError
from zgraph.graph import GraphInput
from zgraph.ops import host_read
from zgraph.runtime.state import Binding

aten = torch.ops.aten
_READS = (aten._local_scalar_dense.default, aten.item.default)


def is_counter(spec: GraphInput, value: Tensor) -> bool:
    """Whether graph input ``spec`` holding ``value`` is a host counter: a 0-d integer (or bool) buffer."""
    if spec.kind != "buffer" or not isinstance(value, Tensor) or value.dim() != 0 or value.is_meta:
        return False
    return not value.is_floating_point() and not value.is_complex()


@dataclass(frozen=True, eq=False)
class HostRead:
    """A value the traced step read to the host, computed from host counters only.

    Attributes:
        code: the Python code of ``graph`` (with ``buffers``, what makes two reads the same read).
        buffers: the binding's buffer indices of the counters ``graph`` reads, in its placeholders' order.
        graph: computes the value (a 0-d tensor) from the counters.
    """

    code: str
    buffers: tuple[int, ...]
    graph: fx.GraphModule

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return self.code, self.buffers

    def now(self, binding: Binding) -> bool | int | float:
        """The value this read would return now, from the binding's counters as they are (a counter kept on a
        device is read from there: keep counters on the host, where ``AveragedModel`` puts its own)."""
        counters = [binding.buffers[i].get() for i in self.buffers]
        if any(t.device.type != "cpu" for t in counters):
            with host_read("a host counter kept on a device"):
                counters = [t.cpu() for t in counters]
        return self.graph(*(t.clone() for t in counters)).item()  # copies: the graph may advance them in place


def merge_reads(known: list[HostRead], new: Sequence[HostRead]) -> None:
    """Add to ``known`` the reads of ``new`` it does not hold yet (by ``HostRead.key``)."""
    keys = {r.key for r in known}
    for read in new:
        if read.key not in keys:
            keys.add(read.key)
            known.append(read)


@contextlib.contextmanager
def counters_known(
    specs: Sequence[GraphInput], values: Sequence[Tensor], traced: Sequence[Tensor]
) -> Iterator[list[HostRead]]:
    """While the step is traced (inside ``make_fx``): the counters among the graph inputs ``specs`` (real
    ``values``, ``traced`` stand-ins) carry their values as trace constants; yields the list of ``HostRead`` the
    step makes, filled as it runs. Nothing is installed when no input is a counter."""
    reads: list[HostRead] = []
    counters = [i for i, (spec, value) in enumerate(zip(specs, values)) if is_counter(spec, value)]
    mode = get_proxy_mode()
    if not counters or mode is None:
        yield reads
        return
    tracer = mode.tracer
    buffer_of: dict[fx.Node, int] = {}
    for i in counters:
        slot = get_proxy_slot(traced[i], tracer)
        with host_read("a host counter's value, read once per capture"), _real():
            constant = values[i].detach().cpu().clone()
        set_proxy_slot(traced[i], tracer, _ProxyTensor(slot.proxy, constant))
        buffer_of[slot.proxy.node] = specs[i].index
    with _RecordReads(tracer, buffer_of, reads):
        yield reads


@contextlib.contextmanager
def _real() -> Iterator[None]:
    """Real tensors, not traced ones: neither the fake mode nor the tracer sees what runs inside."""
    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


class _RecordReads(TorchDispatchMode):
    """Records each read to the host of a value the trace knows as a constant (computed from counters)."""

    def __init__(self, tracer: fx.Tracer, buffer_of: dict[fx.Node, int], reads: list[HostRead]):
        super().__init__()
        self.tracer = tracer
        self.buffer_of = buffer_of
        self.reads = reads

    def __torch_dispatch__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.is_nonzero.default and args[0].numel() == 1:  # bool(t): the read of `t != 0` (make_fx's)
            return bool(self._read(aten.ne.Scalar(args[0], 0)))
        if func in _READS:
            return self._read(args[0])
        return func(*args, **kwargs)

    def _read(self, t: Tensor) -> bool | int | float:
        tracked = get_proxy_slot(t, self.tracer, None)
        value = aten._local_scalar_dense.default(t)  # the constant's value, or make_fx's data-dependent failure
        if tracked is not None and tracked.constant is not None:
            read = _cut(tracked.proxy.node, self.buffer_of, self.tracer.root)
            if read.buffers:  # a value of literals only is the same on every call
                self.reads.append(read)
        return value


def _cut(node: fx.Node, buffer_of: dict[fx.Node, int], root: torch.nn.Module) -> HostRead:
    """The ``HostRead`` of ``node``: the part of the trace that computes it from the counters (and the trace's
    literal tensors, held by ``root``), as its own graph."""
    needed: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        if n.op == "placeholder" and n not in buffer_of or n.op not in ("placeholder", "call_function", "get_attr"):
            raise CaptureError(
                f"the step reads a value to the host that zgraph cannot recompute from its host counters (it "
                f"reads `{n.name}`); branch on counters and Python numbers only, or compute it with tensor ops"
            )
        needed.add(n)
        todo.extend(n.all_input_nodes)
    owner = torch.nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = sorted((n for n in needed if n.op == "placeholder"), key=lambda n: buffer_of[n])
    for n in inputs:
        env[n] = graph.placeholder(f"counter{buffer_of[n]}")
    for n in node.graph.nodes:  # graph order is an order that computes inputs first
        if n in needed and n.op == "get_attr":
            setattr(owner, n.target, getattr(root, n.target))
        if n in needed and n.op != "placeholder":
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[node])
    gm = fx.GraphModule(owner, graph)
    literals = "".join(f"\n# {n.target} = {getattr(owner, n.target).tolist()}" for n in needed if n.op == "get_attr")
    return HostRead(gm.code + literals, tuple(buffer_of[n] for n in inputs), gm)
