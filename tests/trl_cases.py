"""TRL's ``SFTTrainer`` and ``ZGraphSFTTrainer`` on a tiny GPT-2 (``hf_cases.gpt2``, from a config), a word-level
tokenizer built here and a text dataset of short sentences (nothing downloaded): SFTTrainer's own dataset
preparation (EOS, tokenizing, labels, truncation), collator (padding to ``PAD_TO``) and fused LM head, with its
defaults (gradient checkpointing on), ``gradient_accumulation_steps=2``, ``max_grad_norm=1.0`` and a cosine schedule.

Every run logs each optimizer step (``logging_steps=1``): ``SERIES``, from ``trainer.state.log_history``; then the
final whole state dict and ``trainer.evaluate()``'s metrics on a held-out text set.

Dynamic padding (issue 41, item 5): the same trainers with TRL's default collator padding each micro-batch to its
longest row (no ``pad_to_multiple_of``), one micro-batch per optimizer step, rows in order: the batch shape changes
from step to step and differs between the ranks (``DYNAMIC_WORDS``). ZGraphSFTTrainer's run also reports each
rank's captures (``zgraph_step._dispatch.variants()``) and the shapes it was given.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL's trainers ping the Hub when built

import hf_cases  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
import trl.trainer.utils  # noqa: E402
from datasets import Dataset  # noqa: E402
from dist_harness import all_gather_values  # noqa: E402
from hf_cases import WORDS, tokenizer  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

import zgraph  # noqa: E402
from zgraph.integrations.trl import ZGraphSFTConfig, ZGraphSFTTrainer  # noqa: E402

transformers.logging.set_verbosity_error()

PER_DEVICE = 2  # rows per rank and micro-batch; one process on the global batch takes PER_DEVICE * world
ACCUMULATION = 2
STEPS = 3
PAD_TO = 8  # every batch padded to 8 tokens (max_length too): one shape, one trace
# Words of each dynamic-padding step's longest row on rank 0 and on rank 1 (SFTTrainer adds EOS): the first step the
# same on both ranks; at the second rank 0's shape repeats (its first graph serves it) and rank 1's changes
DYNAMIC_WORDS = ((5, 5), (5, 3), (7, 6), (4, 8))
DYNAMIC_STEPS = len(DYNAMIC_WORDS)
SERIES = ("loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy", "num_tokens")
EVAL = ("eval_loss", "eval_entropy", "eval_mean_token_accuracy")


def texts(n: int, seed: int) -> Dataset:
    """``n`` sentences of 3 to 7 random words, seeded (SFTTrainer adds EOS: rows of 4 to 8 tokens, padded)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 8, (1,), generator=g))
        rows.append(" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (length,), generator=g)))
    return Dataset.from_dict({"text": rows})


def arguments(out: str, per_device: int = PER_DEVICE, cls: type = SFTConfig, **changes: Any) -> Any:
    settings: dict[str, Any] = dict(
        output_dir=out,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=ACCUMULATION,
        max_grad_norm=1.0,
        learning_rate=1e-2,
        lr_scheduler_type="cosine",
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,  # TRL's default is bf16 autocast; the comparison is of fp32 arithmetic
        dataloader_drop_last=True,
        seed=0,
        data_seed=0,
        max_length=PAD_TO,
        pad_to_multiple_of=PAD_TO,
    )
    settings.update(changes)
    return cls(**settings)


def run(trainer: SFTTrainer, world: int) -> dict:
    """Train, then evaluate; the logged series, the final whole state and the evaluation metrics."""
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    result: dict[str, Any] = {key: [float(r[key]) for r in rows] for key in SERIES}
    result["state"] = {k: v.detach().clone() for k, v in zgraph.full_state_dict(trainer.model).items()}
    evaluated = trainer.evaluate(texts(4 * world, seed=2))
    result.update({key: float(evaluated[key]) for key in EVAL})
    params = list(trainer.model.parameters())
    result.update(sharded=sum(isinstance(p, DTensor) for p in params), parameters=len(params))
    return result


def train_dataset() -> Dataset:
    return texts(STEPS * ACCUMULATION * PER_DEVICE * 2, seed=1)


def plain(out: str, world: int) -> dict:
    """SFTTrainer as it is: DDP on ``world`` ranks, or one process (world 1) on the global batch."""
    args = arguments(out, per_device=PER_DEVICE * (2 // world))
    trainer = SFTTrainer(hf_cases.gpt2(), args, train_dataset=train_dataset(), processing_class=tokenizer())
    return run(trainer, world)


def zero(out: str, stage: int) -> dict:
    """ZGraphSFTTrainer at ``stage`` (every parameter sharded at stage 3). Stage 3 runs with TRL's fused LM head
    choosing its CUDA path (``_use_triton``: Triton, only the labelled positions), as on a GPU: the step must put it
    on its torch path (``zgraph.integrations.trl.torch_fused_head``) to trace it."""
    if stage == 3:
        trl.trainer.utils._use_triton = lambda device: True
    try:
        return _zero(out, stage)
    finally:
        trl.trainer.utils._use_triton = _USE_TRITON


_USE_TRITON = trl.trainer.utils._use_triton


def _zero(out: str, stage: int) -> dict:
    config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0)
    args = arguments(out, cls=ZGraphSFTConfig)
    trainer = ZGraphSFTTrainer(
        hf_cases.gpt2(), args, train_dataset=train_dataset(), processing_class=tokenizer(), zgraph_config=config
    )
    return run(trainer, 2)


# ------------------------------------------------------------------------------------------------ dynamic padding
def dynamic_arguments(out: str, per_device: int = PER_DEVICE, cls: type = SFTConfig, padding_free: bool = False) -> Any:
    """TRL's default collator padding each micro-batch to its longest row (``padding_free``: its rows concatenated
    into one, with ``position_ids``); one micro-batch per optimizer step; the rows in order (rank ``r`` of 2 takes
    rows ``2r, 2r + 1`` of each step's 4)."""
    settings: dict[str, Any] = dict(
        pad_to_multiple_of=None, gradient_accumulation_steps=1, train_sampling_strategy="sequential"
    )
    if padding_free:  # TRL enforces no max_length on padding-free rows without packing
        settings.update(padding_free=True, max_length=None)
    return arguments(out, per_device, cls, **settings)


def dynamic_dataset() -> Dataset:
    """Four rows per step: on rank 0 one of rank 0's ``DYNAMIC_WORDS`` words and a shorter one, on rank 1 a shorter
    one and one of rank 1's (each rank's padded to its longer)."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for first, second in DYNAMIC_WORDS:
        for n in (first, first - 2, second - 1, second):
            rows.append(" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g)))
    return Dataset.from_dict({"text": rows})


def plain_dynamic(out: str, world: int, padding_free: bool = False) -> dict:
    """SFTTrainer with dynamic padding (or padding-free): DDP on ``world`` ranks, or one process (world 1) on the
    global batch."""
    args = dynamic_arguments(out, per_device=PER_DEVICE * (2 // world), padding_free=padding_free)
    trainer = SFTTrainer(hf_cases.gpt2(), args, train_dataset=dynamic_dataset(), processing_class=tokenizer())
    return run(trainer, world)


class ShapesSeen(ZGraphSFTTrainer):
    """ZGraphSFTTrainer noting the shape of every micro-batch it trains on."""

    shapes: set[tuple[int, ...]]

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self.shapes.add(tuple(inputs["input_ids"].shape))
        return super().training_step(model, inputs, num_items_in_batch)


def zero_dynamic(out: str, stage: int, padding_free: bool = False) -> dict:
    """ZGraphSFTTrainer at ``stage`` with dynamic padding (or padding-free); with every rank's captures and batch
    shapes."""
    config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0)
    args = dynamic_arguments(out, cls=ZGraphSFTConfig, padding_free=padding_free)
    trainer = ShapesSeen(
        hf_cases.gpt2(), args, train_dataset=dynamic_dataset(), processing_class=tokenizer(), zgraph_config=config
    )
    trainer.shapes = set()
    result = run(trainer, 2)
    ranks = all_gather_values((trainer.zgraph_step._dispatch.variants(), sorted(trainer.shapes)))
    result.update(captures=[c for c, _ in ranks], shapes=[s for _, s in ranks])
    return result


# ------------------------------------------------------------------------------------------------ workers
def run_plain(rank: int, world: int, out_path: str) -> None:
    """Worker: SFTTrainer in one process (world 1), padded, with dynamic padding and padding-free; rank 0 saves
    ``{"padded": ..., "dynamic": ..., "padding_free": ...}``."""
    root = os.path.dirname(out_path)
    result = {
        "padded": hf_cases._guarded(plain, os.path.join(root, f"plain-{world}"), world),
        "dynamic": hf_cases._guarded(plain_dynamic, os.path.join(root, f"plain-dynamic-{world}"), world),
        "padding_free": hf_cases._guarded(plain_dynamic, os.path.join(root, f"plain-free-{world}"), world, True),
    }
    if rank == 0:
        torch.save(result, out_path)


def run_ddp_and_zero(rank: int, world: int, out_path: str, stages: list[int], dynamic_stage: int) -> None:
    """Worker: SFTTrainer + DDP, then ZGraphSFTTrainer at each stage, on the same ranks; then both with dynamic
    padding and padding-free (ZGraphSFTTrainer at ``dynamic_stage``); rank 0 saves ``{"ddp": ..., stage: ...,
    "ddp_dynamic": ..., "dynamic": ..., "ddp_padding_free": ..., "padding_free": ...}``."""
    root = os.path.dirname(out_path)
    results = {"ddp": hf_cases._guarded(plain, os.path.join(root, "ddp"), world)}
    dist.barrier()
    for stage in stages:
        results[stage] = hf_cases._guarded(zero, os.path.join(root, f"zero-{stage}"), stage)
        dist.barrier()
    results["ddp_dynamic"] = hf_cases._guarded(plain_dynamic, os.path.join(root, "ddp-dynamic"), world)
    dist.barrier()
    results["dynamic"] = hf_cases._guarded(zero_dynamic, os.path.join(root, "zero-dynamic"), dynamic_stage)
    dist.barrier()
    results["ddp_padding_free"] = hf_cases._guarded(plain_dynamic, os.path.join(root, "ddp-free"), world, True)
    dist.barrier()
    results["padding_free"] = hf_cases._guarded(zero_dynamic, os.path.join(root, "zero-free"), dynamic_stage, True)
    dist.barrier()
    if rank == 0:
        torch.save(results, out_path)
