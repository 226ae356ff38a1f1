"""The ``"cpu"`` offload tier for state on a device (CUDA): optimizer states and parameter shards in host memory.

On the CPU ``"cpu"`` is the identity (the state is in host memory already) and there is no store. With the
state on a device:

* each offloaded input has one block of host memory, pinned (page-locked) on CUDA so that copies run
  asynchronously, by DMA; the blocks are allocated when the input is first offloaded, so too little host memory
  is reported at set-up, before anything changed;
* between steps the input's device storage is released (``zgraph.runtime.offload_store``); in the graph each
  reload copies the block into a new device tensor on a copy stream of the store's own, started ahead in the
  graph's order within ``window`` bytes, and the compute stream waits for the copy's event only where the
  reload's value is read; each write-back copies the new value into the block on the copy stream after the
  compute stream has produced it (the streams ordered by events, the value's memory kept for the copy by
  ``record_stream``), while the step goes on;
* ``commit`` waits for the copy stream, so the next step reads what this one wrote. One copy per input, written
  in place: a step that fails midway leaves the states it had written updated, as the in-place updates of a step
  without offload do.

The arithmetic is the graph's, on the device, in the same order, so training is bitwise the same as without
offload. (DeepSpeed's ZeRO-Offload runs the optimizer update itself on the host, with its CPU Adam, moving
gradients down and 16-bit parameters up instead of the states both ways: less traffic, other numbers; not this
tier.) Elsewhere than CUDA (the tests' stand-in device) copies are synchronous and the blocks not pinned.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from zgraph.ops import host_read
from zgraph.runtime.offload_store import DEFAULT_WINDOW, OffloadError, State, TierStore, restore


class _Read:
    """A copy to the device in flight: ``result()`` makes the current stream wait for it, returns the tensor."""

    def __init__(self, tensor: Tensor, event: torch.cuda.Event | None):
        self.tensor, self.event = tensor, event

    def result(self) -> Tensor:
        if self.event is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.event)
        return self.tensor

    def exception(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class _Write:
    """A copy to host memory in flight: ``result()`` waits until it is done."""

    def __init__(self, event: torch.cuda.Event | None):
        self.event = event

    def result(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    exception = result


def _host_view(state: State, like: Tensor) -> Tensor:
    """The state's block as a host tensor of ``like``'s dtype and shape."""
    return state.block[: state.nbytes].view(like.dtype).view(like.shape)


def _load_block(state: State, into: Tensor) -> None:
    """Copy the state's block into the device tensor ``into``, now."""
    into.copy_(_host_view(state, into))


class HostStore(TierStore):
    """Optimizer states and parameter shards of one binding, for state on ``device``, in host memory (module
    docstring)."""

    def __init__(self, device: torch.device, window: int = DEFAULT_WINDOW):
        super().__init__(window)
        self.device = device
        self.pinned = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.pinned else None
        self._finalizer = weakref.finalize(self, restore, self.released, _load_block)

    def close(self) -> None:
        """Give every released state its device memory back now."""
        self._finalizer()

    def _make(self, fresh: list[tuple[tuple, int]]) -> list[Tensor]:
        try:
            return [torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned) for _, nbytes in fresh]
        except RuntimeError as error:
            total = sum(nbytes for _, nbytes in fresh)
            raise OffloadError(
                f"zgraph offload: cannot allocate {total} bytes of {'pinned ' if self.pinned else ''}host memory for "
                f"the offloaded optimizer states and parameter shards ({error}); nothing was changed. Offload less "
                "(Config.offload_fraction), or shard over more ranks"
            ) from error

    def _store(self, state: State, tensor: Tensor) -> None:
        with host_read("offload: a state's first copy to host memory"):
            _host_view(state, tensor).copy_(tensor)

    def _load(self, state: State, into: Tensor) -> None:
        _load_block(state, into)

    def _read_async(self, state: State, like: Tensor) -> _Read:
        out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        host = _host_view(state, like)
        if self.stream is None:
            out.copy_(host)
            return _Read(out, None)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # ``out``'s memory is free by then
        with torch.cuda.stream(self.stream):
            out.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        out.record_stream(self.stream)
        return _Read(out, event)

    def _write_async(self, state: State, value: Tensor) -> _Write:
        host = _host_view(state, value)
        if self.stream is None:
            with host_read("offload: a write-back to host memory"):
                host.copy_(value)
            return _Write(None)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # ``value`` is computed by then
        with torch.cuda.stream(self.stream):
            host.copy_(value, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        value.record_stream(self.stream)
        return _Write(event)
