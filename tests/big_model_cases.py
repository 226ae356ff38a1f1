"""A Hugging Face model end to end without a whole copy (issue 27, item 4), on spawned gloo ranks: built on meta
with ``from_config``, ``zgraph.load_pretrained`` from a directory transformers' own ``save_pretrained`` wrote,
trained by a stage-3 step, exported with ``zgraph.save_pretrained``; plain ``from_pretrained`` of the export
equals eager training on the global batch."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from meta_cases import BATCH, batches, hf_llama, logits
from transformers import AutoModelForCausalLM

import zgraph
from zgraph.demos.models import lm_loss


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(logits(model, x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def pretrained_to_trained(rank: int, world: int, tmp: str, tie: bool) -> None:
    source, out = os.path.join(tmp, "pretrained"), os.path.join(tmp, "trained")
    if rank == 0:
        eager = hf_llama(tie)
        eager.to_empty(device="cpu")
        torch.manual_seed(3)
        eager.init_weights()
        eager.save_pretrained(source, max_shard_size="20KB")  # several files and an index
    dist.barrier()
    config = zgraph.Config(stage=3, param_persistence_threshold=0, backend="eager")
    model = hf_llama(tie)  # on meta
    zgraph.load_pretrained(model, source, config=config)
    reference = AutoModelForCausalLM.from_pretrained(source)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    step = zgraph.distribute(config)(_step)
    per = BATCH // world
    for x, y in batches(3):
        step(model, opt, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        _step(reference, reference_opt, x, y)
    zgraph.save_pretrained(model, out, max_shard_size="20KB")
    dist.barrier()
    trained = AutoModelForCausalLM.from_pretrained(out)
    assert trained.config.tie_word_embeddings == tie
    want = reference.state_dict()
    for key, value in trained.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
