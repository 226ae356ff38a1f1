"""Python numbers an optimizer's ``step()`` reads with ``.item()`` that the host knows before the step runs.

``torch.optim`` reads its step counter (and ASGD its ``eta`` and ``mu``) with ``.item()`` and branches on the result
in Python (RAdam's ``rho_t > 5``, ASGD's ``max(1, step - t0)``); it reads hyper-parameters as Python floats and
branches on them too (``if weight_decay != 0``). A traced ``.item()`` is a symbol of the graph whose value only the
run knows, so such a branch cannot be traced. But a value computed only from hyper-parameters and 0-d optimizer
state (its *host slice*: graph inputs the host holds before the call, and constants) is known on the host before
every call. While an optimizer's step is traced (``HostScalars``), the ``.item()`` of such a value is a *backed*
symbol (``ShapeEnv.create_unspecified_symbol``, its hint the value this call has): a Python branch on it takes the
branch this call takes, and the ShapeEnv records the condition as a guard. ``HostGuards`` keeps the guards and the
host slices (one small graph); before each call the step runs that graph on the call's inputs and uses the compiled
variant only if every guard still holds (``zgraph.dispatch``), else it captures the step again: RAdam's step, say,
is captured once for ``rho_t <= 5`` and once for the steps after. An ``.item()`` of anything else (a norm of a
parameter) stays a symbol only the run knows, and a branch on it is refused as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from zgraph.graph import GraphInput

aten = torch.ops.aten
_names = itertools.count()


def host_known(spec: GraphInput, value: object) -> bool:
    """Whether a graph input is one the host holds before the call: a hyper-parameter, or a 0-d optimizer-state
    tensor held whole (a step counter)."""
    if spec.kind == "hparam":
        return True
    whole = isinstance(value, Tensor) and not isinstance(value, DTensor)
    return spec.kind == "opt_state" and whole and value.dim() == 0


def host_tensor(value: Tensor | float) -> Tensor:
    """A host input as its graph input is: a hyper-parameter as a 0-d float64 tensor, state as a copy."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    return torch.tensor(value, dtype=torch.float64)


@dataclass
class HostGuards:
    """The conditions a captured step's Python branches took on host-known values, and how to compute them.

    Attributes:
        slices: the host slices of ``symbols``: a graph from the host inputs (its placeholders, in ``inputs``
            order) to the symbols' values, each read (``.item()``) where the traced step read it.
        constants: the tensors its ``get_attr`` nodes read.
        inputs: the graph inputs ``slices`` reads.
        symbols: the backed symbols, in the order ``slices`` returns their values.
        guards: sympy conditions over ``symbols`` that held when the step was captured.
    """

    slices: fx.Graph
    constants: dict[str, Tensor]
    inputs: list[GraphInput]
    symbols: list[sympy.Symbol]
    guards: list[sympy.Basic]

    def hold(self, read: Callable[[GraphInput], Tensor | float]) -> bool:
        """Whether every guard holds for the values ``read(input)`` gives for this call's host inputs."""
        values = _run(self.slices, self.constants, [host_tensor(read(spec)) for spec in self.inputs])
        env = {s: sympy.Float(v) if isinstance(v, float) else sympy.Integer(v) for s, v in zip(self.symbols, values)}
        return all(guard.xreplace(env) is sympy.true for guard in self.guards)


class HostScalars(TorchDispatchMode):
    """While active (an optimizer's step being traced), ``.item()`` of a host-known value is a backed symbol.

    ``specs``, ``values``: the trace's graph inputs in placeholder order, and the values they are read from."""

    def __init__(self, specs: Sequence[GraphInput], values: Sequence[object], shape_env: ShapeEnv):
        super().__init__()
        self.specs = specs
        self.values = values
        self.shape_env = shape_env
        self.symbols: dict[sympy.Symbol, fx.Node] = {}  # symbol -> the node whose .item() it is

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        if func is aten._local_scalar_dense.default and (args[0].dtype.is_floating_point or _is_int(args[0])):
            self._back(args[0])
        return _unfolded(func, args, kwargs or {})

    def _back(self, fake: Tensor) -> None:
        """Give ``fake`` a backed symbol as its ``.item()`` when its value is host-known."""
        tracer = get_proxy_mode().tracer
        node = get_proxy_slot(fake, tracer).proxy.node
        nodes = self._slice(node)
        if nodes is None:
            return
        graph, constants, inputs = self._graph(tracer.root, nodes, [node])
        with _disable_current_modes():
            value = _run(graph, constants, [host_tensor(self.values[i]) for i in inputs])[0]
        source = _source(f"zgraph_host_{next(_names)}")
        symbol = self.shape_env.create_unspecified_symbol(value, source, dynamic_dim=DimDynamic.DYNAMIC)
        if not isinstance(symbol, sympy.Symbol):  # specialized (an integer 0 or 1): nothing to guard
            return
        make = self.shape_env.create_symfloatnode if isinstance(value, float) else self.shape_env.create_symintnode
        fake.item_memo = make(symbol, hint=value, source=source)
        self.symbols[symbol] = node

    def _index(self, node: fx.Node) -> int:
        """The graph-input position of a placeholder."""
        return node.graph.find_nodes(op="placeholder").index(node)  # type: ignore[union-attr]

    def _slice(self, node: fx.Node) -> list[fx.Node] | None:
        """The nodes ``node`` is computed from, in graph order, if they read only host-known inputs and
        constants and none of them is aliased by a view (through which it could change unseen); else None."""
        seen: set[fx.Node] = set()
        todo = [node]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder":
                index = self._index(n)
                if not host_known(self.specs[index], self.values[index]):
                    return None
            elif n.op not in ("call_function", "get_attr"):
                return None
            elif any(getattr(u.target, "is_view", False) for u in n.users):
                return None
            todo.extend(n.all_input_nodes)
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        return sorted(seen, key=order.__getitem__)

    def _graph(
        self, root: torch.nn.Module, nodes: list[fx.Node], reads: list[fx.Node]
    ) -> tuple[fx.Graph, dict[str, Tensor], list[int]]:
        """A graph of ``nodes`` (a closed slice, in graph order) returning the value of each of ``reads``: a 0-d
        tensor's ``.item()`` read right after it is computed (a later in-place op may change it); the constants
        its ``get_attr`` nodes read (from ``root``), and the graph-input positions of its placeholders."""
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        constants: dict[str, Tensor] = {}
        inputs: list[int] = []
        items = {}
        for n in nodes:
            if n.op == "placeholder":
                inputs.append(self._index(n))
                env[n] = graph.placeholder(f"input_{inputs[-1]}")
            else:
                if n.op == "get_attr":
                    constants[n.target] = getattr(root, n.target)
                env[n] = graph.node_copy(n, env.__getitem__)
            if n in reads:
                items[n] = graph.call_function(aten._local_scalar_dense.default, (env[n],))
        graph.output(tuple(items[n] for n in reads))
        return graph, constants, inputs

    def guards(self, gm: fx.GraphModule) -> HostGuards | None:
        """The guards the trace recorded on host-known symbols, with the slices that compute them from ``gm``
        (the finished trace); None when no branch read one."""
        mine = set(self.symbols)
        guards = [g.expr for g in self.shape_env.guards if g.expr.free_symbols & mine]
        if not guards:
            return None
        used = sorted({s for g in guards for s in g.free_symbols if s in mine}, key=str)
        reads = [self.symbols[s] for s in used]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        nodes = sorted({m for n in reads for m in self._slice(n) or ()}, key=order.__getitem__)
        graph, constants, inputs = self._graph(gm, nodes, reads)
        return HostGuards(graph, constants, [self.specs[i] for i in inputs], used, guards)


def _run(graph: fx.Graph, constants: dict[str, Tensor], inputs: list[Tensor]) -> list[float | int]:
    """Run a host slice graph on real tensors (no module: a traced step watches the modules called)."""
    env: dict[fx.Node, object] = {}
    feed = iter(inputs)
    with torch.no_grad():
        for n in graph.nodes:
            if n.op == "placeholder":
                env[n] = next(feed)
            elif n.op == "get_attr":
                env[n] = constants[n.target]
            elif n.op == "call_function":
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = n.target(*args, **kwargs)
            else:
                return list(fx.node.map_arg(n.args[0], env.__getitem__))
    raise AssertionError("a host slice graph has an output")


class SymbolicConstants(TorchDispatchMode):
    """FakeTensorMode folds an op on constant tensors (a state tensor ``torch.tensor(1.0)`` made in the step) by
    running it for real; with a symbol among its scalars (a hyper-parameter) it would make the symbol a float (a
    NaN for one only the run knows). While active, such an op is traced instead."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        return _unfolded(func, args, kwargs or {})


class ScalarTensors(TorchFunctionMode):
    """While active, ``torch.tensor(x)`` / ``torch.as_tensor(x)`` of a Python number that is a symbol (ASGD's
    ``torch.as_tensor(lr / ...)``) is ``torch.scalar_tensor(x)``: the same tensor, traced, where torch would fix the
    symbol to its value."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        kwargs = kwargs or {}
        symbolic = len(args) == 1 and isinstance(args[0], (torch.SymFloat, torch.SymInt))
        if func in (torch.tensor, torch.as_tensor) and symbolic and set(kwargs) <= {"dtype", "device"}:
            default = torch.get_default_dtype() if isinstance(args[0], torch.SymFloat) else torch.int64
            return torch.scalar_tensor(args[0], dtype=kwargs.get("dtype") or default, device=kwargs.get("device"))
        return func(*args, **kwargs)


def _unfolded(func: Callable, args: tuple, kwargs: dict) -> object:
    """``func(*args, **kwargs)``, its constant tensor arguments no longer constants if a scalar is a symbol."""
    flat = pytree.tree_leaves((args, kwargs))
    if any(isinstance(a, (torch.SymFloat, torch.SymInt)) for a in flat):
        for t in flat:
            if isinstance(t, FakeTensor) and t.constant is not None:
                t.fake_mode.fake_tensor_converter.invalidate_constant_aliases(t.constant)
    return func(*args, **kwargs)


def _is_int(t: Tensor) -> bool:
    return t.dtype in (torch.int32, torch.int64)


def _source(name: str) -> object:
    from torch._dynamo.source import ConstantSource

    return ConstantSource(name)
