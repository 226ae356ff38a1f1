"""The accelerate pieces ``ZGraphTrainer`` swaps in, so that Trainer's own loop leaves the update to zgraph.

- ``ZGraphAccelerator``: ``prepare`` leaves the model unwrapped (no DDP: zgraph averages gradients and shards
  the state itself) and gives the optimizer back as an ``OptimizerHandle``; autocast is zgraph's
  (``Config.autocast_dtype`` / ``param_dtype``), not accelerate's. A model zgraph has sharded already is not
  moved (``holds_shards``).
- ``OptimizerHandle``: what Trainer holds as ``self.optimizer``. Its ``param_groups`` are the optimizer's own (an
  LR scheduler built on the handle sets the optimizer's learning rates, which a zgraph step reads as graph
  inputs); its ``step()`` does nothing, because the zgraph step already ran the optimizer, and it is never handed
  to the step (zgraph sees the plain ``torch.optim`` optimizer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.distributed.tensor import DTensor


class OptimizerHandle(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` view of ``optimizer`` whose ``step()`` is a no-op (the zgraph step steps it)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no super().__init__: every field is delegated
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Nothing: the zgraph step ran ``self.optimizer.step()`` inside its graph."""
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"OptimizerHandle({self.optimizer!r})"


class ZGraphAccelerator(Accelerator):
    """An ``Accelerator`` that prepares the model without a DDP wrapper and the optimizer as an
    ``OptimizerHandle``; data loaders, gathering for metrics and process state are accelerate's own."""

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        if holds_shards(model):
            device_placement = False  # zgraph placed the shards; .to() would only copy them
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        return optimizer if isinstance(optimizer, OptimizerHandle) else OptimizerHandle(optimizer)


def holds_shards(model: nn.Module) -> bool:
    """Whether zgraph has sharded ``model`` already (``zgraph.load_pretrained`` into a meta model, an earlier
    step): its parameters are DTensors on their device, which ``model.to(device)`` would only replace by copies
    (``torch.utils.swap_tensors``; zgraph adopts them, but the copy is work and memory for nothing)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def as_zgraph_accelerator(accelerator: Accelerator) -> ZGraphAccelerator:
    """``accelerator`` itself, made a ``ZGraphAccelerator`` (the Trainer built it; its state stays), with
    accelerate's autocast off: the zgraph step owns precision."""
    accelerator.__class__ = ZGraphAccelerator
    accelerator.native_amp = False
    return accelerator
