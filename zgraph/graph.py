"""The graph contract: what a zgraph step graph means, for capture, every pass, the runtime and inspection.

A step graph is a ``torch.fx.GraphModule`` of aten ops (and ``zgraph.ops``) whose values carry fake tensors in
``node.meta[VAL]``. On top of FX it guarantees:

- every placeholder carries ``node.meta[INPUT]``, a ``GraphInput`` (what the runtime feeds it);
- the output node carries ``node.meta[OUTPUTS]``, one ``GraphOutput`` per returned value (where it is written);
- every op node carries ``node.meta[PHASE]``, one of ``PHASES``;
- captured with ``Config.remat`` set, an op node a *block*'s forward made (a child of an ``nn.ModuleList`` /
  ``nn.Sequential`` whose children are all of one class: a model's repeated layers) carries the block's name in
  ``node.meta[CUSTOM][BLOCK]``;
- a node a pass added carries ``node.meta[MADE_BY]``, the pass's name (``run_pass`` stamps it: a create-node hook
  on the module the pass edits);
- collectives are counted and sized by ``collective_kind`` / ``collective_bytes``;
- a tensor of a parameter's shape is sharded along dim 0 by ``ShardSpec`` (``shard_rows`` rows per rank), over
  the ranks of an ``Axis`` (all of them, or hybrid sharding's shard group).

This module depends on torch only: passes, runtime and the user surface all build on it.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch._guards import TracingContext
from torch._library import simple_registry
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import optimization_hint

# ---------------------------------------------------------------------------------------------------- phases
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
PHASES = (FORWARD, BACKWARD, OPTIMIZER)

# ------------------------------------------------------------------------------------------------- meta keys
VAL = "val"  # node.meta: the node's fake value (FX's own key)
PHASE = "phase"  # node.meta: FORWARD / BACKWARD / OPTIMIZER
CUSTOM = "custom"  # node.meta: what ``fx.traceback.annotate`` recorded while tracing (holds a PHASE)
BLOCK = "zgraph_block"  # in node.meta[CUSTOM]: name of the repeated module (block) whose forward made the node
INPUT = "zgraph_input"  # placeholder meta: its GraphInput
OUTPUTS = "zgraph_outputs"  # output node meta: a GraphOutput per returned value
COLLECTIVE = "zgraph_collective"  # lowered collective: (kind, what it moves)
BUCKET = "zgraph_bucket"  # bucketed layout op: members and bytes
MADE_BY = "zgraph_pass"  # node.meta: name of the pass that added the node
UPDATED_INPUTS = "zgraph_updated_inputs"  # gm.meta: output positions that are their own input, updated in place

STATE_KINDS = ("param", "grad", "buffer", "opt_state")
OFFLOADED = "offloaded"  # GraphOutput kind: state the graph wrote to its offload tier itself (nothing to write)


# --------------------------------------------------------------------------------------------- inputs/outputs
@dataclass(frozen=True)
class GraphInput:
    """What a placeholder of the step graph stands for.

    Attributes:
        kind: ``param``, ``grad`` (the ``.grad`` a parameter has on entry), ``buffer``, ``opt_state``,
            ``hparam`` (a numeric optimizer hyper-parameter), ``input`` (a tensor argument of the step),
            ``input_grad`` (the ``.grad`` of a leaf tensor argument) or ``loss_scale``.
        name: readable name (parameter FQN, ``fqn:exp_avg``, ``opt.group0:lr``, ``batch.x``).
        index: parameter index (param, grad, opt_state), buffer index, or argument-leaf index (input*).
        field: optimizer state key or hyper-parameter name.
        optimizer: optimizer index (opt_state, hparam), else -1.
        group: param-group index (hparam), else -1.
        layout: ``"full"`` or ``"shard"`` (the rank's dim-0 shard, padded; set by sharding passes).
    """

    kind: str
    name: str
    index: int
    field: str = ""
    optimizer: int = -1
    group: int = -1
    layout: str = "full"


@dataclass(frozen=True)
class GraphOutput:
    """What an output of the step graph is written to; ``kind`` is ``user`` (a leaf of the step's return
    value, ``index`` its position), one of the state kinds of ``GraphInput``, or ``offloaded`` (an optimizer
    state or parameter shard the graph wrote to the offload tier itself: the output is an empty token, nothing
    is written)."""

    kind: str
    name: str
    index: int
    field: str = ""
    optimizer: int = -1
    layout: str = "full"


def state_key(spec: GraphInput | GraphOutput) -> tuple:
    """What an input and an output share when they are the same piece of state."""
    return (spec.kind, spec.index, spec.field, spec.optimizer)


# ------------------------------------------------------------------------------------------------- sharding
def shard_rows(d0: int, world_size: int) -> int:
    """Rows of each rank's dim-0 shard of a tensor with ``d0`` rows: ``ceil(d0 / world_size)``."""
    return -(-d0 // world_size)


@dataclass(frozen=True, kw_only=True)
class Axis:
    """A set of ranks one collective spans, as a rank sees it: hybrid sharding's shard group (the ranks that
    split a parameter between them) or its replicate group (one rank of each shard group: they hold the same
    shard), or hpZ's secondary group.

    Attributes:
        size: ranks in it.
        rank: this rank's position in it.
        name: its process group's name (what collectives take).
        crosses_nodes: it spans more than one node (its collectives use the slower links), as far as is known.
    """

    size: int
    rank: int
    name: str
    crosses_nodes: bool = False


@dataclass(frozen=True)
class ShardSpec:
    """How a tensor of a parameter's shape is split across ranks: along dim 0, padded to equal shards.

    Rank ``r`` holds rows ``[r * rows, (r + 1) * rows)`` of the tensor padded with zero rows to
    ``rows * world_size``. Every rank's shard has the same shape, so every rank's graph has the same shapes.
    """

    shape: tuple[int, ...]
    world_size: int

    @property
    def rows(self) -> int:
        """Rows per shard."""
        return shard_rows(self.shape[0], self.world_size)

    @property
    def padded_rows(self) -> int:
        return self.rows * self.world_size

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.rows, *self.shape[1:])

    def local_rows(self, rank: int) -> int:
        """Rows of the real (unpadded) tensor rank ``rank`` holds."""
        return max(0, min(self.rows, self.shape[0] - rank * self.rows))


@dataclass(frozen=True)
class ParamInfo:
    """What passes know of one parameter (``index`` is its number in graph inputs and markers).

    Attributes:
        shard: how the parameter's gradient and optimizer state (and the parameter itself in stage 3) are
            split across ranks; None when they stay whole (0-d parameters, no process group).
        persistent: the parameter itself stays whole in stage 3 (a tensor only an optimizer holds, or one under
            ``Config.param_persistence_threshold``).
    """

    index: int
    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    shard: ShardSpec | None = None
    persistent: bool = False

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class CostModel(Protocol):
    """What planning reads of a cost model (``zgraph.runtime.cost_model.CostModel`` is one)."""

    source: str
    flops_per_second: float
    bytes_per_second: float

    def collective_seconds(self, kind: str, nbytes: int) -> float: ...

    def bucket_bytes(self, kind: str, latency_share: float = 0.1) -> int: ...


# ---------------------------------------------------------------------------------------------- collectives
COLLECTIVE_KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
# ``all_to_all_single`` is a reduce-scatter (``reduce_scatter_by_all_to_all``) unless lowered from a sequence
# parallelism exchange (``zgraph.sequence_ops``), whose ``COLLECTIVE`` meta says ``all_to_all``
_AS_KIND = {"all_to_all_single": "reduce_scatter_tensor"}
ALL_TO_ALL = "all_to_all"  # the kind of a sequence parallelism exchange; priced as a reduce-scatter (``PRICED_AS``)
PRICED_AS = {ALL_TO_ALL: "reduce_scatter_tensor"}  # each rank sends (W - 1) / W of the tensor, as a ring reduce-scatter
# zgraph's layout operators (``zgraph.ops``, by name) and the collective each becomes
_LAYOUT_KINDS = {
    "unshard": "all_gather_into_tensor",
    "unshard_bucket": "all_gather_into_tensor",
    "reduce_shard": "reduce_scatter_tensor",
    "reduce_shard_bucket": "reduce_scatter_tensor",
    "reduce": "all_reduce",
    "reduce_bucket": "all_reduce",
}


def collective_kind(node: fx.Node) -> str | None:
    """``all_gather_into_tensor`` / ``reduce_scatter_tensor`` / ``all_reduce`` (also their coalesced forms) for
    a functional-collective node, or for the zgraph layout operator that becomes one (``unshard``,
    ``reduce_shard``, ``reduce``); ``all_to_all`` for a sequence parallelism exchange; else None. Another
    ``all_to_all_single`` is a reduce-scatter (``reduce_scatter_by_all_to_all``)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    namespace, name = node.target.namespace, node.target._opname
    if namespace == "zgraph":
        return _LAYOUT_KINDS.get(name)
    if namespace != "_c10d_functional":
        return None
    for kind in COLLECTIVE_KINDS:
        if name.startswith(kind):
            return kind
    if name == "all_to_all_single" and node.meta.get(COLLECTIVE, ("",))[0] == ALL_TO_ALL:
        return ALL_TO_ALL
    return _AS_KIND.get(name)


def reduce_scatter_by_all_to_all(backend: str | None) -> bool:
    """Whether a reduce-scatter on a process group of ``backend`` runs as ``all_to_all_single`` plus a sum of the
    received chunks (True on gloo) rather than as ``reduce_scatter_tensor``.

    gloo's ``reduce_scatter_tensor`` all-reduces a copy of its whole input and keeps its own chunk: twice the bytes
    of a reduce-scatter, plus two copies. An all-to-all sends each rank its chunk ((W-1)/W of the input, as a ring
    reduce-scatter) and the sum is one pass over the received W chunks. Measured on 2 CPU ranks, 15 MiB: 15.0 ms
    (9.2 ms CPU) against 9.2 ms (6.3 ms CPU), with bit-identical results (benchmarks/README.md). NCCL has a real
    reduce-scatter."""
    return backend == "gloo"


def offload_moves(tier: str | None, device_type: str) -> bool:
    """Whether an offload tier (``Config.offload_optimizer`` / ``offload_params``) moves state out of the memory
    of ``device_type``: ``"nvme"`` always, ``"cpu"`` from a device (on the CPU it is the identity)."""
    return tier == "nvme" or (tier == "cpu" and device_type != "cpu")


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor, or of the tensors in a list/tuple; of a tensor with symbolic sizes, at their hints
    (``zgraph.sizes.size_hint``: the sizes it was captured at; ``zgraph.sizes.symbolic_bytes`` keeps the symbols)."""
    if isinstance(value, torch.Tensor):
        numel = value.numel()
        return (optimization_hint(numel) if isinstance(numel, torch.SymInt) else numel) * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def collective_bytes(node: fx.Node) -> int:
    """Bytes of the full tensor a collective produces or consumes (the larger side)."""
    out = tensor_bytes(node.meta.get(VAL))
    ins = sum(tensor_bytes(arg.meta.get(VAL)) for arg in node.all_input_nodes)
    return max(out, ins)


# ------------------------------------------------------------------------------------------ graph mechanics
def fake_mode(gm: fx.GraphModule) -> FakeTensorMode:
    """The fake mode of the graph's values (the one capture traced with)."""
    for node in gm.graph.nodes:
        val = node.meta.get(VAL)
        if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode"):
            return val.fake_mode
    raise RuntimeError("graph has no fake tensor values")


def _val(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        return arg.meta[VAL]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_val(a) for a in arg)
    if isinstance(arg, dict):
        return {k: _val(v) for k, v in arg.items()}
    return arg


def compute_val(node: fx.Node, mode: FakeTensorMode) -> None:
    """Set ``node.meta[VAL]`` by running its op on its inputs' fake values."""
    with mode:
        node.meta[VAL] = _fake_kernel(node.target)(*_val(node.args), **_val(node.kwargs))


@functools.cache
def _fake_kernel(target: Any) -> Any:
    """What computes ``target``'s fake value: for zgraph's own operators their registered fake kernel, called
    directly (the same value; the dispatcher's custom-operator path costs several times more), else ``target``."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "zgraph":
        kernel = simple_registry.singleton.find(target._schema.name).fake_impl.kernel
        if kernel is not None:
            return kernel
    return target


def eliminate_dead_code(graph: fx.Graph) -> None:
    """``graph.eliminate_dead_code()``, deciding whether an operator has side effects once per operator (torch
    derives it from the schema for every node: most of the time a large graph's dead-code elimination takes)."""
    impure_random = True  # as Graph.eliminate_dead_code decides it
    if TracingContext.try_get():
        from torch._inductor import config as inductor_config

        impure_random = inductor_config.fallback_random
    known: dict[Any, bool] = {}

    def impure(node: fx.Node) -> bool:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return node.is_impure(impure_random)
        if node.target not in known:  # an operator's purity does not depend on its arguments
            known[node.target] = node.is_impure(impure_random)
        return known[node.target]

    graph.eliminate_dead_code(is_impure_node=impure)


def insert(
    gm: fx.GraphModule,
    target: Any,
    args: tuple,
    kwargs: dict | None = None,
    *,
    before: fx.Node | None = None,
    after: fx.Node | None = None,
    phase: str | None = None,
    mode: FakeTensorMode | None = None,
) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` before or after a node, with its fake value and a phase."""
    graph = gm.graph
    context = graph.inserting_before(before) if before is not None else graph.inserting_after(after)
    with context, warnings.catch_warnings():
        # a symbolic size among the arguments is computed by the graph after the pass (``bind_sizes``)
        warnings.filterwarnings("ignore", message="Raw SymInt value", category=UserWarning)
        node = graph.call_function(target, args, kwargs or {})
    anchor = before if before is not None else after
    node.meta[PHASE] = phase or anchor.meta.get(PHASE, FORWARD)
    compute_val(node, mode or fake_mode(gm))
    return node


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def add_input(gm: fx.GraphModule, name: str, spec: GraphInput, value: object) -> fx.Node:
    """A new placeholder after ``gm``'s others, standing for ``spec``, with ``value`` its fake value."""
    with gm.graph.inserting_after(placeholders(gm)[-1]):
        node = gm.graph.placeholder(name)
    node.meta[INPUT], node.meta[VAL] = spec, value
    return node


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def input_specs(gm: fx.GraphModule) -> list[GraphInput]:
    """The ``GraphInput`` of every placeholder, in order."""
    return [n.meta[INPUT] for n in placeholders(gm)]


def output_roles(gm: fx.GraphModule) -> list[GraphOutput]:
    """The ``GraphOutput`` of every returned value, in order."""
    return output_node(gm).meta[OUTPUTS]


def set_input_layout(node: fx.Node, layout: str, val: torch.Tensor) -> None:
    """Change what a placeholder receives (e.g. the rank's padded shard instead of the whole tensor)."""
    node.meta[INPUT] = dataclasses.replace(node.meta[INPUT], layout=layout)
    node.meta[VAL] = val
