"""zgraph's own graph-level operators.

``zgraph::grad_contribution(grad, param)`` marks, in the captured graph, every gradient autograd produces for
parameter number ``param`` on this rank, before it is accumulated into ``.grad`` or returned by
``torch.autograd.grad``. It is the identity: the captured graph computes each rank's *local* gradients. The
``reduce_scatter_grads`` pass replaces every marker by the cross-rank average (DDP's meaning), which is what
makes the distributed graph match eager PyTorch on the global batch. No marker survives the pass list.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import Tensor

from zgraph.graph import shard_rows


@torch.library.custom_op("zgraph::grad_contribution", mutates_args=())
def grad_contribution(grad: Tensor, param: int) -> Tensor:
    """Identity that marks a rank-local gradient contribution of parameter ``param``."""
    return grad.clone()


@grad_contribution.register_fake
def _grad_contribution_fake(grad: Tensor, param: int) -> Tensor:
    return torch.empty_like(grad)


def _grad_contribution_backward(ctx: object, grad_output: Tensor) -> tuple[Tensor, None]:
    return grad_output, None


grad_contribution.register_autograd(_grad_contribution_backward)

GRAD_CONTRIBUTION = torch.ops.zgraph.grad_contribution.default


# ------------------------------------------------------------------------------------------- layout operators
# The sharding passes express data movement with these four operators; ``lower_collectives`` replaces them by
# functional collectives (``torch.ops._c10d_functional``) and views. Layout: a tensor of a parameter's shape
# (d0, ...) is cut along dim 0 into ``world_size`` shards of ``ceil(d0 / world_size)`` rows, the last ones
# zero-padded, so every rank's shard has the same shape. The real implementations run the collectives, so
# every intermediate graph of the pass list can be executed as it is.


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad])


@torch.library.custom_op("zgraph::shard", mutates_args=())
def shard(x: Tensor, world_size: int, rank: int) -> Tensor:
    """This rank's dim-0 shard (zero-padded) of a tensor every rank holds whole."""
    rows = shard_rows(x.shape[0], world_size)
    return _pad_rows(x[rank * rows : (rank + 1) * rows], rows).clone()


@shard.register_fake
def _shard_fake(x: Tensor, world_size: int, rank: int) -> Tensor:
    return x.new_empty((shard_rows(x.shape[0], world_size), *x.shape[1:]))


@torch.library.custom_op("zgraph::unshard", mutates_args=())
def unshard(x: Tensor, dim0: int, world_size: int, group: str) -> Tensor:
    """The whole tensor (first ``dim0`` rows) from every rank's shard: an all-gather."""
    c10d = torch.ops._c10d_functional
    full = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), world_size, group))
    return full[:dim0].clone()


@unshard.register_fake
def _unshard_fake(x: Tensor, dim0: int, world_size: int, group: str) -> Tensor:
    return x.new_empty((dim0, *x.shape[1:]))


@torch.library.custom_op("zgraph::reduce", mutates_args=())
def reduce(x: Tensor, world_size: int, group: str) -> Tensor:
    """The average over ranks of each rank's ``x``: an all-reduce."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "avg", group))


@reduce.register_fake
def _reduce_fake(x: Tensor, world_size: int, group: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("zgraph::reduce_shard", mutates_args=())
def reduce_shard(x: Tensor, world_size: int, rank: int, group: str) -> Tensor:
    """This rank's shard of the average over ranks of each rank's ``x``: a reduce-scatter."""
    c10d = torch.ops._c10d_functional
    padded = _pad_rows(x, shard_rows(x.shape[0], world_size) * world_size).contiguous()
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(padded, "avg", world_size, group))


@reduce_shard.register_fake
def _reduce_shard_fake(x: Tensor, world_size: int, rank: int, group: str) -> Tensor:
    return x.new_empty((shard_rows(x.shape[0], world_size), *x.shape[1:]))


SHARD = torch.ops.zgraph.shard.default
UNSHARD = torch.ops.zgraph.unshard.default
REDUCE = torch.ops.zgraph.reduce.default
REDUCE_SHARD = torch.ops.zgraph.reduce_shard.default
LAYOUT_OPS = (SHARD, UNSHARD, REDUCE, REDUCE_SHARD)


# ------------------------------------------------------------------------------------------- bucketed forms
# The ``bucket`` pass merges several layout operators of one kind into one of these; ``lower_collectives``
# turns each into a single collective on a flat buffer. Same meaning as the one-tensor operators, element-wise.


@torch.library.custom_op("zgraph::unshard_bucket", mutates_args=())
def unshard_bucket(xs: list[Tensor], dim0s: list[int], world_size: int, group: str) -> list[Tensor]:
    """``[unshard(x, dim0) for x, dim0 in zip(xs, dim0s)]`` with one all-gather."""
    return [unshard(x, d, world_size, group) for x, d in zip(xs, dim0s)]


@unshard_bucket.register_fake
def _unshard_bucket_fake(xs: list[Tensor], dim0s: list[int], world_size: int, group: str) -> list[Tensor]:
    return [x.new_empty((d, *x.shape[1:])) for x, d in zip(xs, dim0s)]


@torch.library.custom_op("zgraph::reduce_shard_bucket", mutates_args=())
def reduce_shard_bucket(xs: list[Tensor], world_size: int, rank: int, group: str) -> list[Tensor]:
    """``[reduce_shard(x) for x in xs]`` with one reduce-scatter."""
    return [reduce_shard(x, world_size, rank, group) for x in xs]


@reduce_shard_bucket.register_fake
def _reduce_shard_bucket_fake(xs: list[Tensor], world_size: int, rank: int, group: str) -> list[Tensor]:
    return [x.new_empty((shard_rows(x.shape[0], world_size), *x.shape[1:])) for x in xs]


@torch.library.custom_op("zgraph::reduce_bucket", mutates_args=())
def reduce_bucket(xs: list[Tensor], world_size: int, group: str) -> list[Tensor]:
    """``[reduce(x) for x in xs]`` with one all-reduce."""
    return [reduce(x, world_size, group) for x in xs]


@reduce_bucket.register_fake
def _reduce_bucket_fake(xs: list[Tensor], world_size: int, group: str) -> list[Tensor]:
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]


UNSHARD_BUCKET = torch.ops.zgraph.unshard_bucket.default
REDUCE_SHARD_BUCKET = torch.ops.zgraph.reduce_shard_bucket.default
REDUCE_BUCKET = torch.ops.zgraph.reduce_bucket.default
BUCKETED = {UNSHARD: UNSHARD_BUCKET, REDUCE_SHARD: REDUCE_SHARD_BUCKET, REDUCE: REDUCE_BUCKET}
LAYOUT_OPS = (SHARD, UNSHARD, REDUCE, REDUCE_SHARD, UNSHARD_BUCKET, REDUCE_SHARD_BUCKET, REDUCE_BUCKET)


# ---------------------------------------------------------------------------------------- global reductions
# Reductions over gradients that must see every rank's shard. Capture emits ``grad_norm`` (for a norm of a
# parameter's gradient, e.g. inside ``clip_grad_norm_``) and ``nonfinite`` (fp16 overflow check); where the
# gradient is sharded, the ``clip_grad`` / ``loss_scale`` passes compute them on this rank's shard (zero
# padding is neutral) and ``combine`` the partial results across ranks.


@torch.library.custom_op("zgraph::grad_norm", mutates_args=())
def grad_norm(grad: Tensor, ord: float) -> Tensor:
    """``torch.linalg.vector_norm(grad, ord)`` of a whole gradient."""
    return torch.linalg.vector_norm(grad, ord)


@grad_norm.register_fake
def _grad_norm_fake(grad: Tensor, ord: float) -> Tensor:
    return grad.new_empty(())


@torch.library.custom_op("zgraph::nonfinite", mutates_args=())
def nonfinite(grads: list[Tensor]) -> Tensor:
    """True if any element of any of ``grads`` is inf or nan (a 0-d bool tensor)."""
    flags = [torch.logical_not(torch.isfinite(g)).any() for g in grads]
    return torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool)


@nonfinite.register_fake
def _nonfinite_fake(grads: list[Tensor]) -> Tensor:
    # on the gradients' device, as the real op's result is (a CPU flag beside CUDA gradients would move it)
    return grads[0].new_empty((), dtype=torch.bool) if grads else torch.empty((), dtype=torch.bool)


@torch.library.custom_op("zgraph::combine", mutates_args=())
def combine(x: Tensor, op: str, world_size: int, group: str) -> Tensor:
    """Every rank's ``x`` combined with ``op`` (``"sum"`` or ``"max"``): an all-reduce."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), op, group))


@combine.register_fake
def _combine_fake(x: Tensor, op: str, world_size: int, group: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


GRAD_NORM = torch.ops.zgraph.grad_norm.default
NONFINITE = torch.ops.zgraph.nonfinite.default
COMBINE = torch.ops.zgraph.combine.default
LAYOUT_OPS = (*LAYOUT_OPS, COMBINE)


# ---------------------------------------------------------------------------------------------- host reads
# A step graph reads nothing from the device on the host (a stall on a GPU) but ``flag_to_host`` and the numbers a
# step reads from a module's 0-d integer buffer kept there, where eager does (BatchNorm's with ``momentum=None``).
# zgraph's own deliberate reads outside the graph (fingerprints, checkpoint copies, offload write-backs) run inside
# ``host_read(reason)``: a marker only, which the device-path tests (``tests/standin.py``) tell from stray ones.
_HOST_READ: contextvars.ContextVar[str | None] = contextvars.ContextVar("zgraph_host_read", default=None)


@contextlib.contextmanager
def host_read(reason: str) -> Iterator[None]:
    """Mark a deliberate device-to-host read (``reason`` says which); changes nothing at run time."""
    token = _HOST_READ.set(reason)
    try:
        yield
    finally:
        _HOST_READ.reset(token)


def current_host_read() -> str | None:
    """The reason of the ``host_read`` region the caller is in, or None."""
    return _HOST_READ.get()


@torch.library.custom_op("zgraph::flag_to_host", mutates_args=())
def flag_to_host(flag: Tensor) -> Tensor:
    """A copy on the host of the overflow flag of fp16 loss scaling: the one device-to-host read a step graph
    makes, once per optimizer step and only with loss scaling and state on a device, to decide whether
    torch.optim's ``step`` counters (host tensors) advance — as ``torch.amp.GradScaler`` and DeepSpeed read
    theirs."""
    with host_read("the loss-scale overflow flag"):
        return flag.to("cpu", copy=True)


@flag_to_host.register_fake
def _flag_to_host_fake(flag: Tensor) -> Tensor:
    return torch.empty_like(flag, device="cpu")


# ------------------------------------------------------------------------------------------------ offload
# The ``offload`` pass replaces the reads of each offloaded optimizer state or stage-3 parameter shard by
# ``reload(state, slot)`` (one per phase that reads it) and its updated value, as the graph returns it, by
# ``write_back(value, slot)`` (``slot``: the input's position). The graph input itself is then only a shape:
# between steps its memory is released. The tier that serves the reads and takes the writes is the runtime's
# (``zgraph.runtime.offload``), installed around each run of the graph with ``offload_tier(...)``; the writes go
# to the input's next copy, made current only after the whole graph ran.


class OffloadTier:
    """Where ``reload`` reads and ``write_back`` writes (the runtime's store), and where ``stash`` puts a saved
    activation and ``unstash`` reads it back within one run of the graph (``zgraph.runtime.offload_activations``).
    The ``offload_activations`` pass sends a forward value the backward reads to ``stash(value, key)`` right after
    its last forward use (it may die there); its backward readers read ``unstash(token, key, ...)`` instead."""

    def read(self, slot: int, like: Tensor) -> Tensor:
        """A new tensor of ``like``'s shape and dtype holding the state of input ``slot``."""
        raise NotImplementedError

    def write(self, slot: int, value: Tensor) -> None:
        raise NotImplementedError

    def stash(self, key: int, value: Tensor) -> None:
        raise NotImplementedError

    def unstash(self, key: int, like: Tensor) -> Tensor:
        """A new tensor of ``like``'s shape, strides and dtype (``like`` is on meta) holding ``stash``'s value."""
        raise NotImplementedError


_TIER: contextvars.ContextVar[OffloadTier | None] = contextvars.ContextVar("zgraph_offload_tier", default=None)


@contextlib.contextmanager
def offload_tier(tier: OffloadTier) -> Iterator[None]:
    """Serve the ``reload`` / ``write_back`` nodes of graphs run inside the block from ``tier``."""
    token = _TIER.set(tier)
    try:
        yield
    finally:
        _TIER.reset(token)


def _tier() -> OffloadTier:
    tier = _TIER.get()
    if tier is None:
        raise RuntimeError("zgraph: a graph with offload nodes ran outside zgraph's runtime (no offload tier)")
    return tier


@torch.library.custom_op("zgraph::reload", mutates_args=())
def reload(state: Tensor, slot: int) -> Tensor:
    """The offloaded state at input ``slot``, read back from its tier (``state`` gives only shape and dtype)."""
    return _tier().read(slot, state)


@reload.register_fake
def _reload_fake(state: Tensor, slot: int) -> Tensor:
    return torch.empty(state.shape, dtype=state.dtype, device=state.device)


@torch.library.custom_op("zgraph::write_back", mutates_args=())
def write_back(value: Tensor, slot: int) -> Tensor:
    """Write the updated state of input ``slot`` to its tier; returns an empty token (the graph's output)."""
    _tier().write(slot, value.contiguous())
    return value.new_empty(0)


@write_back.register_fake
def _write_back_fake(value: Tensor, slot: int) -> Tensor:
    return value.new_empty(0)


@torch.library.custom_op("zgraph::stash", mutates_args=())
def stash(value: Tensor, key: int) -> Tensor:
    """Send the saved activation ``key`` to the tier; returns an empty token (which ``unstash`` reads)."""
    _tier().stash(key, value)
    return value.new_empty(0)


@stash.register_fake
def _stash_fake(value: Tensor, key: int) -> Tensor:
    return value.new_empty(0)


@torch.library.custom_op("zgraph::unstash", mutates_args=())
def unstash(token: Tensor, key: int, size: list[int], stride: list[int], dtype: torch.dtype) -> Tensor:
    """The saved activation ``key`` back from the tier: a new tensor of ``size``, ``stride`` and ``dtype``."""
    return _tier().unstash(key, torch.empty_strided(size, stride, dtype=dtype, device="meta"))


@unstash.register_fake
def _unstash_fake(token: Tensor, key: int, size: list[int], stride: list[int], dtype: torch.dtype) -> Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=token.device)


# ------------------------------------------------------------------------------------------ generator state
# ``torch.get_rng_state()`` / ``torch.set_rng_state(s)`` (and an accelerator module's) called while the step is
# traced are recorded as these two operators, so the graph saves and restores the generator where eager does:
# ``torch.utils.checkpoint`` saves the state before a block's forward and, when backward recomputes the block,
# sets it back (and then restores the state of that moment), so the recomputation draws the forward's dropout
# masks. Both are tagged ``nondeterministic_seeded``, like random ops: nothing merges, drops or reorders them
# among random draws (inductor, under ``fallback_random``, chains such ops in program order).


def _generator_device(device: str) -> torch.device:
    d = torch.device(device)
    if d.type != "cpu" and d.index is None:
        return torch.device(d.type, torch.get_device_module(d.type).current_device())
    return d


@torch.library.custom_op("zgraph::rng_state", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def rng_state(device: str) -> Tensor:
    """A copy of ``device``'s default generator state (a host ``uint8`` tensor, as ``torch.get_rng_state``)."""
    d = _generator_device(device)
    if d.type == "cpu":
        return torch.default_generator.get_state()
    return torch.get_device_module(d.type).get_rng_state(d)


# bytes of a generator's state: the CPU's Mersenne twister; CUDA's Philox seed and offset
_STATE_BYTES = {"cpu": 5056, "cuda": 16}


@rng_state.register_fake
def _rng_state_fake(device: str) -> Tensor:
    return torch.empty(_STATE_BYTES.get(torch.device(device).type, 16), dtype=torch.uint8)


@torch.library.custom_op("zgraph::set_rng_state", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def set_rng_state(state: Tensor, device: str) -> Tensor:
    """Set ``device``'s default generator to ``state`` (from ``rng_state``); returns an empty token."""
    d = _generator_device(device)
    if d.type == "cpu":
        torch.default_generator.set_state(state)
    else:
        torch.get_device_module(d.type).set_rng_state(state, d)
    return state.new_empty(0)


@set_rng_state.register_fake
def _set_rng_state_fake(state: Tensor, device: str) -> Tensor:
    return state.new_empty(0)


FLAG_TO_HOST = torch.ops.zgraph.flag_to_host.default
RNG_STATE = torch.ops.zgraph.rng_state.default
SET_RNG_STATE = torch.ops.zgraph.set_rng_state.default
torch.fx.node.has_side_effect(SET_RNG_STATE)  # kept with its token unused, whatever the caller's DCE assumes
RELOAD = torch.ops.zgraph.reload.default
WRITE_BACK = torch.ops.zgraph.write_back.default
STASH = torch.ops.zgraph.stash.default
UNSTASH = torch.ops.zgraph.unstash.default
torch.fx.node.has_side_effect(STASH)
