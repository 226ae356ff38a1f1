"""Python numbers a step reads from tensors (``.item()``, ``bool()``) that the host knows before it runs.

``torch.optim`` reads its step counter (and ASGD its ``eta`` and ``mu``) with ``.item()`` and branches on the result
in Python (RAdam's ``rho_t > 5``, ASGD's ``max(1, step - t0)``); it reads hyper-parameters as Python floats and
branches on them too (``if weight_decay != 0``). A module branches on its own step counter, a 0-d integer buffer the
step advances (``AveragedModel.update_parameters`` copies on its first call, ``bool(n_averaged == 0)``, and averages
on later ones; BatchNorm with ``momentum=None`` averages with ``1 / float(num_batches_tracked)``). A traced
``.item()`` is a symbol of the graph whose value only the run knows, so such a branch cannot be traced. But a value
computed only from hyper-parameters, 0-d optimizer state and 0-d integer buffers (*host counters*, read on the host)
— its *host slice*: graph inputs the host holds before the call, and constants — is known on the host before every
call. While the step is traced (``HostScalars``), the ``.item()`` of such a value is a *backed* symbol
(``ShapeEnv.create_unspecified_symbol``, its hint the value this call has): a Python branch on it takes the branch
this call takes, and the ShapeEnv records the condition as a guard; arithmetic on it stays symbolic (the graph
computes the number on every call). ``HostGuards`` keeps the guards and the host slices (small graphs of the traced
ops); before each call the step runs them on the call's inputs and uses the compiled variant only if every guard
still holds (``zgraph.dispatch``), else it captures the step again: RAdam's step, say, is captured once for
``rho_t <= 5`` and once for the steps after, an EMA's once for its first update and once for the later ones. An
``.item()`` of anything else (a loss, a norm of a parameter) stays a symbol only the run knows, and a branch on it is
refused as before. ``int(t)`` / ``float(t)`` must return plain Python numbers: this call's value, guarded (a new
value captures the step again), but where ``zgraph.capture.symbolic_calls`` keeps them symbols (torch's BatchNorm).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import _ProxyTensor, get_proxy_mode, get_proxy_slot, set_proxy_slot
from torch.fx.experimental.sym_node import SymNode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from zgraph.capture.functionalize import unwrapped
from zgraph.graph import GraphInput
from zgraph.ops import host_read

aten = torch.ops.aten
_names = itertools.count()


def host_known(spec: GraphInput, value: object) -> bool:
    """Whether a graph input is one the host holds before the call: a hyper-parameter, a 0-d optimizer-state
    tensor (a step counter) or a host counter (a module's 0-d integer or bool buffer), held whole (not an
    estimate's meta stand-in, which has no value)."""
    if spec.kind == "hparam":
        return True
    whole = isinstance(value, Tensor) and not isinstance(value, DTensor) and not value.is_meta and value.dim() == 0
    if spec.kind == "buffer":
        return whole and not value.is_floating_point() and not value.is_complex()
    return spec.kind == "opt_state" and whole


def host_tensor(value: Tensor | float) -> Tensor:
    """A host input as its graph input is: a hyper-parameter as a 0-d float64 tensor, state as a copy on the host
    (one kept on a device, a counter of a module moved there, is read from it)."""
    if not isinstance(value, Tensor):
        return torch.tensor(value, dtype=torch.float64)
    if value.device.type == "cpu":
        return value.detach().clone()
    with host_read("a host-known value (a step counter) kept on a device"):
        return value.detach().to("cpu", copy=True)


@dataclass
class HostSlice:
    """How the host computes one host-known value: ``graph`` (a copy of the traced nodes it is computed from, the
    ``.item()`` last) run on the graph inputs ``inputs``, its ``get_attr`` nodes reading ``constants``."""

    graph: fx.Graph
    constants: dict[str, Tensor]
    inputs: list[GraphInput]

    def value(self, read: Callable[[GraphInput], Tensor | float]) -> float | int:
        """The value for the host inputs ``read(input)`` gives (read from copies: the slice may write into them)."""
        return _run(self.graph, self.constants, [host_tensor(read(spec)) for spec in self.inputs])


@dataclass
class HostGuards:
    """The conditions a captured step's Python branches took on host-known values, and how to compute them.

    Attributes:
        symbols: the backed symbols the guards read, each with the slice that computes its value.
        guards: sympy conditions over ``symbols`` that held when the step was captured.
    """

    symbols: dict[sympy.Symbol, HostSlice]
    guards: list[sympy.Basic]

    def hold(self, read: Callable[[GraphInput], Tensor | float]) -> bool:
        """Whether every guard holds for the values ``read(input)`` gives for this call's host inputs."""
        env = {}
        for symbol, host_slice in self.symbols.items():
            v = host_slice.value(read)
            env[symbol] = sympy.Float(v) if isinstance(v, float) else sympy.Integer(v)
        return all(guard.xreplace(env) is sympy.true for guard in self.guards)


class HostScalars(TorchDispatchMode):
    """While active (the step being traced), ``.item()`` of a host-known value is a backed symbol, and so is the
    ``bool()`` of one (``is_nonzero``, which ``make_fx`` would read as an ``.item()`` only the run knows).

    ``specs``, ``values``: the trace's graph inputs in placeholder order, and the values they are read from."""

    def __init__(self, specs: Sequence[GraphInput], values: Sequence[object], shape_env: ShapeEnv):
        super().__init__()
        self.specs = specs
        self.values = values
        self.shape_env = shape_env
        self.symbols: dict[sympy.Symbol, HostSlice] = {}
        self.backing = True

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No symbol is backed inside: zgraph's own optimizer kernels read hyper-parameters with ``.item()`` as
        numbers only the run knows, and branch on none (inductor would fix a backed float to its value)."""
        before, self.backing = self.backing, False
        try:
            yield
        finally:
            self.backing = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        if not self.backing:
            return func(*args, **(kwargs or {}))
        if func is aten.is_nonzero.default and args[0].numel() == 1:
            nonzero = aten.ne.Scalar(args[0], 0)  # make_fx's own reading of bool(t), traced
            if self._back(nonzero):
                return bool(aten._local_scalar_dense.default(nonzero))
        if func is aten._local_scalar_dense.default and not args[0].is_complex():
            self._back(args[0])
        return _unfolded(func, args, kwargs or {})

    def _back(self, fake: Tensor) -> bool:
        """Give ``fake`` a backed symbol as its ``.item()`` when its value is host-known (a bool one the symbol's
        ``!= 0``); whether it did."""
        tracer = get_proxy_mode().tracer
        fake = unwrapped(fake)  # the step's tensors are functional; the traced one is under it
        node = get_proxy_slot(fake, tracer).proxy.node
        nodes = self._slice(node)
        if nodes is None:
            return False
        host_slice = self._host_slice(tracer.root, nodes, node)
        with _disable_current_modes():
            value = host_slice.value(lambda spec: self.values[self.specs.index(spec)])
        source = _source(f"zgraph_host_{next(_names)}")
        number = int(value) if isinstance(value, bool) else value
        symbol = self.shape_env.create_unspecified_symbol(number, source, dynamic_dim=DimDynamic.DYNAMIC)
        if not isinstance(symbol, sympy.Symbol):  # specialized: nothing to guard
            return False
        if isinstance(value, bool):
            fake.item_memo = torch.SymBool(SymNode(sympy.Ne(symbol, 0), self.shape_env, bool, hint=value))
        elif isinstance(value, float):
            fake.item_memo = self.shape_env.create_symfloatnode(symbol, hint=value, source=source)
        else:
            fake.item_memo = self.shape_env.create_symintnode(symbol, hint=value, source=source)
        self.symbols[symbol] = host_slice
        return True

    def _index(self, node: fx.Node) -> int:
        """The graph-input position of a placeholder."""
        return node.graph.find_nodes(op="placeholder").index(node)  # type: ignore[union-attr]

    def _slice(self, node: fx.Node) -> list[fx.Node] | None:
        """The nodes the value of ``node`` is computed from, in graph order (traced so far): what it reads and what
        wrote into those (in-place ops, ``_foreach_add_`` on a list of step counters); None unless they read only
        host-known inputs and constants and none is aliased by a view (through which it could change unseen)."""
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
            elif n.op not in ("call_function", "get_attr") or _random(n):
                return None
            if any(getattr(u.target, "is_view", False) for u in n.users):
                return None
            todo.extend(n.all_input_nodes)
            todo.extend(u for u in n.users if _writes(u, n))
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        return sorted(seen, key=order.__getitem__)

    def _host_slice(self, root: torch.nn.Module, nodes: list[fx.Node], node: fx.Node) -> HostSlice:
        """``nodes`` (a closed slice, in graph order) copied into a graph returning ``node.item()``, with the
        constants its ``get_attr`` nodes read (from ``root``)."""
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        constants: dict[str, Tensor] = {}
        inputs: list[GraphInput] = []
        for n in nodes:
            if n.op == "placeholder":
                inputs.append(self.specs[self._index(n)])
                env[n] = graph.placeholder(f"input_{len(inputs)}")
                continue
            if n.op == "get_attr":
                constants[n.target] = getattr(root, n.target)
            env[n] = graph.node_copy(n, env.__getitem__)
        graph.output(graph.call_function(aten._local_scalar_dense.default, (env[node],)))
        return HostSlice(graph, constants, inputs)

    def guards(self) -> HostGuards | None:
        """The guards the trace recorded on host-known symbols, with the slices that compute them; None when no
        branch read one."""
        mine = set(self.symbols)
        guards = [g.expr for g in self.shape_env.guards if g.expr.free_symbols & mine]
        if not guards:
            return None
        used = sorted({s for g in guards for s in g.free_symbols if s in mine}, key=str)
        return HostGuards({s: self.symbols[s] for s in used}, guards)


def _writes(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` (an op) writes into ``node``'s tensor (an argument its schema marks as written)."""
    if user.op != "call_function":
        return False
    return any(
        value is node or (isinstance(value, (list, tuple)) and node in value)
        for value in _written(user.target, user.args, user.kwargs)
    )


def _run(graph: fx.Graph, constants: dict[str, Tensor], inputs: list[Tensor]) -> float | int:
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
                return env[n.args[0]]
    raise AssertionError("a host slice graph has an output")


def _unfolded(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """``func(*args, **kwargs)``, traced rather than folded on constant tensors when a scalar is a symbol (a
    hyper-parameter): FakeTensorMode would run it for real, the symbol made a float (a NaN for one only the run
    knows), and ``make_fx`` would keep the constant it knew of a tensor the op writes into without returning it
    (``_foreach_mul_``), so a later ``.item()`` read the value from before."""
    flat = pytree.tree_leaves((args, kwargs))
    if not any(isinstance(a, (torch.SymFloat, torch.SymInt)) for a in flat):
        return func(*args, **kwargs)
    for t in map(unwrapped, flat):
        if isinstance(t, FakeTensor) and t.constant is not None:
            t.fake_mode.fake_tensor_converter.invalidate_constant_aliases(t.constant)
    out = func(*args, **kwargs)
    proxy_mode = get_proxy_mode()
    if proxy_mode is not None:
        for t in map(unwrapped, pytree.tree_leaves(_written(func, args, kwargs))):
            slot = get_proxy_slot(t, proxy_mode.tracer, None)
            if isinstance(t, Tensor) and slot is not None and slot.constant is not None:
                set_proxy_slot(t, proxy_mode.tracer, _ProxyTensor(slot.proxy, None))
    return out


def _written(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list:
    """The arguments of a call that its schema marks as written."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            out.append(args[i] if i < len(args) else kwargs.get(argument.name))
    return out


def _random(node: fx.Node) -> bool:
    """Whether an op draws random numbers (the host cannot compute it again)."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _source(name: str) -> object:
    from torch._dynamo.source import ConstantSource

    return ConstantSource(name)
