"""``ZGraphTrainer``: a ``transformers.Trainer`` whose update is one zgraph step.

    from zgraph.integrations.transformers import ZGraphTrainer, ZGraphTrainingArguments

    args = ZGraphTrainingArguments("out", deepspeed="ds_config.json", gradient_accumulation_steps=2, ...)
    trainer = ZGraphTrainer(model=model, args=args, train_dataset=data)  # or zgraph_config=zgraph.Config(stage=3)
    trainer.train()

Each optimizer step's micro-batches (``gradient_accumulation_steps`` of them) are handed to one zgraph step, which
runs every micro-batch's forward (Trainer's ``compute_loss``, so a subclass's loss is honoured) and backward,
clips to ``max_grad_norm``, steps the optimizer and zeroes the gradients: one graph, sharded at the Config's ZeRO
stage. Trainer's own loop does the rest — data, the LR scheduler (stepped right after the graph; zgraph reads
learning rates as graph inputs), logging (``loss``, ``grad_norm``: the step's global norm), callbacks, evaluation
and prediction (in ``zgraph.gather``: whole parameters on every rank), checkpoints.

The overrides, and why (Trainer's source, transformers 5):

- ``create_accelerator_and_postprocess``: the accelerator prepares the model without DDP and the optimizer as a
  handle whose ``step()`` is a no-op (``hf_accelerate``);
- ``_move_model_to_device``: not for a model zgraph has sharded already (a meta model ``zgraph.load_pretrained``
  filled): ``.to()`` would copy every shard into a new DTensor for nothing;
- ``training_step``: collects the micro-batches; at the last one runs the zgraph step (earlier ones return 0, so
  Trainer's summed loss is the same), then hands the metric tensors ``compute_loss`` recorded in the step to
  ``log_step_metrics`` (a subclass's hook: ``zgraph.integrations.trl``);
- ``_clip_grad_norm`` / ``_get_grad_norm``: the norm the step computed;
- ``create_optimizer`` / ``create_scheduler``: a DeepSpeed JSON's ``optimizer`` / ``scheduler`` sections, built by
  ``zgraph.optimizer_from_deepspeed`` (as DeepSpeed's integration builds them); else Trainer's;
- ``save_model``: ``zgraph.save_pretrained`` (streamed safetensors; no whole copy on one rank);
- ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler`` / ``_load_from_checkpoint`` /
  ``_load_best_model``: a checkpoint's ``zgraph/`` directory (``zgraph.save`` / ``zgraph.load``: model,
  optimizer, scheduler, RNG, sharded and reshardable) instead of Trainer's per-file state;
- ``evaluation_loop``: inside ``zgraph.gather``.

Without a ``zgraph_config`` and a DeepSpeed JSON the step runs ``zgraph.Config()`` (stage 0, inductor).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

import zgraph
from zgraph.config import Config
from zgraph.deepspeed.optim import scheduler_from_deepspeed
from zgraph.integrations import hf_deepspeed
from zgraph.integrations.hf_accelerate import OptimizerHandle, as_zgraph_accelerator, holds_shards
from zgraph.integrations.hf_args import TrainerSetup, setup

CHECKPOINT_DIR = "zgraph"
"""The sub-directory of a Trainer checkpoint (``checkpoint-N/``) that holds the ``zgraph.save`` checkpoint."""


class ZGraphTrainingArguments(TrainingArguments):
    """``TrainingArguments`` whose ``deepspeed`` (a JSON path or a dict) is left to ``ZGraphTrainer``: the plain
    class builds DeepSpeed's own config there, which needs the DeepSpeed package; zgraph maps the same file."""

    def __post_init__(self) -> None:
        deepspeed, self.deepspeed = self.deepspeed, None
        super().__post_init__()
        self.deepspeed = deepspeed


def zgraph_arguments(args: TrainingArguments | None, cls: type = ZGraphTrainingArguments) -> TrainingArguments | None:
    """``args`` as ``cls`` (``ZGraphTrainingArguments`` or a subclass) when its ``deepspeed`` is set: re-run without
    DeepSpeed's plugin."""
    if args is None or isinstance(args, cls) or not args.deepspeed:
        return args
    fields = {f.name: getattr(args, f.name) for f in args.__dataclass_fields__.values() if f.init}
    return cls(**fields)


def update_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list, num_items: Any, loss_of: Any, clip: float
) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, torch.Tensor]]]:
    """One optimizer step over ``micro_batches`` (what the zgraph step captures): each micro-batch's loss
    (``loss_of`` gives it, already scaled for accumulation, with a dict of metric tensors) backward, clipping to
    ``clip`` (0: the norm is only measured), the optimizer. Returns the summed loss, the global gradient norm before
    clipping and each micro-batch's metric tensors (graph outputs: their values are read after the step)."""
    total = None
    metrics = []
    for inputs in micro_batches:
        loss, values = loss_of(model, inputs, num_items)
        loss.backward()
        metrics.append(values)
        total = loss.detach() if total is None else total + loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad()
    return total, norm, metrics


class ZGraphTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer step (micro-batches, clipping, optimizer) is one zgraph step;
    configured by ``zgraph_config`` (a ``zgraph.Config``) or the arguments' ``deepspeed`` JSON, with
    ``zgraph_options`` (a dict of Config fields: ``{"backend": "eager"}``) set over either. Every other argument
    is Trainer's.

    A subclass whose ``compute_loss`` measures more than the loss (TRL's metrics) cannot read tensor values inside
    the step (it is traced once and replayed): inside it, ``self.step_metrics`` is a dict (None elsewhere) where
    ``compute_loss`` puts metric tensors, which come out of the step and reach ``log_step_metrics`` after it."""

    arguments_class: type = ZGraphTrainingArguments
    """What ``args`` with a ``deepspeed`` JSON are rebuilt as (``zgraph_arguments``)."""

    def __init__(
        self, model: nn.Module | None = None, args: TrainingArguments | None = None, *rest: Any, **kwargs: Any
    ) -> None:
        zgraph_config: Config | None = kwargs.pop("zgraph_config", None)
        options: dict[str, Any] | None = kwargs.pop("zgraph_options", None)
        args = zgraph_arguments(args, self.arguments_class)
        if args is not None and not isinstance(model, str):  # a name (TRL's trainers load it): set up once loaded
            self.zgraph_setup: TrainerSetup = setup(args, zgraph_config, model, options)
        self._micro_batches: list = []
        self._grad_norm: torch.Tensor | None = None
        self.step_metrics: dict[str, torch.Tensor] | None = None
        super().__init__(model, args, *rest, **kwargs)
        if not hasattr(self, "zgraph_setup"):
            self.zgraph_setup = setup(self.args, zgraph_config, self.model, options)
        self.zgraph_step = zgraph.distribute(self.zgraph_setup.config)(update_step)

    # ------------------------------------------------------------------------------------------ the step
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        as_zgraph_accelerator(self.accelerator)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if not holds_shards(model):  # a sharded model's shards are where zgraph put them
            super()._move_model_to_device(model, device)

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        self._micro_batches.append(self._prepare_inputs(inputs))
        if len(self._micro_batches) < self.current_gradient_accumulation_steps:
            return torch.zeros((), device=self.args.device)
        batches, self._micro_batches = self._micro_batches, []
        model.train()
        loss, self._grad_norm, metrics = self.zgraph_step(
            model, _inner(self.optimizer), batches, num_items_in_batch, self.micro_batch_loss,
            self.zgraph_setup.max_grad_norm,
        )  # fmt: skip
        self.log_step_metrics(batches, metrics)
        return loss

    def micro_batch_loss(
        self, model: nn.Module, inputs: dict[str, Any], num_items: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's loss as Trainer's ``training_step`` backpropagates it (scaled for accumulation), and
        the metric tensors ``compute_loss`` put in ``self.step_metrics``."""
        self.step_metrics = {}
        try:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, dict(inputs), num_items_in_batch=num_items)
            metrics = self.step_metrics
        finally:
            self.step_metrics = None
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items is not None) or self.compute_loss_func is not None
        return (loss if scaled else loss / self.current_gradient_accumulation_steps), metrics

    def log_step_metrics(self, micro_batches: list[dict[str, Any]], metrics: list[dict[str, torch.Tensor]]) -> None:
        """After the step: each micro-batch's inputs and the metric tensors its ``compute_loss`` recorded in the
        step. Nothing here; a subclass whose ``compute_loss`` records metrics logs them."""

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor | None:
        return self._grad_norm

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return self._grad_norm if grad_norm is None else grad_norm

    # ------------------------------------------------------------------- optimizer and scheduler sections
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        deepspeed = self.zgraph_setup.deepspeed
        if self.optimizer is not None or not deepspeed or "optimizer" not in deepspeed:
            return super().create_optimizer(model)
        params = (model or self.model).parameters()
        self.optimizer, _ = zgraph.optimizer_from_deepspeed({"optimizer": deepspeed["optimizer"]}, params)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        deepspeed = self.zgraph_setup.deepspeed
        if self.lr_scheduler is not None or not deepspeed or "scheduler" not in deepspeed:
            return super().create_scheduler(num_training_steps, optimizer)
        hf_deepspeed.fill_schedule(deepspeed, self.args, num_training_steps)
        self.lr_scheduler = scheduler_from_deepspeed(deepspeed, _inner(optimizer or self.optimizer))
        self._created_lr_scheduler = True
        return self.lr_scheduler

    # ---------------------------------------------------------------------------- saving and loading
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        zgraph.save_pretrained(self.model, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        path = os.path.join(output_dir, CHECKPOINT_DIR)
        zgraph.save(path, self.model, _inner(self.optimizer), scheduler=self.lr_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            path = os.path.join(checkpoint, CHECKPOINT_DIR)
            zgraph.load(path, self.model, _inner(self.optimizer), scheduler=self.lr_scheduler)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Nothing here: the weights come with the optimizer from ``zgraph/`` (``_load_optimizer_and_scheduler``)."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)):
            raise ValueError(f"{resume_from_checkpoint} has no {CHECKPOINT_DIR}/ checkpoint (zgraph.save) to resume")

    def _load_best_model(self) -> None:
        zgraph.load(os.path.join(self.state.best_model_checkpoint, CHECKPOINT_DIR), self.model)

    # ------------------------------------------------------------------------------------ evaluation
    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        with zgraph.gather(self.model):
            return super().evaluation_loop(*args, **kwargs)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer.optimizer if isinstance(optimizer, OptimizerHandle) else optimizer
