"""``ZGraphAccelerator``: a user's own accelerate loop, run as zgraph steps.

    from zgraph.integrations.accelerate import ZGraphAccelerator

    accelerator = ZGraphAccelerator(config=zgraph.Config(stage=3), gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

The loop is accelerate's, unchanged; what runs is zgraph's:

- ``prepare`` does not wrap the model in DDP. Its ``forward`` becomes a zgraph step (split mode: the loss comes
  back with a compiled, sharded backward), so ``model(**batch)`` runs the captured forward at the Config's stage
  and ``accelerator.backward(loss)`` (``loss.backward()`` after accelerate's division for accumulation) runs the
  compiled backward, which averages the gradients over the ranks and, at stages 2 and 3, leaves each rank its
  shard (a ``DTensor``). Hooks the model has run around the step, as they do around ``forward``.
- The optimizer comes back as a ``ZGraphOptimizer`` (an ``AcceleratedOptimizer``): ``step()`` runs the optimizer
  as a zgraph step (sharded state at stages 1-3), at the steps where accelerate syncs gradients, like
  accelerate's; ``zero_grad()`` likewise.
- ``clip_grad_norm_`` is accelerate's (DTensor-aware: the global norm over every rank's shards), returned as a
  plain tensor. Gradient accumulation is accelerate's (``accumulate``, ``sync_gradients``); zgraph averages the
  gradients at every backward instead of at the last micro-batch (the same sum, more traffic).
- ``save_model`` writes ``zgraph.save_pretrained``'s streamed safetensors, ``get_state_dict`` the whole state
  (``zgraph.full_state_dict``), ``save_state`` / ``load_state`` a ``zgraph.save`` checkpoint (model, optimizer,
  scheduler, RNG; reshardable).

Refused when the accelerator is built, naming what to change: DeepSpeed, FSDP, Megatron and tensor-parallel
plugins, from arguments or accelerate's config (zgraph shards the model itself), ``mixed_precision="fp16"``
(a ``GradScaler``), ``dynamo_backend`` (zgraph compiles: ``Config(backend="inductor")``).
``mixed_precision="bf16"`` is zgraph's autocast (``Config.autocast_dtype``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from torch import nn
from torch.distributed.tensor import DTensor

import zgraph
from zgraph.config import Config

CHECKPOINT_DIR = "zgraph"
"""The sub-directory of ``save_state``'s directory that holds the ``zgraph.save`` checkpoint."""

_NOT_ZGRAPH = {
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.FSDP: "FSDP",
    DistributedType.MEGATRON_LM: "Megatron-LM",
}


class ZGraphOptimizer(AcceleratedOptimizer):
    """What ``ZGraphAccelerator.prepare`` returns for an optimizer: ``step()`` runs ``optimizer.step()`` as a
    zgraph step (``update``) when accelerate syncs gradients; the rest is ``AcceleratedOptimizer``'s."""

    def __init__(self, optimizer: torch.optim.Optimizer, update: Callable[[torch.optim.Optimizer], None]) -> None:
        super().__init__(optimizer, device_placement=False)
        self.update = update

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("ZGraphOptimizer.step(closure): a zgraph step cannot re-run a closure; call step()")
        if self.gradient_state.sync_gradients:
            self.update(self.optimizer)


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """The update step: what ``ZGraphOptimizer.step`` captures."""
    optimizer.step()


class ZGraphAccelerator(Accelerator):
    """An ``Accelerator`` whose prepared model runs its forward and backward as a zgraph step sharded at
    ``config``'s ZeRO stage, and whose prepared optimizer steps as one. Every other argument is accelerate's."""

    def __init__(self, *args: Any, config: Config | None = None, **kwargs: Any) -> None:
        config = config if config is not None else Config()
        _refuse_arguments(kwargs)
        fresh = not AcceleratorState._shared_state
        super().__init__(*args, **kwargs)
        try:
            _refuse_state(self)
        except ValueError:
            if fresh:  # leave accelerate's process-wide state as it was
                AcceleratorState._reset_state()
            raise
        if str(self.mixed_precision) == "bf16" and config.autocast_dtype is None and config.param_dtype is None:
            config = config.replace(autocast_dtype=torch.bfloat16)  # accelerate's bf16 is autocast; zgraph runs it
        self.native_amp = False  # the zgraph step owns precision
        self.zgraph_config = config
        self.zgraph_update = zgraph.distribute(config)(optimizer_step)

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        prepared = getattr(model, "_is_accelerate_prepared", False) or model in self._models
        model = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        if not prepared:
            model.forward = sharded_forward(model, self.zgraph_config)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        if isinstance(optimizer, ZGraphOptimizer):
            if optimizer not in self._optimizers:
                self._optimizers.append(optimizer)
            return optimizer
        prepared = ZGraphOptimizer(optimizer, self.zgraph_update)
        self._optimizers.append(prepared)
        return prepared

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        norm = super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # ------------------------------------------------------------------------------------ saving
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        return zgraph.full_state_dict(self.unwrap_model(model) if unwrap else model)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        if not safe_serialization:
            raise ValueError("ZGraphAccelerator.save_model writes safetensors only: leave safe_serialization=True")
        zgraph.save_pretrained(self.unwrap_model(model), save_directory, max_shard_size=max_shard_size)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        directory = self._state_dir(output_dir)
        model, optimizer, scheduler = self._one_of_each("save_state")
        zgraph.save(os.path.join(directory, CHECKPOINT_DIR), model, optimizer, scheduler=scheduler)
        return directory

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        directory = self._state_dir(input_dir)
        model, optimizer, scheduler = self._one_of_each("load_state")
        zgraph.load(os.path.join(directory, CHECKPOINT_DIR), model, optimizer, scheduler=scheduler)

    def _state_dir(self, directory: str | None) -> str:
        if directory is None:
            raise ValueError("ZGraphAccelerator: give save_state / load_state a directory")
        return os.fspath(directory)

    def _one_of_each(self, what: str) -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
        many = [f"{len(v)} {k}" for k, v in (("models", self._models), ("optimizers", self._optimizers)) if len(v) > 1]
        if many or not self._models or len(self._schedulers) > 1:
            found = ", ".join(many) or f"{len(self._models)} models, {len(self._schedulers)} schedulers"
            raise ValueError(
                f"ZGraphAccelerator.{what} keeps one model with at most one optimizer and scheduler (prepared: "
                f"{found}); call zgraph.save / zgraph.load for each model"
            )
        optimizer = self._optimizers[0].optimizer if self._optimizers else None
        scheduler = self._schedulers[0].scheduler if self._schedulers else None
        return self._models[0], optimizer, scheduler


def sharded_forward(model: nn.Module, config: Config) -> Callable[..., Any]:
    """``model.forward`` as a zgraph step over ``model``: what ``prepare`` installs on the model. The original is
    its ``__wrapped__`` (``inspect.signature(model.forward)`` is the model's), the step its ``zgraph_step``. It
    is not recorded as ``model._original_forward``, accelerate's mark for its autocast wrapper: ``unwrap_model(...,
    keep_fp32_wrapper=False)`` would strip the step, and a model zgraph sharded must keep running through it."""
    forward = model.forward

    def forward_step(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    step = zgraph.distribute(config)(forward_step)

    def call(*args: Any, **kwargs: Any) -> Any:
        return step(model, *args, **kwargs)

    call.__wrapped__ = forward  # type: ignore[attr-defined]  # inspect.signature(model.forward) is the model's
    call.zgraph_step = step  # type: ignore[attr-defined]  # the step itself (its captures, explain())
    call.__doc__ = forward.__doc__
    return call


def _refuse_arguments(kwargs: dict[str, Any]) -> None:
    for name in ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin", "torch_tp_plugin"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"ZGraphAccelerator({name}=...): zgraph shards the model itself; remove it and set the stage in the "
                "zgraph Config"
            )
    if str(kwargs.get("mixed_precision")) == "fp16" or kwargs.get("dynamo_backend") not in (None, "no", "NO"):
        _refuse_state_of(str(kwargs.get("mixed_precision")), str(kwargs.get("dynamo_backend") or "no"))
    if kwargs.get("parallelism_config") is not None:
        raise ValueError(
            "ZGraphAccelerator(parallelism_config=...): tensor, context and sequence parallelism are not zgraph's; "
            "zgraph shards data-parallel ranks (ZeRO): remove it"
        )


def _refuse_state(accelerator: Accelerator) -> None:
    """What accelerate chose from its arguments, its config file or ``accelerate launch`` flags."""
    if accelerator.distributed_type in _NOT_ZGRAPH:
        raise ValueError(
            f"ZGraphAccelerator: accelerate is configured for {_NOT_ZGRAPH[accelerator.distributed_type]} (a plugin "
            "or the accelerate config / launch flags); zgraph shards the model itself: remove it and set the stage "
            "in the zgraph Config"
        )
    _refuse_state_of(str(accelerator.mixed_precision), str(accelerator.state.dynamo_plugin.backend))


def _refuse_state_of(mixed_precision: str, dynamo_backend: str) -> None:
    if mixed_precision == "fp16":
        raise ValueError(
            'ZGraphAccelerator: mixed_precision="fp16" scales losses with torch.amp.GradScaler, which zgraph steps '
            'cannot run; use mixed_precision="bf16" (zgraph\'s autocast) or ZGraphTrainer with '
            "zgraph.Config(param_dtype=torch.float16, loss_scale='dynamic')"
        )
    if dynamo_backend.split(".")[-1].lower() != "no":
        raise ValueError(
            'ZGraphAccelerator: dynamo_backend is set; zgraph compiles the steps itself (Config(backend="inductor")): '
            "remove it"
        )
