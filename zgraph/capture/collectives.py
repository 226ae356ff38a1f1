"""``torch.distributed`` collectives written in the user's step, traced as functional collectives.

``dist.all_reduce(t)`` and its siblings mutate their tensor through a process-group object, which a traced,
functionalised graph cannot hold. While zgraph traces a step, :func:`functional_c10d` makes the module-level
functions ``torch.distributed.all_reduce``, ``broadcast``, ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` record ``torch.ops._c10d_functional`` collectives (with their waits) and copy the result
into the tensor the user passed, which functionalisation turns into an ordinary graph output. So a step that
averages its loss for logging, or synchronises something itself, captures and replays exactly as it runs
eagerly. ``async_op=True`` returns a handle whose ``wait()`` does nothing (the graph already waits).

Only the default group and groups with a name (every ``ProcessGroup``) are supported, with the reduce operators
that functional collectives have (sum, avg, product, min, max). Other ``torch.distributed`` calls inside a step
raise ``CaptureError`` naming them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from zgraph.errors import CaptureError

_c10d = torch.ops._c10d_functional

_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
}


class _DoneWork:
    """What ``async_op=True`` returns inside a traced step: the collective is already waited for in the graph."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _op_name(op: Any, caller: str) -> str:
    name = _OPS.get(op)
    if name is None:
        raise CaptureError(f"torch.distributed.{caller} with op={op} inside a zgraph step is not supported")
    return name


def _group(group: Any) -> tuple[str, int]:
    group = group if group is not None else dist.group.WORLD
    return group.group_name, dist.get_world_size(group)


def _finish(target: Tensor, result: Tensor, async_op: bool) -> _DoneWork | None:
    target.copy_(_c10d.wait_tensor(result))
    return _DoneWork() if async_op else None


def _all_reduce(tensor: Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    name, _ = _group(group)
    return _finish(tensor, _c10d.all_reduce(tensor, _op_name(op, "all_reduce"), name), async_op)


def _broadcast(
    tensor: Tensor, src: int | None = None, group: Any = None, async_op: bool = False, group_src: int | None = None
) -> Any:
    name, _ = _group(group)
    if group_src is None:
        group_src = dist.get_group_rank(group, src) if group is not None else src
    return _finish(tensor, _c10d.broadcast(tensor, group_src, name), async_op)


def _all_gather_into_tensor(output: Tensor, input: Tensor, group: Any = None, async_op: bool = False) -> Any:
    name, size = _group(group)
    gathered = _c10d.all_gather_into_tensor(input.contiguous(), size, name)
    return _finish(output, gathered.view(output.shape), async_op)


def _reduce_scatter_tensor(
    output: Tensor, input: Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    name, size = _group(group)
    scattered = _c10d.reduce_scatter_tensor(input.contiguous(), _op_name(op, "reduce_scatter_tensor"), size, name)
    return _finish(output, scattered.view(output.shape), async_op)


_REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
}


@contextlib.contextmanager
def functional_c10d() -> Iterator[None]:
    """While tracing: ``torch.distributed``'s tensor collectives record functional collectives (see module doc).

    Without an initialised process group nothing is replaced (the calls fail as they would eagerly)."""
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    modules = (dist, dist.distributed_c10d)
    saved = [(module, name, getattr(module, name)) for module in modules for name in _REPLACEMENTS]
    try:
        for module, name, _ in saved:
            setattr(module, name, _REPLACEMENTS[name])
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def untraceable_collective(gm: torch.fx.GraphModule) -> str | None:
    """The first in-place c10d collective (``torch.ops.c10d.*``) a traced graph holds, or None: such a node
    carries a process-group object and cannot be replayed."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("c10d."):
            return str(node.target)
    return None
