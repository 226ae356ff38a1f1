"""The ``"nvme"`` offload tier: optimizer states and parameter shards in files (host state only).

* Each offloaded input has two files under a new per-process subdirectory of ``offload_dir``
  (``zgraph-offload-<pid>-*``; a new run never reads an old run's files): the *current* copy, which reloads
  read, and the *next* one, which write-backs write. Both are reserved on disk (``posix_fallocate``) when the
  input is first offloaded, so a full disk is found then, before anything changed (later writes overwrite
  reserved space); the next copies become current only once the whole graph ran (``commit``), so every reload of
  a step reads the value the step started from. A graph that fails midway leaves every current copy as it was
  (``abort``); an I/O error in a write-back, though, comes after the graph may have updated some state in place,
  so the error says to resume from a checkpoint.
* Reads ahead and write-backs run on one I/O thread. After each step the store gives the host memory freed by
  then (the step's reloaded copies) back to the operating system (``malloc_trim``), so the offloaded bytes leave
  the resident set between steps too, unless ``Config.keep_host_memory`` asks to keep freed memory.
* Blocks are read and written with plain file I/O (``os.pread`` / ``os.pwrite`` on the tensor's own memory; no
  ``torch.load``, no memory map) and the page cache is told to drop them. Files are removed when the store is
  dropped and at exit.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from zgraph.runtime.host_memory import return_freed_host_memory
from zgraph.runtime.offload_store import DEFAULT_WINDOW, OffloadError, State, TierStore, restore

LIVE_DIRS: dict[str, None] = {}


@atexit.register
def _remove_all() -> None:
    for path in list(LIVE_DIRS):
        shutil.rmtree(path, ignore_errors=True)
    LIVE_DIRS.clear()


def _bytes_of(t: Tensor) -> memoryview:
    """A contiguous host tensor's bytes as a writable memoryview (no copy)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


def _disk_error(what: str, path: str, nbytes: int, error: OSError) -> OffloadError:
    return OffloadError(
        f"zgraph offload: {what} a block of {nbytes} bytes (an optimizer state or parameter shard) at {path} failed "
        f"({error.strerror or error}); is the disk under offload_dir full? Nothing of the step was applied and "
        "every state is where it was, so the training state is intact; free space (or lower offload_fraction) "
        "and call the step again"
    )


class NvmeStore(TierStore):
    """Optimizer states and parameter shards of one binding in files under ``directory`` (module docstring)."""

    def __init__(self, directory: str | os.PathLike, window: int = DEFAULT_WINDOW, trim: bool = True):
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise OffloadError(f"zgraph offload: Config.offload_dir {directory!r} does not exist or is not a directory")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise OffloadError(f"zgraph offload: Config.offload_dir {directory!r} is not writable by this process")
        try:
            self.path = tempfile.mkdtemp(prefix=f"zgraph-offload-{os.getpid()}-", dir=directory)
        except OSError as error:
            raise OffloadError(f"zgraph offload: cannot create a directory in {directory!r}: {error}") from error
        super().__init__(window)
        LIVE_DIRS[self.path] = None
        self.trim = trim  # after each graph, give the freed host memory back (not with Config.keep_host_memory)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zgraph-offload")
        self._finalizer = weakref.finalize(self, _release, self.released, self.path, self._io)
        self._finalizer.atexit = False  # at exit _remove_all only removes the files

    def close(self) -> None:
        """Restore every state and remove the files now."""
        self._finalizer()

    def commit(self) -> None:
        super().commit()
        if self.trim:  # the reloaded states and shards, freed by now, leave the resident set too
            return_freed_host_memory()

    # ------------------------------------------------------------------------------------------- the tier
    def _make(self, fresh: list[tuple[tuple, int]]) -> list[tuple[str, str]]:
        blocks, made = [], []
        try:
            for key, nbytes in fresh:
                name = os.path.join(self.path, f"{key[0]}{len(self.states) + len(blocks)}")
                blocks.append((f"{name}.a", f"{name}.b"))
                for path in blocks[-1]:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    made.append(path)
                    try:
                        if nbytes and hasattr(os, "posix_fallocate"):
                            os.posix_fallocate(fd, 0, nbytes)
                        else:
                            os.ftruncate(fd, nbytes)
                    finally:
                        os.close(fd)
        except OSError as error:
            for path in made:
                os.unlink(path)
            raise _disk_error("reserving", made[-1] if made else self.path, nbytes, error) from error
        return blocks

    def _store(self, state: State, tensor: Tensor) -> None:
        write_file(state.block[state.current], tensor, state.nbytes)

    def _load(self, state: State, into: Tensor) -> None:
        load_file(state, into)

    def _read_async(self, state: State, like: Tensor) -> Handed:
        return handed(self._io, _read_new, state, like)

    def _write_async(self, state: State, value: Tensor) -> Future:
        # copied: the graph may reuse the value's memory while the I/O thread writes it; handed over in a list the
        # task empties, so the copy is freed before the write counts as done (the pool's worker holds a task's
        # arguments a moment after its future is done: under load, a copy still alive after the step returned)
        return self._io.submit(_write_handed, state.block[1 - state.current], [value.clone()], state.nbytes)

    def _committed(self, state: State) -> None:
        state.current ^= 1


class Handed:
    """A task on an I/O thread whose tensor result is handed over in a list that ``result()`` empties: once taken,
    the task no longer holds it (the pool's worker keeps a finished task, and its future with the future's
    result, a moment after the future is done: under load, a reloaded state seemed still alive after the step)."""

    def __init__(self, future: Future, box: list[Tensor]):
        self.future, self.box = future, box

    def result(self) -> Tensor:
        self.future.result()
        return self.box.pop()

    def exception(self) -> BaseException | None:
        return self.future.exception()


def handed(io: ThreadPoolExecutor, fn: Callable[..., Tensor], *args: Any) -> Handed:
    """``fn(*args)`` on ``io``, its result handed over (``Handed``)."""
    box: list[Tensor] = []
    return Handed(io.submit(lambda: box.append(fn(*args))), box)


def _read_new(state: State, like: Tensor) -> Tensor:
    out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    load_file(state, out)
    return out


def load_file(state: State, into: Tensor) -> None:
    """Read the state's current file into the host tensor ``into``."""
    path = state.block[state.current]
    view = _bytes_of(into)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise OffloadError(f"zgraph offload: {path} is shorter than the {len(view)} bytes written")
            done += n


def write_file(path: str, value: Tensor, nbytes: int, during_graph: bool = False) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            view, done = _bytes_of(value), 0
            while done < nbytes:
                done += os.pwrite(fd, view[done:], done)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError as error:
        if during_graph:
            raise OffloadError(
                f"zgraph offload: writing an updated optimizer state or parameter shard ({nbytes} bytes) to {path} "
                f"failed ({error.strerror or error}) while the step ran; its parameters may be partly updated: "
                "resume from the last checkpoint"
            ) from error
        raise _disk_error("writing", path, nbytes, error) from error


def _write_handed(path: str, handed: list[Tensor], nbytes: int) -> None:
    """``write_file`` during the graph of the one tensor in ``handed``, taken out of it first."""
    write_file(path, handed.pop(), nbytes, during_graph=True)


def _release(released: dict, path: str, io: ThreadPoolExecutor) -> None:
    """When the store is dropped: give the states their memory back, then remove the files."""
    io.shutdown(wait=True)
    try:
        restore(released, load_file)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        LIVE_DIRS.pop(path, None)
