"""Reading the bytes of a tensor zgraph shards across ranks outside zgraph: a clear error, not a storage error.

Third-party serializers (``safetensors.torch.save_file``, Hugging Face ``save_pretrained``, anything that walks
``model.state_dict()``) read a tensor's bytes through its storage: ``untyped_storage()`` (safetensors, and
Hugging Face's shared-tensor check), ``storage()``. zgraph's sharded parameters, gradients and optimizer state
are DTensors, wrappers with no storage of their own (each rank holds a shard in the local tensor), where torch
only says ``invalid python storage``. ``refuse_storage_access`` makes those methods raise a
``zgraph.ShardedParameterError`` that says how to get whole tensors, for DTensors on zgraph's device mesh only
(every other DTensor behaves as before). It is the one hook every such reader passes through: ``state_dict()``
returns detached DTensors (new objects), so the check is on the mesh, which they keep, not on the parameter
objects. zgraph itself and ``torch.distributed.checkpoint`` read the local tensor (``to_local()``), never the
wrapper's storage. ``data_ptr()`` is left alone: ``torch.save`` and ``copy.deepcopy`` of a DTensor call it (and
work).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import DTensor

from zgraph.errors import ShardedParameterError
from zgraph.runtime.process_group import is_zgraph_mesh

STORAGE_METHODS = ("untyped_storage", "storage", "_typed_storage")


@functools.cache
def refuse_storage_access() -> None:
    """Install the guard on ``DTensor``'s storage methods (once per process; see the module docstring)."""
    for name in STORAGE_METHODS:
        setattr(DTensor, name, _guarded(name, getattr(DTensor, name)))


def _guarded(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def method(self: DTensor, *args: Any, **kwargs: Any) -> Any:
        if is_zgraph_mesh(self.device_mesh):
            raise ShardedParameterError(
                f"Tensor.{name}() of a tensor zgraph shards across ranks (a ZeRO-3 parameter, or a sharded "
                f"gradient or optimizer state; shape {tuple(self.shape)}): each rank holds only a shard, so there "
                "is no storage to read and serializers (safetensors, save_pretrained, ...) cannot save it. On every "
                "rank, save whole tensors: `state = zgraph.full_state_dict(model)` (e.g. "
                "`model.save_pretrained(path, state_dict=state)`, `safetensors.torch.save_file(state, path)`), or "
                "save inside `with zgraph.gather(model):`; `zgraph.save(path, model, optimizer)` writes a sharded "
                "checkpoint."
            )
        return original(self, *args, **kwargs)

    return method
