"""ZGraphTrainer and ZGraphAccelerator with dynamic padding (issue 41, item 5): a tiny GPT-2 sequence classifier
(``hf_cases``' GPT-2 config, three labels) fine-tuned on sentences of ``hf_cases.WORDS``, each micro-batch padded
to its own longest row by ``DataCollatorWithPadding`` on each rank: the batch shapes change from step to step and
differ between the ranks (``LONGEST``). Rows are taken in order; rank ``r`` of 2 takes rows ``2r, 2r + 1`` of each
micro-step's 4, one process (world 1) all 4, padded to their longest.

The references are the plain Trainer and the accelerate loop of ``accelerate_hf_cases``: DDP on 2 ranks, and one
process on the global batch (``hf_parity``). A classifier's loss is a mean over rows, the same number on every
rank: the mean of the ranks' losses is the global batch's whatever each rank's padding.
"""

from __future__ import annotations

import os
from typing import Any

import accelerate_hf_cases
import hf_cases
import torch
import torch.distributed as dist
import trainer_hf_cases
from accelerate import Accelerator
from dist_harness import all_gather_values
from torch import nn
from transformers import DataCollatorWithPadding, GPT2Config, GPT2ForSequenceClassification, Trainer

import zgraph
from zgraph.integrations.accelerate import ZGraphAccelerator
from zgraph.integrations.transformers import ZGraphTrainer

PER_DEVICE = trainer_hf_cases.PER_DEVICE  # rows per rank and micro-batch
ACCUMULATION = trainer_hf_cases.ACCUMULATION
STEPS = trainer_hf_cases.STEPS
# Words of the longest row of each micro-step's micro-batch on rank 0 and on rank 1 (never 2, the rows per rank: a
# size equal to another shares its symbol, and a longest row of 1 word is a size 1, which is specialized)
LONGEST = ((5, 4), (3, 6), (7, 5), (4, 8), (6, 3), (8, 7), (3, 5), (5, 9))


def classifier() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=hf_cases.VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2, num_labels=3, pad_token_id=1
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2ForSequenceClassification(config)


class Sentences(torch.utils.data.Dataset):
    """Four rows per micro-step: on rank 0 one of ``LONGEST``'s first words and a shorter one, on rank 1 a shorter
    one and one of its second; each with a label in 0-2 (seeded)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(4)
        tokenizer = hf_cases.tokenizer()
        self.rows = []
        for first, second in LONGEST:
            for n in (first, first - 2, second - 1, second):
                words = " ".join(hf_cases.WORDS[i] for i in torch.randint(0, len(hf_cases.WORDS), (n,), generator=g))
                label = int(torch.randint(0, 3, (), generator=g))
                self.rows.append({"input_ids": tokenizer(words)["input_ids"], "labels": label})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


def collator() -> DataCollatorWithPadding:
    return DataCollatorWithPadding(hf_cases.tokenizer())


class ShapesSeen:
    """Records the shape of every micro-batch's ``input_ids``."""

    def __init__(self) -> None:
        self.shapes: set[tuple[int, ...]] = set()

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = collator()(rows)
        self.shapes.add(tuple(batch["input_ids"].shape))
        return batch


def trainer(out: str, world: int, stage: int | None = None) -> dict:
    """Trainer (``stage`` None: DDP on ``world`` ranks, or one process) or ZGraphTrainer at ``stage``: the logged
    series, the whole state, and for ZGraphTrainer each rank's captures and micro-batch shapes."""
    args = trainer_hf_cases.arguments(
        out,
        per_device=PER_DEVICE * (2 // world),
        train_sampling_strategy="sequential",
        average_tokens_across_devices=False,  # Trainer would scale DDP's loss by the ranks: a classifier's loss is
    )  # a mean over rows, not over the batch's tokens
    shapes = ShapesSeen()
    common = dict(model=classifier(), args=args, train_dataset=Sentences(), data_collator=shapes)
    if stage is None:
        run = Trainer(**common)
    else:
        config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0)
        run = ZGraphTrainer(**common, zgraph_config=config)
    run.train()
    result = {**trainer_hf_cases.history(run), "state": trainer_hf_cases.whole_state(run.model)}
    if stage is not None:
        ranks = all_gather_values((run.zgraph_step._dispatch.variants(), sorted(shapes.shapes)))
        result.update(captures=[c for c, _ in ranks], shapes=[s for _, s in ranks])
    return result


def accelerate(world: int, stage: int | None = None) -> dict:
    """The accelerate loop: plain (``stage`` None: DDP on ``world`` ranks, or one process) or ZGraphAccelerator at
    ``stage``, with its forward step's captures on each rank."""
    settings = dict(cpu=True, gradient_accumulation_steps=ACCUMULATION, step_scheduler_with_optimizer=False)
    if stage is None:
        accelerator = Accelerator(**settings)
    else:
        config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0)
        accelerator = ZGraphAccelerator(config=config, **settings)
    data = torch.utils.data.DataLoader(Sentences(), batch_size=PER_DEVICE * (2 // world), collate_fn=collator())
    result = accelerate_hf_cases.accelerate_loop(accelerator, classifier(), data)
    if stage is not None:
        result["captures"] = all_gather_values(result["captures"])
    return result


def run_plain(rank: int, world: int, out_path: str) -> None:
    """Worker: Trainer and the accelerate loop on ``world`` ranks (DDP when 2); rank 0 saves both."""
    root = os.path.dirname(out_path)
    results = {"trainer": hf_cases._guarded(trainer, os.path.join(root, f"trainer-{world}"), world)}
    results["accelerate"] = hf_cases._guarded(accelerate, world)
    if rank == 0:
        torch.save(results, out_path)


def run_all(rank: int, world: int, out_path: str, stage: int) -> None:
    """Worker: Trainer and accelerate + DDP, then ZGraphTrainer and ZGraphAccelerator at ``stage``, on the same
    ranks; rank 0 saves ``{"trainer_ddp", "trainer", "accelerate_ddp", "accelerate"}``."""
    root = os.path.dirname(out_path)
    runs = {
        "trainer_ddp": (trainer, os.path.join(root, "trainer-ddp"), world),
        "trainer": (trainer, os.path.join(root, "trainer-zero"), world, stage),
        "accelerate_ddp": (accelerate, world),
        "accelerate": (accelerate, world, stage),
    }
    results = {}
    for name, (fn, *args) in runs.items():
        results[name] = hf_cases._guarded(fn, *args)
        dist.barrier()
    if rank == 0:
        torch.save(results, out_path)
