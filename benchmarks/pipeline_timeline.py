"""What ``benchmarks.pipeline`` reads from a rank while it runs: each compute action's span and the bytes sent.

``Recorder`` wraps the methods a system runs one pipeline action with (zgraph's ``RankRunner._forward`` ...,
``torch.distributed.pipelining``'s ``forward_one_chunk`` ..., DeepSpeed's ``_exec_forward_pass`` ...) so that each
call, while recording, appends a ``Span``: its kind and its start and end on ``time.perf_counter`` (one clock for
every process of the machine, so the ranks' timelines line up), and the CPU time its thread spent in it.
``CommBytes`` counts, under a dispatch mode, the bytes of every ``c10d`` op a step runs (``dist.send`` /
``isend`` as point to point, the collectives, functional ones included). ``bubble`` is the arithmetic: each
rank's idle share of its pipeline's compute window, as ``zgraph.runtime.pipeline_simulate`` defines the bubble.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Span(NamedTuple):
    """One compute action of one rank: ``kind`` (``F``, ``B``, ``I``, ``W``), start and end (``perf_counter``
    seconds), and the CPU seconds its thread used meanwhile."""

    kind: str
    start: float
    end: float
    cpu: float


class Recorder:
    """Appends a ``Span`` per call of the wrapped methods while ``on``."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.on = False

    def wrap(self, cls: type, method: str, kind: str) -> None:
        """Time ``cls.method`` as an action of ``kind`` from now on (the class is patched in this process)."""
        setattr(cls, method, self.timed(getattr(cls, method), kind))

    def timed(self, real: Callable[..., Any], kind: str) -> Callable[..., Any]:
        """``real`` timed as an action of ``kind``."""
        recorder = self

        @functools.wraps(real)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not recorder.on:
                return real(*args, **kwargs)
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return real(*args, **kwargs)
            finally:
                recorder.spans.append(Span(kind, start, time.perf_counter(), time.thread_time() - cpu))

        return timed

    def take(self) -> list[Span]:
        """The spans recorded since the last ``take``."""
        spans, self.spans = self.spans, []
        return spans


def busy_seconds(spans: Sequence[Span]) -> float:
    """The length of the union of ``spans`` (an action that calls another is not counted twice)."""
    total, reach = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.end > reach:
            total += s.end - max(s.start, reach)
            reach = s.end
    return total


def bubble(ranks: Sequence[Sequence[Span]]) -> tuple[float, list[float]]:
    """One pipeline's step from its ranks' compute spans: the window from the first action's start to the last's
    end over the ranks, each rank's idle share of it, and their mean (the bubble: the share of ``ranks x window``
    in which no rank computes, ``(P - 1) / (M + P - 1)`` for GPipe and 1F1B with equal stages)."""
    every = [s for spans in ranks for s in spans]
    if not every:
        raise ValueError("bubble: no compute spans recorded")
    window = max(s.end for s in every) - min(s.start for s in every)
    idle = [1.0 - busy_seconds(spans) / window for spans in ranks]
    return sum(idle) / len(idle), idle


def ideal_bubble(ranks: int, microbatches: int) -> float:
    """GPipe's and 1F1B's bubble with equal stages: ``(P - 1) / (M + P - 1)``."""
    return (ranks - 1) / (microbatches + ranks - 1)


_SKIPPED = {"wait_tensor", "_wrap_tensor_autograd", "recv_", "recv_any_source_", "barrier", "monitored_barrier_"}


class CommBytes(TorchDispatchMode):
    """Bytes of the ``c10d`` ops run under the mode on this rank: ``p2p`` (what it sends), ``collective`` (each
    collective's payload: the largest of its arguments, a list of tensors summed: an all-gather's output, a
    reduce-scatter's input), and ``calls`` per op name."""

    def __init__(self) -> None:
        super().__init__()
        self.p2p = 0
        self.collective = 0
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func._opname
        if func.namespace in ("c10d", "_c10d_functional") and name not in _SKIPPED:
            size = max((_bytes(a) for a in (*args, *(kwargs or {}).values())), default=0)
            if name == "send":
                self.p2p += size
            else:
                self.collective += size
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _bytes(value: Any) -> int:
    leaves = torch.utils._pytree.tree_leaves(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
