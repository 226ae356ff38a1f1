"""``zgraph.save_pretrained`` on 2 spawned gloo ranks after zgraph training steps (run by
``test_save_pretrained.py``; needs transformers): a tiny Llama saved, and the host bytes the save allocates on
each rank measured on a model of many equal layers — both in one run (``saved_after_steps``: a spawn and the
first step's trace are most of its time)."""

from __future__ import annotations

import os

import torch
import transformers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import zgraph
from zgraph.runtime.memory import LiveTensorBytes

transformers.logging.set_verbosity_error()

VOCAB = 128
SHARD = "40KB"  # several files for the tiny Llama (its embedding alone is 32 KB)


def llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def batches(world: int, rank: int, steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2 * world, 8), generator=g)[2 * rank : 2 * rank + 2]
        out.append((ids, ids))
    return out


def lm_step(model, opt, input_ids, labels):
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def layers(n: int = 8, width: int = 128) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(n)])


def mse_step(model, opt, x, y):
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _distribute(stage: int):  # noqa: ANN202
    return zgraph.distribute(stage=stage, param_persistence_threshold=0, backend="eager")


def llama_saved(rank: int, world: int, out: str, stage: int, tied: bool) -> None:
    """Two steps of the tiny Llama at ``stage``, then ``save_pretrained`` into ``out/zgraph``; rank 0 keeps
    ``full_state_dict`` (``out/state.pt``) to compare with."""
    model = llama(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = _distribute(stage)(lm_step)
    for batch in batches(world, rank):
        step(model, opt, *batch)
    if stage == 3:
        assert isinstance(model.model.embed_tokens.weight, torch.distributed.tensor.DTensor)
    zgraph.save_pretrained(model, os.path.join(out, "zgraph"), max_shard_size=SHARD)
    state = zgraph.full_state_dict(model)
    if rank == 0:
        torch.save(state, os.path.join(out, "state.pt"))


def memory_of_save(rank: int, world: int, out: str, stage: int) -> None:
    """Two steps of ``layers()`` at ``stage``; the live host bytes allocated during ``save_pretrained`` and, to
    show the measure sees a whole copy, during ``full_state_dict(rank0_only=True)``; each rank saves its numbers."""
    model = layers()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = _distribute(stage)(mse_step)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        x, y = torch.randn(2 * world, 128, generator=g), torch.randn(2 * world, 128, generator=g)
        step(model, opt, x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
    with LiveTensorBytes() as saving:
        zgraph.save_pretrained(model, os.path.join(out, "layers"), max_shard_size="200KB")
    blocked = os.path.join(out, "blocked")
    if rank == 0:  # rank 0 cannot put the second of three files in place: every rank raises, none waits forever
        os.makedirs(os.path.join(blocked, "model-00002-of-00003.safetensors"))
    try:
        zgraph.save_pretrained(model, blocked, max_shard_size="200KB")
    except Exception as error:  # the type is what is checked
        failed = type(error).__name__
    else:
        failed = None
    with LiveTensorBytes() as whole:
        state = zgraph.full_state_dict(model, rank0_only=True)
    seen = {
        "save_peak": saving.peak,
        "full_peak": whole.peak,
        "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "largest": max(p.numel() * p.element_size() for p in model.parameters()),
        "failed": failed,
        "left": sorted(os.listdir(blocked)) if rank == 0 else None,
    }
    if rank == 0:
        seen["state"] = state
    torch.save(seen, os.path.join(out, f"memory.{stage}.{rank}.pt"))


def saved_after_steps(rank: int, world: int, out: str, stage: int, tied: bool) -> None:
    llama_saved(rank, world, out, stage, tied)
    memory_of_save(rank, world, out, stage)
