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


def _private_dirty_kib(path: str) -> int:
    """Private_Dirty (KiB) of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                inside = fields[-1] == path
            elif inside and fields[0] == "Private_Dirty:":
                total += int(fields[1])
    return total


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def from_pretrained_everywhere(rank: int, world: int, tmp: str) -> None:
    """``from_pretrained`` on every rank maps the file; laying the model out for a step (rank 0's values sent to
    every rank) writes into no mapped page where the ranks already agree (stage 2), and at stage 3 cuts each
    parameter to its shard as it arrives: no rank's anonymous memory grows by the model."""
    from transformers import LlamaConfig as HFLlamaConfig

    source = os.path.join(tmp, "pretrained")
    if rank == 0:
        cfg = HFLlamaConfig(
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=4096,
        )
        AutoModelForCausalLM.from_config(cfg).save_pretrained(source)
    dist.barrier()
    file = os.path.realpath(os.path.join(source, "model.safetensors"))
    size_kib = os.path.getsize(file) // 1024
    model = AutoModelForCausalLM.from_pretrained(source)
    zgraph.materialize(model, zgraph.Config(stage=2))
    assert _private_dirty_kib(file) == 0, f"rank {rank} wrote into the mapped checkpoint"
    model = AutoModelForCausalLM.from_pretrained(source)
    before = _rss_anon_kib()
    zgraph.materialize(model, zgraph.Config(stage=3, param_persistence_threshold=0))
    grown = _rss_anon_kib() - before
    # its shards (half the model) and what the allocator keeps of one whole tensor; copying the model first, as
    # zgraph did before, grew it by 1.5 models
    assert grown < size_kib * 3 / 4, f"rank {rank}: anonymous memory grew {grown} KiB for a {size_kib} KiB model"
