"""``ZGraphSFTTrainer``: TRL's ``SFTTrainer`` whose update is one zgraph step (``ZGraphTrainer``'s).

    from zgraph.integrations.trl import ZGraphSFTConfig, ZGraphSFTTrainer

    args = ZGraphSFTConfig("out", deepspeed="ds_config.json", gradient_accumulation_steps=2, ...)
    trainer = ZGraphSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()  # or zgraph_config=zgraph.Config(stage=3)

The class order (``ZGraphTrainer`` before ``SFTTrainer``) gives zgraph the step, the accelerator, checkpoints and
evaluation under ``zgraph.gather``; SFTTrainer keeps its arguments, dataset preparation (tokenizing, labels,
truncation, packing), collator, fused LM head, evaluation loss and ``log``.

Metrics: SFTTrainer's ``compute_loss`` reads its metrics' values (``.item()``, ``if num_valid > 0``) and counts
tokens in Python. A zgraph step is traced once and replayed: reading values in it is a ``CaptureError``, and Python
in it runs at the trace only (counts would stop after the first step). So in the step ``compute_loss`` is
``sft_loss`` — the same loss (trl 1.16's: the fused head's NLL or DFT over ``num_items_in_batch``, the MoE
auxiliary loss) — and puts its metric tensors in ``step_metrics``; they come out of the step, and
``log_step_metrics`` keeps them as SFTTrainer does (``entropy``, ``mean_token_accuracy``, ``num_tokens``,
``aux_loss``, gathered over the ranks). Outside the step (evaluation) ``compute_loss`` is SFTTrainer's.

Refused when the trainer is built, naming the option: ``compute_loss_func`` and ``label_smoothing_factor``
(deprecated by TRL; the step's loss is the fused head's: subclass and override ``compute_loss``, which may call
this one and must not read tensor values), ``activation_offloading`` (SFTTrainer wraps its ``training_step``, which
the zgraph step replaces: zgraph's Config offloads), sequence and context parallelism.

TRL's fused LM head scores every position in the step (on CUDA it scores the labelled ones only, a shape that
depends on the data), and its chunked log-prob kernel is one op of the graph (``trl_logprob``) that runs TRL's own
forward and backward (Triton on CUDA): the same arithmetic as SFTTrainer's, at any number of tokens.

Batches padded to their longest row (the collator's default) or padding-free ones: the step is captured for the
first batch's sizes, once more with the sizes that changed as symbols, and that graph serves every later size; no
``pad_to_multiple_of`` is needed. (Padding-free batches with flash attention: ``without_flash_lengths``.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import trl.trainer.utils
from torch import nn
from trl import SFTConfig, SFTTrainer

from zgraph.integrations.transformers import ZGraphTrainer, ZGraphTrainingArguments
from zgraph.integrations.trl_logprob import ChunkedLogProb


class ZGraphSFTConfig(ZGraphTrainingArguments, SFTConfig):
    """``SFTConfig`` whose ``deepspeed`` (a JSON path or a dict) is read by zgraph, not DeepSpeed's package."""


class ZGraphSFTTrainer(ZGraphTrainer, SFTTrainer):
    """TRL's ``SFTTrainer`` whose optimizer step is one zgraph step; ``zgraph_config`` / ``zgraph_options`` as
    ``ZGraphTrainer``'s, every other argument SFTTrainer's."""

    arguments_class = ZGraphSFTConfig

    def __init__(self, model: nn.Module | str, args: Any = None, *rest: Any, **kwargs: Any) -> None:
        refuse_sft_arguments(args)  # before SFTTrainer builds (activation offloading) what they configure
        super().__init__(model, args, *rest, **kwargs)
        refuse_sft_trainer(self)

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        inputs = without_flash_lengths(model, inputs)
        with torch_fused_head():  # the zgraph step is traced (forward and backward) inside ZGraphTrainer's
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        if self.step_metrics is None or return_outputs:  # outside the zgraph step: SFTTrainer's own
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss, outputs = sft_loss(self, model, inputs, num_items_in_batch)
        self.step_metrics.update(metric_tensors(outputs))
        return loss

    def log_step_metrics(self, micro_batches: list[dict[str, Any]], metrics: list[dict[str, torch.Tensor]]) -> None:
        """Each micro-batch's metrics, gathered over the ranks and kept as SFTTrainer's ``compute_loss`` keeps
        them (``log`` averages them over the logging interval)."""
        kept, gather = self._metrics["train"], self.accelerator.gather_for_metrics
        for inputs, values in zip(micro_batches, metrics, strict=True):
            if not values:  # a subclass's compute_loss that did not record them
                continue
            num_valid = gather(values["num_valid"]).sum()
            entropy, correct = gather(values["entropy_sum"]).sum(), gather(values["num_correct"]).sum()
            kept["entropy"].append((entropy / num_valid).item() if num_valid > 0 else 0.0)
            kept["mean_token_accuracy"].append((correct / num_valid).item() if num_valid > 0 else 0.0)
            self._total_train_tokens += int(gather(_token_count(inputs)).sum().item()) // self._tp_size
            kept["num_tokens"] = [self._total_train_tokens]
            if "aux_loss" in values:
                kept["aux_loss"].append(gather(values["aux_loss"]).mean().item())


@contextlib.contextmanager
def torch_fused_head() -> Iterator[None]:
    """TRL's fused LM head as a zgraph step traces it, while the step runs. Every position is scored: on CUDA the
    head scores only the labelled positions (``hidden[mask]``, a shape that depends on the data, which a trace
    cannot hold). Its chunked log-prob kernel is one op (``trl_logprob.ChunkedLogProb``): the kernel's loop over
    the tokens would fix their number in the trace, a capture per padded length."""
    saved = trl.trainer.utils._use_triton, trl.trainer.utils._ChunkedLogProbFunction
    trl.trainer.utils._use_triton, trl.trainer.utils._ChunkedLogProbFunction = _no_triton, ChunkedLogProb
    try:
        yield
    finally:
        trl.trainer.utils._use_triton, trl.trainer.utils._ChunkedLogProbFunction = saved


def _no_triton(device: torch.device) -> bool:
    return False


FLASH_LENGTHS = ("max_length_q", "max_length_k")
"""A padding-free batch's longest sequence, as Python ints, for flash attention's varlen kernels."""
IGNORE_FLASH_LENGTHS = ("eager", "sdpa", "flex_attention")
"""Attention implementations that do not read ``FLASH_LENGTHS`` (they mask packed sequences by ``position_ids``)."""


def without_flash_lengths(model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """A padding-free batch without ``FLASH_LENGTHS`` where the model's attention does not read them. Python
    numbers among a step's arguments are constants of its graph: a new longest sequence would capture it again.
    Flash attention's kernels take them, so there they stay (a capture per longest sequence)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in IGNORE_FLASH_LENGTHS:
        return inputs
    return {key: value for key, value in inputs.items() if key not in FLASH_LENGTHS}


def sft_loss(trainer: SFTTrainer, model: nn.Module, inputs: dict[str, Any], num_items: Any) -> tuple[torch.Tensor, Any]:
    """SFTTrainer's training loss (trl 1.16's ``compute_loss`` without its metrics) and the fused head's outputs."""
    inputs["use_cache"] = False
    if trainer.aux_loss_enabled:
        inputs["output_router_logits"] = True
    outputs = model(**inputs, fused_lm_head=True)
    per_token = -outputs.log_probs  # zero on ignored positions
    if trainer.args.loss_type == "dft":
        per_token = per_token * outputs.log_probs.exp().detach()
    count = outputs.label_mask.sum() if num_items is None else num_items
    loss = per_token.sum() / torch.as_tensor(count).clamp(min=1)
    if trainer.args.average_tokens_across_devices and num_items is not None:
        loss = loss * (trainer.accelerator.num_processes // trainer.get_tp_size())
    if trainer.aux_loss_enabled:
        steps = trainer.current_gradient_accumulation_steps if num_items is not None else 1
        loss = loss + trainer.router_aux_loss_coef * outputs.aux_loss / steps
    return loss, outputs


def metric_tensors(outputs: Any) -> dict[str, torch.Tensor]:
    """The fused head's metric sums for one micro-batch (their values are read after the step)."""
    values = {
        "num_valid": outputs.label_mask.sum(),
        "entropy_sum": outputs.entropy.detach().sum(),
        "num_correct": outputs.is_top1.sum(),
    }
    if outputs.aux_loss is not None:
        values["aux_loss"] = outputs.aux_loss.detach()
    return values


def _token_count(inputs: dict[str, Any]) -> torch.Tensor:
    """The tokens of one micro-batch, as SFTTrainer counts them (padding-free batches have no attention mask)."""
    if "attention_mask" in inputs:
        return inputs["attention_mask"].sum()
    if "position_ids" in inputs:
        return torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
    raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")


def refuse_sft_arguments(args: Any) -> None:
    """Raise ``ValueError`` naming the first SFTConfig option the zgraph step cannot honour."""
    if getattr(args, "label_smoothing_factor", 0) > 0:
        raise ValueError(
            "SFTConfig label_smoothing_factor: deprecated by TRL (removed in 2.0); the loss ZGraphSFTTrainer "
            "computes in its step is the fused LM head's (loss_type 'nll' or 'dft'): remove it, or subclass "
            "ZGraphSFTTrainer and override compute_loss"
        )
    if getattr(args, "activation_offloading", False):
        raise ValueError(
            "SFTConfig activation_offloading=True: SFTTrainer offloads around its training_step, which the zgraph "
            "step replaces; remove it (zgraph.Config offload_params / offload_optimizer offload state)"
        )


def refuse_sft_trainer(trainer: SFTTrainer) -> None:
    """Raise ``ValueError`` naming the first SFTTrainer setting (once built) the zgraph step cannot honour."""
    if trainer.compute_loss_func is not None:
        raise ValueError(
            "SFTTrainer compute_loss_func: deprecated by TRL (removed in 2.0); the loss ZGraphSFTTrainer computes "
            "in its step is the fused LM head's (loss_type 'nll' or 'dft'): subclass ZGraphSFTTrainer and "
            "override compute_loss instead"
        )
    parallelism = trainer.accelerator.parallelism_config
    if parallelism is not None and (parallelism.sp_enabled or parallelism.cp_enabled):
        raise ValueError("sequence and context parallelism are not zgraph's: remove the accelerate parallelism_config")
