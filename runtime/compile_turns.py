"""Ranks of one host compile the same graph one after another, so that all but the first load it from inductor's
on-disk cache instead of compiling it again.

Every rank of a step compiles the same transformed graph. Compiled at once, N ranks on a host spend N times the CPU
(a cold compile of a GPT step is tens of seconds each) and none of them gets it sooner. Here the first rank to reach
a graph (``store.add`` on the process group's store, keyed by the host, inductor's cache directory and the graph's
code and input layouts) compiles it; the others wait until it is done and then compile it too, which inductor's FX
graph cache serves in a fraction of the time. A rank that does not hear within ``timeout`` seconds (the first is
gone or slow) compiles anyway: waiting never hangs and never changes what is compiled. Without a started process
group, or one store for one rank, nothing waits.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.fx as fx

from zgraph.graph import VAL, placeholders

_PREFIX = "zgraph/compile/"


def graph_key(gm: fx.GraphModule) -> str:
    """A digest of what inductor compiles: the graph's code and its inputs' shapes, strides, dtypes, devices."""
    digest = hashlib.sha256(gm.code.encode())
    for node in placeholders(gm):
        val = node.meta.get(VAL)
        if isinstance(val, torch.Tensor):
            digest.update(f"{tuple(val.shape)}{val.stride()}{val.dtype}{val.device}".encode())
        else:
            digest.update(repr(type(val)).encode())
    return digest.hexdigest()


@contextlib.contextmanager
def compile_turn(gm: fx.GraphModule, timeout: float) -> Iterator[None]:
    """Run the compile of ``gm`` in the body: first on this host, or after the rank that was first."""
    store = _store()
    if store is None:
        yield
        return
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = f"{socket.gethostname()}:{cache_dir()}:{graph_key(gm)}"
    done = f"{key}/done"
    if store.add(f"{key}/claim", 1) == 1:
        try:
            yield
        finally:
            store.set(done, b"1")
        return
    with contextlib.suppress(dist.DistError):
        store.wait([done], timedelta(seconds=timeout))
    yield


def _store() -> dist.Store | None:
    """The default group's store, where several ranks may share a host's cache; None otherwise."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    try:
        return dist.PrefixStore(_PREFIX, dist.distributed_c10d._get_default_store())
    except (RuntimeError, ValueError, AttributeError):  # a fake process group has no store
        return None
