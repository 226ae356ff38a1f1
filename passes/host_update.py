"""``host_update``: the optimizer update runs on the host (``Config.offload_update="host"``, ZeRO-Offload's way).

The parameters of ``PassContext.host_params`` keep their master value, their ``.grad`` on entry and their
optimizer state in host memory (the runtime put them there; capture traced them as device tensors). This pass says
where each node runs and moves values between the two places only where they must cross:

* **Placement.** Those placeholders and the optimizers' hyper-parameters are host values (fake values on the CPU,
  ``meta[PLACE] = HOST``). An optimizer-phase node that reads a host value runs on the host, and so does a dtype
  cast of a host value in any phase (the forward's cast to the compute dtype: what crosses is then in the compute
  dtype). Everything else — forward, backward, collectives, the global reductions over gradients — stays on the
  device.
* **To the host**: ``zgraph::to_host(x)``, once per device value host nodes read, right after ``x``: a gradient
  after its reduction (in the reduce dtype: a widening cast back to the master dtype moves after the copy), a
  clipping coefficient, an overflow flag. State outputs of host parameters are host values too.
* **To the device**: ``zgraph::to_device(h, device)``, once per host value with elements that device nodes read,
  right before the first (with ``per_region``: once per use region, as ``offload_params`` asks, so a stage-3 shard
  is on the device only around each use): a parameter in its compute dtype, kept from the forward for the
  backward's re-gather; an updated shard that stages 1 and 2 all-gather. Host 0-d values (hyper-parameters, step
  counters) are read by device kernels as they are, as before.
* **Order.** Each optimizer host node, and the ``to_host`` it reads, moves up to right after its inputs exist —
  but after every device-side read of the host state it reads —, so a gradient is updated while the backward goes
  on (the ``schedule`` pass, where it runs, keeps them there or earlier).

On one rank, the all-gather of an updated shard (``unshard`` over 1 rank) is a host slice: nothing crosses. The
arithmetic is unchanged — the same ops, run by the host's CPU kernels —, so the update is bitwise what eager
PyTorch computes on the CPU. Later passes may rely on: host nodes read only host values and ``to_host`` /
``to_device`` are the only edges between the two places (a host 0-d value read by a device kernel aside).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

from zgraph.graph import (
    INPUT,
    OPTIMIZER,
    PHASE,
    VAL,
    eliminate_dead_code,
    fake_mode,
    insert,
    output_node,
    placeholders,
    shard_rows,
)
from zgraph.host_ops import HOST, PLACE, TO_DEVICE, TO_HOST
from zgraph.ops import SHARD, UNSHARD
from zgraph.passes.graph_utils import outputs
from zgraph.passes.pass_list import PassContext

aten = torch.ops.aten
_STATE = ("param", "grad", "opt_state")
_WIDTH = {torch.float64: 64, torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}


def host_update_applies(gm: fx.GraphModule, ctx: PassContext, *, offload_params: str | None = None) -> bool:
    """Whether ``host_update`` changes the graph: only where some parameter is updated on the host."""
    return bool(ctx.host_params)


def host_update(gm: fx.GraphModule, ctx: PassContext, *, offload_params: str | None = None) -> fx.GraphModule:
    """Place the update of host parameters on the host, with the copies between host and device it needs.

    ``offload_params``: ``Config.offload_params`` (set: a parameter is copied to the device once per use region,
    else once per step)."""
    if not host_update_applies(gm, ctx):
        return gm
    host = ctx.host_params
    placement = _Placement(gm, fake_mode(gm), per_region=offload_params is not None)
    placement.place_inputs(host)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and any(a in placement.placed for a in node.all_input_nodes):
            placement.place(node)
    placement.place_outputs(host)
    for node in reversed(list(gm.graph.nodes)):
        placement.pull(node)
    eliminate_dead_code(gm.graph)
    _hoist(gm, placement.placed)
    gm.recompile()
    return gm


def _on_host(val: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    with mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="cpu")


def _widening_cast(node: fx.Node) -> fx.Node | None:
    """``x`` for ``node = _to_copy(x, dtype=wider)`` that changes only the dtype (and keeps the device)."""
    if node.target is not aten._to_copy.default or not set(node.kwargs) <= {"dtype", "layout", "device"}:
        return None
    source = node.args[0]
    val, out = source.meta.get(VAL), node.meta.get(VAL)
    if not isinstance(val, torch.Tensor) or val.device != out.device:
        return None
    return source if _WIDTH.get(val.dtype, 99) < _WIDTH.get(out.dtype, 0) else None


class _Placement:
    """The placement of one graph: which nodes are host nodes, and the copies made so far."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, per_region: bool):
        self.gm, self.mode, self.per_region = gm, mode, per_region
        self.placed: set[fx.Node] = set()
        self.home: torch.device | None = None  # the device the host state stands in for
        self.to_host: dict[fx.Node, fx.Node] = {}
        self.to_device: dict[fx.Node, tuple[fx.Node, str | None]] = {}  # host value: its copy, the copy's phase
        self.seen: dict[tuple, fx.Node] = {}  # host nodes outside the optimizer, by what they compute

    def mark(self, node: fx.Node) -> None:
        node.meta[PLACE] = HOST
        self.placed.add(node)

    def place_inputs(self, host: set[int]) -> None:
        """Host parameters' state and every hyper-parameter are host values."""
        for node in placeholders(self.gm):
            spec = node.meta[INPUT]
            if spec.kind == "hparam" or (spec.kind in _STATE and spec.index in host):
                val = node.meta[VAL]
                if val.device.type != "cpu" and self.home is None:
                    self.home = val.device
                node.meta[VAL] = _on_host(val, self.mode)
                self.mark(node)
        if self.home is None:  # the state is in host memory anyway: the copies are the host's
            self.home = torch.device("cpu")

    def place(self, node: fx.Node) -> None:
        """Place ``node``, which reads a host value: on the host (reading copies of device values), or on the
        device (reading copies of host values)."""
        if node.target is UNSHARD and node.args[2] == 1:  # one rank's all-gather: a slice of the shard
            self._host_slice(node)
        elif node.target is SHARD:  # a slice of a host value (the optimizer's shard of a whole parameter)
            self._host_shard(node)
        elif node.meta.get(PHASE) == OPTIMIZER and _host_runnable(node) or _cast(node):
            self.to_host_node(node)
            self.once(node)
        else:
            for arg in node.all_input_nodes:
                if arg in self.placed and _has_elements(arg):
                    node.replace_input_with(arg, self.copy_to_device(arg, node))

    def once(self, node: fx.Node) -> fx.Node:
        """``node``, or the host node outside the optimizer that computes the same (the forward's and the
        backward's cast of one parameter: one copy to the device), which then takes its place; not per region."""
        key = _key(node)
        same = self.seen.get(key) if node.meta.get(PHASE) != OPTIMIZER and not self.per_region else None
        if same is None:
            self.seen[key] = node
            return node
        node.replace_all_uses_with(same)
        self.gm.graph.erase_node(node)
        return same

    def to_host_node(self, node: fx.Node) -> None:
        """``node`` runs on the host, reading host copies of its device inputs."""
        for arg in node.all_input_nodes:
            if arg not in self.placed and isinstance(arg.meta.get(VAL), torch.Tensor):
                node.replace_input_with(arg, self.copy_to_host(arg))
        if "device" in node.kwargs:  # made where the state lives: on the host now
            node.kwargs = {**node.kwargs, "device": torch.device("cpu")}
        self.mark(node)
        # the same values on the host (not run again: a scalar read, ``.item()``, would make a new symbol)
        node.meta[VAL] = tree_map_only(torch.Tensor, lambda v: _on_host(v, self.mode), node.meta[VAL])

    def pull(self, node: fx.Node) -> None:
        """An optimizer-phase device op whose every reader reads it on the host (through its copy) runs on the host
        instead (the copy then moves to its inputs: a gradient's clipping runs on the host, on the gradient copied
        in the reduce dtype)."""
        copy = self.to_host.get(node)
        if node in self.placed or copy is None or copy.target is not TO_HOST or node.meta.get(PHASE) != OPTIMIZER:
            return
        val = node.meta.get(VAL)
        if not _host_runnable(node) or not isinstance(val, torch.Tensor) or set(node.users) != {copy}:
            return
        del self.to_host[node]
        self.to_host_node(node)
        copy.replace_all_uses_with(node)
        self.gm.graph.erase_node(copy)

    def place_outputs(self, host: set[int]) -> None:
        """State outputs of host parameters are host values; any other output that is a host value with elements
        goes to the device."""
        out = output_node(self.gm)
        values = []
        for value, role in outputs(self.gm):
            if isinstance(value, fx.Node) and isinstance(value.meta.get(VAL), torch.Tensor):
                if role.kind in _STATE and role.index in host and value not in self.placed:
                    value = self.copy_to_host(value)
                elif not (role.kind in _STATE and role.index in host) and value in self.placed:
                    value = self.copy_to_device(value, out) if _has_elements(value) else value
            values.append(value)
        out.args = (tuple(values),)

    def copy_to_host(self, value: fx.Node) -> fx.Node:
        """A host copy of the device value ``value`` (one per value), right after it; of the narrower source of a
        widening cast (the cast then runs on the host)."""
        if value not in self.to_host:
            source = _widening_cast(value)
            if source is not None:
                copy = self.copy_to_host(source)
                kwargs = dict(value.kwargs, device=torch.device("cpu"))
                widened = insert(self.gm, value.target, (copy,), kwargs, after=copy, phase=OPTIMIZER, mode=self.mode)
                self.mark(widened)
                self.to_host[value] = widened
            else:
                self.to_host[value] = self._transfer(TO_HOST, (value,), after=value)
        return self.to_host[value]

    def copy_to_device(self, value: fx.Node, reader: fx.Node) -> fx.Node:
        """A device copy of the host value ``value`` for ``reader``: one per value, or per use region."""
        phase = reader.meta.get(PHASE)
        copy, made_for = self.to_device.get(value, (None, None))
        if copy is None or (self.per_region and made_for != phase):
            copy = insert(self.gm, TO_DEVICE, (value, str(self.home)), before=reader, phase=phase, mode=self.mode)
            self.to_device[value] = (copy, phase)
        return copy

    def _transfer(self, target: object, args: tuple, after: fx.Node) -> fx.Node:
        anchor = after if after.op != "placeholder" else list(self.gm.graph.nodes)[len(placeholders(self.gm)) - 1]
        return insert(self.gm, target, args, after=anchor, phase=OPTIMIZER, mode=self.mode)

    def _host_shard(self, node: fx.Node) -> None:
        """``shard(x, world, rank)`` of a host ``x``, on the host: the rows, zero-padded (as ``lower_collectives``
        cuts it)."""
        source, world, rank = node.args
        val = source.meta[VAL]
        rows = shard_rows(val.shape[0], world)
        start = min(rank * rows, val.shape[0])
        stop = min(start + rows, val.shape[0])
        at = dict(before=node, phase=node.meta.get(PHASE), mode=self.mode)
        out = insert(self.gm, aten.slice.Tensor, (source, 0, start, stop), **at)
        self.mark(out)
        out = self.once(out)
        if stop - start < rows:
            pad = [0, 0] * (val.dim() - 1) + [0, rows - (stop - start)]
            out = insert(self.gm, aten.constant_pad_nd.default, (out, pad), **at)
            self.mark(out)
            out = self.once(out)
        node.replace_all_uses_with(out)
        self.gm.graph.erase_node(node)

    def _host_slice(self, node: fx.Node) -> None:
        """``unshard(x, dim0, 1, group)`` of a host ``x``: ``x[:dim0]``, copied, on the host."""
        source, dim0 = node.args[0], node.args[1]
        at = dict(before=node, phase=node.meta.get(PHASE), mode=self.mode)
        piece = insert(self.gm, aten.slice.Tensor, (source, 0, 0, dim0), **at)
        self.mark(piece)
        piece = self.once(piece)
        whole = insert(self.gm, aten.clone.default, (piece,), **at)
        self.mark(whole)
        whole = self.once(whole)
        node.replace_all_uses_with(whole)
        self.gm.graph.erase_node(node)


def _host_runnable(node: fx.Node) -> bool:
    """An op the host may run: not a collective, nor a zgraph layout or global operator (but its casts)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace not in ("zgraph", "_c10d_functional")
    return True  # operator.getitem and other Python functions on host values


def _cast(node: fx.Node) -> bool:
    """A dtype-only cast (the forward's cast to the compute dtype) of a host value: it runs on the host."""
    return node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype", "layout", "device"}


def _key(node: fx.Node) -> tuple:
    return (node.target, tuple(node.args), tuple(sorted(node.kwargs.items(), key=str)))


def _has_elements(node: fx.Node) -> bool:
    val = node.meta.get(VAL)
    return isinstance(val, torch.Tensor) and val.dim() > 0


def _hoist(gm: fx.GraphModule, placed: set[fx.Node]) -> None:
    """Move each optimizer host node and each ``to_host`` up to right after the last of its inputs — and after the
    last device-side read of any host state it reads — never later than it is (a stable reorder)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    last_read = {
        n: max((index[u] for u in n.users if u not in placed or u.meta.get(PHASE) != OPTIMIZER), default=-1)
        for n in placed
        if n.op == "placeholder"
    }
    key: dict[fx.Node, tuple] = {}
    for count, node in enumerate(nodes):
        movable = node.target is TO_HOST or (node in placed and node.meta.get(PHASE) == OPTIMIZER)
        if node.op != "call_function" or not movable:
            key[node] = (index[node], 0, 0)
            continue
        after = max([key[a][0] for a in node.all_input_nodes] + [last_read.get(a, -1) for a in node.all_input_nodes])
        key[node] = (after, 1, count) if after < index[node] else (index[node], 0, 0)
    body = sorted((n for n in nodes if n.op not in ("placeholder", "output")), key=key.__getitem__)
    cursor = placeholders(gm)[-1]
    for node in body:
        cursor.append(node)
        cursor = node
