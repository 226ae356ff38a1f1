"""Liveness of a step graph: the bytes alive after each node when it runs op by op, and the peak.

The eager backend runs the final graph as FX's generated Python, which drops each value after its last use. So a
storage is allocated by the node that makes it and freed after the last node that reads it, or any view or in-place
result of it (an op's schema says which results alias which arguments). A functional all-gather's or all-to-all's
work holds its inputs until the last ``wait_tensor`` on its results, so they live at least until then (gloo; its
reduce-scatters and all-reduces copy their input first and drop it at once). Graph inputs (parameters, state, the
batch) and outputs are held by the caller for the whole step, except inputs read only through ``zgraph::reload``
(offloaded: the caller holds them in the offload tier, not in memory; each reload allocates its own copy). Sizes come
from the nodes' fake values: no memory is touched, so this works on graphs traced at any scale.

On CUDA (``liveness(gm, device="cuda")``) each storage is counted as the CUDA caching allocator sizes its block
(``cuda_block_bytes``), which is what ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` count, and
collectives are NCCL's: a reduce-scatter's work, like an all-gather's, holds its input until its wait. On the CPU,
storages count their bytes.

Symbolic sizes (a graph captured with some dims of the step's arguments as symbols): each storage's size is an
expression of the symbols; ``liveness(gm, sizes={"s0": 512})`` evaluates them at those sizes (the others at their
hints, the sizes the graph was captured at), and ``Liveness.peak_formula`` / ``activation_formula`` are the bytes
alive at the peak (of all, of saved activations) as expressions of the symbols: exact while the same storages are
alive at the peak, as they are around those sizes (evaluate again at other sizes: the peak may move).

Saved activations (``Liveness.activation_bytes``): storages a forward node made that a backward node reads (node
phases, ``zgraph.graph.PHASE``): the most of them alive at once, what grows with the sequence length and the micro
batch, and what activation checkpointing, activation offload and sequence parallelism cut.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from zgraph.graph import BACKWARD, FORWARD, PHASE, VAL, fake_mode
from zgraph.ops import RELOAD
from zgraph.sizes import symbolic_bytes

_WAIT = torch.ops._c10d_functional.wait_tensor.default
# ops whose result is (or shares the memory of) their first input though their schema declares no alias
_UNDECLARED_VIEWS = (torch.ops.aten._unsafe_view.default, _WAIT)
# collectives whose work holds their inputs until they are waited for
_HOLD_INPUTS = (
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor_coalesced.default,
    torch.ops._c10d_functional.all_to_all_single.default,
)
# on NCCL, whose work holds every input it reads until it is waited for (its reduce-scatters read theirs in place)
_HOLD_INPUTS_NCCL = (
    *_HOLD_INPUTS,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor_coalesced.default,
)


# The CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp; constants in c10/core/AllocatorConfig.h): every
# request is rounded up to a multiple of kMinBlockSize
CUDA_MIN_BLOCK_BYTES = 512


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts as allocated for a request of ``nbytes``: rounded up to a multiple
    of ``CUDA_MIN_BLOCK_BYTES`` (kMinBlockSize, 512: at least one block); a zero-byte tensor allocates nothing
    (``allocate(0)`` returns no block). Not modelled: the segments blocks are carved from (reserved memory, which
    ``max_memory_reserved`` counts: kSmallBuffer, 2 MiB, for requests up to kSmallSize, 1 MiB; kLargeBuffer, 20 MiB,
    up to kMinLargeAlloc, 10 MiB; above, a multiple of kRoundLarge, 2 MiB), a large block left unsplit when its
    free block has 1 MiB or less left over (then counted whole: that depends on the allocation history),
    ``PYTORCH_CUDA_ALLOC_CONF`` (``roundup_power2_divisions``, ``expandable_segments``), and memory outside the
    allocator (the CUDA context, cuBLAS and NCCL workspaces)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // CUDA_MIN_BLOCK_BYTES) * CUDA_MIN_BLOCK_BYTES


@dataclass(frozen=True)
class Liveness:
    """Bytes alive over a graph's execution.

    Attributes:
        live_bytes: after each node (in graph order), the bytes alive while it ran: its inputs, its result and
            everything still needed later.
        node_names: the node names, in the same order.
        peak_bytes: the largest of ``live_bytes``.
        peak_node: the node running at the peak.
        alive_at_peak: ``(node that allocated it, bytes)`` of every storage alive at the peak, largest first.
        activation_bytes: the most bytes alive at once of saved activations (module docstring); 0 in a graph
            without a backward.
        sizes: the value each size symbol was evaluated at (symbol name -> size); empty for static sizes.
        peak_formula: ``peak_bytes`` as an expression of the size symbols (module docstring); None if static.
        activation_formula: ``activation_bytes`` likewise; None if static.
    """

    live_bytes: tuple[int, ...]
    node_names: tuple[str, ...]
    peak_bytes: int
    peak_node: str
    alive_at_peak: tuple[tuple[str, int], ...]
    activation_bytes: int = 0
    sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    peak_formula: sympy.Expr | None = None
    activation_formula: sympy.Expr | None = None


def _nbytes(value: object) -> int | sympy.Expr:
    """A storage's bytes: an int, or an expression of the size symbols."""
    if not isinstance(value, torch.Tensor):
        return 0
    try:
        nbytes = value.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):  # a tensor without storage (a functional wrapper)
        return symbolic_bytes(value)
    return nbytes.node.expr if isinstance(nbytes, torch.SymInt) else nbytes


def _aliased_argument(node: fx.Node, alias_set: frozenset) -> fx.Node | None:
    """The argument node whose schema alias set is ``alias_set``; empty: the first argument with an alias set (a
    list of views, ``Tensor(a)[]``, exposes no set of its own)."""
    schema = node.target._schema
    for i, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is None or (alias_set and not (set(info.before_set) & set(alias_set))):
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, fx.Node):
            return value
    return None


def _storages(node: fx.Node, of: dict[fx.Node, list[int]], sizes: list, owners: list[str]) -> list[int]:
    """The storages ``node``'s value lives in: its arguments' (a view, an in-place result, a tuple element) or
    new ones, recorded in ``sizes`` / ``owners``."""

    def new(value: object) -> int:
        sizes.append(_nbytes(value))
        owners.append(node.name)
        return len(sizes) - 1

    val = node.meta.get(VAL)
    if node.op in ("placeholder", "get_attr"):  # what the caller feeds: a tensor of its own (its fake may be a view)
        sizes.append(symbolic_bytes(val) if isinstance(val, torch.Tensor) and not offloaded(node) else 0)
        owners.append(node.name)
        return [len(sizes) - 1]
    if node.op != "call_function":
        return []
    if node.target is operator.getitem:
        source, index = node.args
        found = of.get(source, [])
        return [found[index]] if isinstance(index, int) and index < len(found) else []
    if node.target in _UNDECLARED_VIEWS:
        return list(of.get(node.args[0], []))[:1]
    values = list(val) if isinstance(val, (list, tuple)) else [val]
    schema = getattr(node.target, "_schema", None)
    infos = [r.alias_info for r in schema.returns] if schema is not None else []
    if len(infos) == 1:  # one return: a tensor, or a list of them sharing its alias annotation
        infos = infos * len(values)
    out = []
    for i, value in enumerate(values):
        info = infos[i] if i < len(infos) else None
        source = _aliased_argument(node, frozenset(info.before_set)) if info is not None else None
        if source is not None and of.get(source):
            out.append(of[source][0])
        elif isinstance(value, torch.Tensor):
            out.append(new(value))
        else:
            out.append(-1)  # not a tensor (a SymInt): keeps tuple positions
    return [s for s in out if s >= 0] if not isinstance(val, (list, tuple)) else out


def offloaded(node: fx.Node) -> bool:
    """True for a graph input read only through ``zgraph::reload``: it lives in the offload tier between steps."""
    return node.op == "placeholder" and bool(node.users) and all(u.target is RELOAD for u in node.users)


def _waits(node: fx.Node, holding: tuple = _HOLD_INPUTS) -> list[fx.Node]:
    """The ``wait_tensor`` nodes that complete ``node`` if it is a collective that holds its inputs until then (one
    of ``holding``; on its result, or on the elements of its list of results), else none."""
    if node.target not in holding:
        return []
    results = [node, *(u for u in node.users if u.target is operator.getitem)]
    return [w for r in results for w in r.users if w.target is _WAIT]


def liveness(
    gm: fx.GraphModule,
    device: str = "cpu",
    sizes: Mapping[str, int] | None = None,
    consumed: Collection[fx.Node] = (),
) -> Liveness:
    """Bytes alive after each node of ``gm`` and the peak (see the module docstring); ``device``: ``"cuda"``
    counts each storage as the CUDA caching allocator's block (``cuda_block_bytes``) and every collective as holding
    its inputs until its wait (NCCL's). ``sizes``: symbol name -> size, for a graph with symbolic sizes (others:
    their hints). ``consumed``: placeholders the caller holds nowhere else, alive until their last use (a pipeline
    stage's saved activations, ``zgraph.runtime.pipeline_run.CONSUMED``)."""
    holding = _HOLD_INPUTS_NCCL if device == "cuda" else _HOLD_INPUTS
    nodes = list(gm.graph.nodes)
    of: dict[fx.Node, list[int]] = {}
    exprs: list[int | sympy.Expr] = []
    owners: list[str] = []
    born: dict[int, int] = {}
    last: dict[int, int] = {}
    end = len(nodes) - 1
    index = {node: i for i, node in enumerate(nodes)}
    for i, node in enumerate(nodes):
        of[node] = _storages(node, of, exprs, owners)
        for s in of[node]:
            if s < 0:
                continue
            born.setdefault(s, 0 if node.op in ("placeholder", "get_attr") else i)
            held = node.op in ("placeholder", "get_attr") and node not in consumed
            last[s] = end if held else max(last.get(s, i), i)
        waited = max((index[w] for w in _waits(node, holding)), default=i)  # an all-gather's inputs: until its wait
        for arg in node.all_input_nodes:
            for s in of.get(arg, []):
                if s >= 0:
                    last[s] = end if node.op == "output" else max(last[s], waited)
    values = _symbol_values(gm, exprs, sizes or {})
    bytes_ = [int(e.xreplace(values)) if isinstance(e, sympy.Expr) else int(e) for e in exprs]
    if device == "cuda":
        bytes_ = [cuda_block_bytes(n) for n in bytes_]
    live = _alive(born, last, bytes_, len(nodes))
    phases = [node.meta.get(PHASE) for node in nodes]
    saved = {s: start for s, start in born.items() if phases[start] == FORWARD and phases[last[s]] == BACKWARD}
    peak_index = max(range(len(live)), key=live.__getitem__) if live else 0
    alive = sorted(
        ((owners[s], bytes_[s]) for s, start in born.items() if start <= peak_index <= last[s] and bytes_[s]),
        key=lambda item: -item[1],
    )
    held = _alive(saved, last, bytes_, len(nodes))
    saved_peak = max(range(len(held)), key=held.__getitem__) if held else 0
    return Liveness(
        tuple(live),
        tuple(n.name for n in nodes),
        live[peak_index] if live else 0,
        nodes[peak_index].name if nodes else "",
        tuple(alive),
        max(held, default=0),
        {str(k): int(v) for k, v in values.items()},
        _formula(born, last, exprs, peak_index) if values else None,
        _formula(saved, last, exprs, saved_peak) if values else None,
    )


def _symbol_values(gm: fx.GraphModule, exprs: list, sizes: Mapping[str, int]) -> dict[sympy.Symbol, int]:
    """The value of each size symbol of ``exprs``: ``sizes``' (by name), else its hint."""
    symbols = set().union(*(e.free_symbols for e in exprs if isinstance(e, sympy.Expr)))
    unknown = sorted(set(sizes) - {str(s) for s in symbols})
    if unknown:
        raise ValueError(
            f"sizes names {unknown}, which are not size symbols of the graph ({sorted(map(str, symbols))})"
        )
    if not symbols:
        return {}
    env = fake_mode(gm).shape_env
    return {s: int(sizes[str(s)]) if str(s) in sizes else int(env.optimization_hint(s)) for s in symbols}


def _formula(born: dict[int, int], last: dict[int, int], exprs: list, at: int) -> sympy.Expr:
    """The bytes of the storages alive at node ``at``, as an expression of the size symbols."""
    return sympy.expand(sympy.Add(*(exprs[s] for s, start in born.items() if start <= at <= last[s])))


def _alive(born: dict[int, int], last: dict[int, int], sizes: list[int], count: int) -> list[int]:
    """Bytes alive at each of ``count`` nodes of the storages ``born`` names (storage: first node), each alive to
    its ``last`` node."""
    delta = [0] * (count + 1)
    for s, start in born.items():
        delta[start] += sizes[s]
        delta[last[s] + 1] -= sizes[s]
    live, current = [], 0
    for i in range(count):
        current += delta[i]
        live.append(current)
    return live
