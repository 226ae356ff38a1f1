"""Unmodified models trained with pipeline parallelism against eager PyTorch on the whole batch, the workers of
``test_pipeline_models.py``: Hugging Face Llama (``LlamaForCausalLM`` built from a config, its loss from
``labels=``: a mean over the tokens not ``-100``, uneven across micro-batches) and zgraph's demo GPT. Each rank
returns eager's and the pipeline's losses and the largest distance of the parameters its stages update from eager's
after the steps."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from dist_harness import all_gather_values, run_named
from pipeline_cases import step_of
from torch import nn

import zgraph
from zgraph.demos.models import GPT, GPTConfig, lm_loss

STEPS = 3
ROWS, LENGTH, VOCAB = 8, 16, 128
LR = 1e-3


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
    )
    return LlamaForCausalLM(config)


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=VOCAB, d_model=32, layers=4, heads=4, seq=LENGTH))


def llama_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


gpt_step = step_of(lm_loss)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids and labels; some labels -100 (padding), unevenly many per row."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
        labels = ids.masked_fill(torch.rand(ROWS, LENGTH, generator=g) < 0.3, -100)
        out.append((ids, labels))
    return out


def accumulated(make: Callable[[], nn.Module], logits_of: Callable, microbatches: int) -> dict[str, torch.Tensor]:
    """Eager PyTorch accumulating each step's gradients over ``microbatches`` micro-batches, each adding its
    tokens' summed loss over the whole batch's count (the same arithmetic as one backward on the whole batch's token
    mean, in another order): the parameters after the steps. Their distance from one backward's is what fp32's
    order alone makes, the yardstick for a pipeline's."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for ids, labels in batches():
        count = (labels[:, 1:] != -100).sum() if logits_of is _hf_logits else (labels != -100).sum()
        for part, part_labels in zip(ids.chunk(microbatches), labels.chunk(microbatches)):
            logits, targets = logits_of(model, part, part_labels)
            loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / count
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _hf_logits(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids).logits[:, :-1]  # Hugging Face shifts the labels by one
    return logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)


def _gpt_logits(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(ids)
    return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)


def train(make: Callable[[], nn.Module], step: Callable, **config: object) -> dict:
    eager_model = make()
    model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=LR)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    compiled = zgraph.distribute(zgraph.Config(backend="eager", **config))(step)
    want, got = [], []
    for ids, labels in batches():
        want.append(step(eager_model, eager_opt, ids, labels))
        got.append(compiled(model, opt, ids, labels))
    eager = dict(eager_model.named_parameters())
    held = [(name, p) for name, p in model.named_parameters() if not p.is_meta]
    distance = {name: (p - eager[name]).abs().max().item() for name, p in held}
    logits_of = _hf_logits if step is llama_step else _gpt_logits
    order = accumulated(make, logits_of, config["microbatches"])
    yardstick = {name: (order[name] - eager[name]).abs().max().item() for name, _ in held}
    return {"want": want, "got": got, "held": [name for name, _ in held], "distance": distance, "order": yardstick}


def llama_1f1b(rank: int, world: int) -> list[dict]:
    return all_gather_values(train(llama, llama_step, pipeline_parallel=world, schedule="1f1b", microbatches=4))


def gpt_zb_h1(rank: int, world: int) -> list[dict]:
    return all_gather_values(train(gpt, gpt_step, pipeline_parallel=world, schedule="zb_h1", microbatches=4))


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named cases; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())
