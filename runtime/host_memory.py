"""Keep freed host memory for the next step, as the CUDA caching allocator keeps device memory.

PyTorch allocates CPU tensors with the C library's ``malloc``. glibc returns memory to the operating system when
more than a threshold is free at the top of its heap, and serves large blocks with ``mmap`` (unmapped on free);
its thresholds adapt to the largest block freed so far. A training step frees most of its activations at the
end of backward, so from one step to the next the same memory is given back and taken again: every page
comes back through a page fault and is zeroed by the kernel — on the bench GPT tens of thousands of faults per
step, a tenth of the step on a VM. Whether a given step crosses the threshold depends on the order tensors are
freed in, not on the amount of work.

``keep_freed_host_memory`` sets, once for the process (``mallopt``): every block comes from the heap (no
``mmap``, whose blocks are unmapped on free: a large model's logits or embedding gradient, hundreds of MiB, would
fault in again every step), and the heap is never trimmed. The resident size then stays at its peak between
steps, as GPU memory does under PyTorch's caching allocator; the peak itself does not change.
It is opt-in, ``zgraph.Config(keep_host_memory=True)``: the setting is the whole process's, not only zgraph's.
The same from outside, for any program (eager PyTorch, DDP, FSDP2, DeepSpeed alike), before Python starts::

    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615

Other C libraries: nothing is done.

``return_freed_host_memory`` does the opposite, once: ``malloc_trim(0)`` gives every wholly free page of every
heap back to the operating system. The offload tier calls it after each step (unless ``keep_host_memory``), so
what moved to files leaves the resident set between steps as well as the live tensors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

GLIBC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615"
"""The same setting as glibc tunables, for a process's environment (read by glibc when the process starts)."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER_TRIM = -1


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def return_freed_host_memory() -> bool:
    """Give the free pages of every malloc heap back to the operating system (glibc's ``malloc_trim(0)``); True
    if glibc did (False: not glibc, or nothing to give back)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


@functools.cache
def keep_freed_host_memory() -> bool:
    """Serve every block from the heap and never trim it (once per process); True if glibc took both."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
