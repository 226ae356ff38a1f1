"""The runtime of the update on the host (``Config.offload_update="host"``): ``HostRunner`` serves a graph's
``zgraph::to_host`` / ``to_device`` copies and runs its host partitions (``zgraph.runtime.host_partitions``) on a
thread of its own while the graph goes on.

* ``to_host``: the device value is copied into new host memory — on CUDA pinned, by DMA on a copy stream of the
  runner's, after the compute stream produced it, the graph going on at once; on a stand-in device synchronously;
  on the CPU a copy.
* ``to_device``: the host value is copied into new device memory on the copy stream (from pinned memory: an
  unpinned source, a cast the forward made on the host, is staged), and the compute stream waits for the copy where
  the value is.
* ``host_submit`` hands a partition, with the values the graph gives it, to the host thread; there it first waits
  for the copies issued before it (an event on the copy stream: the gradients it reads have landed, the copies that
  read the host state it updates are done), then runs the partition's ops — torch's CPU kernels, multithreaded —
  reading the values earlier partitions of the step made and keeping those it makes. One thread, so partitions run
  in the order they were submitted. ``host_fetch`` waits for a partition and gives one of its values.
* After the graph (``finish``): the copies are waited for (a value the graph returns may be one) and, for the exact
  update, every partition of the step; their errors are the step's. A failed graph (``abort``) leaves nothing
  running.

``Config.offload_overlap="one_step"``: a step's partitions wait, on a thread of their own, until the next step has
read the host parameters for the last time (``host_release``, the graph's; by the next ``finish`` at the latest), so
they run during the next step's backward while it computes with the parameters from before them; a step waits,
before its graph, for the update released in the step before it. A partition whose values the step reads itself
(``WITHIN_STEP``: the update of a parameter whole on every rank, all-gathered in the step) runs within its step.
``flush`` (anything that reads the state outside a step: ``state_dict()``, ``zgraph.save``, an eager ``step()``...)
runs what is still waiting now.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from zgraph.errors import ZGraphError
from zgraph.host_ops import HOST_PARTS, HostTier
from zgraph.ops import host_read
from zgraph.runtime.host_fused import host_adam

ENV_INPUTS = "zgraph_env_inputs"  # a partition's meta: names of the values of earlier partitions it reads (last)
ENV_OUTPUTS = "zgraph_env_outputs"  # a partition's meta: names of the values it returns, in order
WITHIN_STEP = "zgraph_within_step"  # a partition's meta: its values are read within its step (never delayed)


@dataclass
class _Step:
    """One run of a graph: its partitions, the values they made, their jobs."""

    parts: list[fx.GraphModule]
    gate: threading.Event
    values: dict[str, Any] = field(default_factory=dict)
    jobs: dict[int, Future] = field(default_factory=dict)
    late: set[int] = field(default_factory=set)  # one_step: the partitions that wait for the next step
    released: Any = None  # one_step: an event on the copy stream once the next step's reads of the state are issued


class HostRunner(HostTier):
    """Runs the host partitions of one binding's graphs and serves their copies (module docstring)."""

    def __init__(self, device: torch.device, params: frozenset[int], overlap: str | None = None):
        self.device = device
        self.params = params  # the binding's parameters (indices) updated on the host
        self.overlap = overlap
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.bytes_to_host = 0  # what the last step copied each way (explain())
        self.bytes_to_device = 0
        # daemon threads: an update still waiting for a next step never holds the process at exit; the update of
        # the step runs on one, the update waiting for the next step (one_step) on another
        self._queues: tuple[queue.SimpleQueue, ...] = (queue.SimpleQueue(), queue.SimpleQueue())
        for q in self._queues[: 1 if overlap is None else 2]:
            threading.Thread(target=_work, args=(q,), name="zgraph-host-update", daemon=True).start()
        self._finalizer = weakref.finalize(self, _stop, self._queues)
        self._step: _Step | None = None  # the graph running now
        self._pending: _Step | None = None  # one_step: the last step's update, waiting for this step's release
        self._running: _Step | None = None  # one_step: the update released in the last step

    # ------------------------------------------------------------------------------------------ around a graph
    def begin(self, parts: list[fx.GraphModule]) -> None:
        """Before a graph whose partitions are ``parts``: the update released in the step before is finished."""
        if self._running is not None:
            running, self._running = self._running, None
            self._wait(running)
        gate = threading.Event()
        if self.overlap is None:
            gate.set()
        self._step = _Step(parts, gate)
        self.bytes_to_host = self.bytes_to_device = 0

    def finish(self) -> None:
        """The graph ran: its copies are done; its partitions too (the exact update), or, with ``one_step``, they
        wait for the next step."""
        step, self._step = self._step, None
        if self.stream is not None:
            self.stream.synchronize()
        self._wait(step, late=False)
        if self.overlap is None:
            return
        if self._pending is not None:  # this graph read no host parameter: the last step's update runs now
            self.release()
        self._pending = step

    def abort(self) -> None:
        """The graph failed: what it started, and what waits, runs to its end (errors dropped: the graph's is
        raised)."""
        step, self._step = self._step, None
        for waiting in (self._running, self._pending, step):
            if waiting is not None:
                waiting.gate.set()
                self._wait(waiting, raise_error=False)
        self._running = self._pending = None

    def flush(self) -> None:
        """Run the update still waiting (``one_step``) now, and wait for it."""
        for waiting in (self._running, self._pending):
            if waiting is not None:
                waiting.gate.set()
        running, pending = self._running, self._pending
        self._running = self._pending = None
        for waiting in (running, pending):
            if waiting is not None:
                self._wait(waiting)

    materialize = flush  # what reads of the state outside a step call (zgraph.runtime.offload_store.watch)

    def close(self) -> None:
        self.flush()
        self._finalizer()

    # -------------------------------------------------------------------------------------- the graph's ops
    def to_host(self, x: Tensor) -> Tensor:
        self.bytes_to_host += x.numel() * x.element_size()
        if x.device.type == "cpu":
            return x.clone(memory_format=torch.contiguous_format)
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.stream is not None)
        if self.stream is None:
            with host_read("host update: a value copied to the host"):
                out.copy_(x)
            return out
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # ``x`` is computed by then
        with torch.cuda.stream(self.stream):
            out.copy_(x, non_blocking=True)
        x.record_stream(self.stream)
        return out

    def to_device(self, x: Tensor, device: torch.device) -> Tensor:
        self.bytes_to_device += x.numel() * x.element_size()
        if device.type == "cpu":
            return x.clone(memory_format=torch.contiguous_format)
        out = torch.empty(x.shape, dtype=x.dtype, device=device)
        if self.stream is None:
            out.copy_(x)
            return out
        source = x if x.is_pinned() else x.pin_memory()
        current = torch.cuda.current_stream(device)
        self.stream.wait_stream(current)  # ``out``'s memory is free by then
        with torch.cuda.stream(self.stream):
            out.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        out.record_stream(self.stream)
        current.wait_event(done)
        return out

    def submit(self, part: int, inputs: list[Tensor]) -> None:
        step = self._step
        late = self.overlap is not None and not step.parts[part].meta.get(WITHIN_STEP, False)
        job: Future = Future()
        work = functools.partial(HostRunner._job, step, part, inputs, self._copies_issued(), late)
        self._queues[late].put((job, work))
        step.jobs[part] = job
        if late:
            step.late.add(part)

    def fetch(self, part: int, index: int) -> Tensor:
        step = self._step
        if part in step.late:
            raise ZGraphError(
                'zgraph: Config.offload_overlap="one_step" cannot be honoured here: the step reads a value of its '
                "own host update (a state the update cannot write in place) before it returns. Use offload_overlap=None"
            )
        step.jobs[part].result()
        return step.values[step.parts[part].meta[ENV_OUTPUTS][index]]

    def release(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.released = self._copies_issued()
        pending.gate.set()
        self._running = pending

    # ---------------------------------------------------------------------------------------------- helpers
    def _copies_issued(self) -> Any:
        """An event on the copy stream after the copies issued so far (None without one)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    @staticmethod
    def _job(step: _Step, part: int, inputs: list[Tensor], issued: Any, late: bool) -> None:
        if late:  # one_step: the next step has read the parameters
            step.gate.wait()
        for event in (issued, step.released if late else None):
            if event is not None:
                event.synchronize()
        gm = step.parts[part]
        args = [*inputs, *(step.values[name] for name in gm.meta[ENV_INPUTS])]
        with torch.no_grad():
            values = gm(*args)
        step.values.update(zip(gm.meta[ENV_OUTPUTS], values))

    @staticmethod
    def _wait(step: _Step, raise_error: bool = True, late: bool = True) -> None:
        """Wait for ``step``'s partitions (``late``: those waiting for the next step too)."""
        for part, job in step.jobs.items():
            if late or part not in step.late:
                error = job.exception()
                if error is not None and raise_error:
                    raise error


def describe(runner: HostRunner | None, fallback: str | None, final: fx.GraphModule, params: tuple) -> list[str]:
    """``explain()``'s lines about the update on the host: what runs where, what crosses, or why it does not."""
    if fallback is not None:
        return [f'offload_update: the update runs on the device: {fallback} (offload_update="host" refuses it)']
    if runner is None:
        return []
    parts = final.meta.get(HOST_PARTS) or []
    ops = sum(1 for gm in parts for n in gm.graph.nodes if n.op == "call_function")
    fused = sum(1 for gm in parts for n in gm.graph.nodes if n.target is host_adam)
    hosted = [p for p in params if p.index in runner.params]
    size = sum(math.prod(p.shape) for p in hosted)
    copies = runner.bytes_to_host + runner.bytes_to_device
    lines = [
        f'offload_update="host": the master values and optimizer states of {len(hosted)} parameters live in host '
        f"memory; {ops} optimizer ops run on the host (torch's CPU kernels) in {len(parts)} partitions on a host "
        "thread, each started once the gradients it reads are copied (zgraph.to_host / zgraph.to_device: the "
        "`host_update` pass; zgraph.host_submit: the `host_partitions` rewrite)",
        f"  the last step copied {runner.bytes_to_host} bytes to the host and {runner.bytes_to_device} to the "
        f"device: {copies / max(1, size):.1f} bytes per parameter",
        f"  {fused} of them updated by torch's fused CPU Adam/AdamW kernel (bitwise eager AdamW(fused=True) on the "
        "CPU; an optimizer built with fused=False, or an update of another shape, runs op by op: the host_fused "
        "rewrite)",
    ]
    if runner.overlap == "one_step":
        within = sum(1 for gm in parts if gm.meta.get(WITHIN_STEP))
        lines.append(
            f'offload_overlap="one_step": {len(parts) - within} partitions run during the next step, which computes '
            f"with the parameters from before them (their update applied one step late); {within} within the step "
            "(the update of parameters whole on every rank, all-gathered in the step, and what it reads)"
        )
    if runner.device.type == "cuda":
        lines.append(
            f"the update on the host has not yet run on a GPU in zgraph's own checks: untested on {runner.device}"
        )
    return lines


def _stop(queues: tuple[queue.SimpleQueue, ...]) -> None:
    for q in queues:
        q.put(None)


def _work(jobs: queue.SimpleQueue) -> None:
    """The host thread: runs ``(future, fn)`` items in order until it is handed None."""
    while True:
        item = jobs.get()
        if item is None:
            return
        job, fn = item
        try:
            job.set_result(fn())
        except BaseException as error:  # the step that waits for it raises it
            job.set_exception(error)
