"""Workers for ``test_sequence_parallel.py``: a GPT and a Hugging Face Llama trained with
``Config.sequence_parallel`` on each rank's slice of the global batch (data-parallel rows, then sequence slice),
and the same models trained eagerly on it."""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist

import zgraph
from zgraph.demos.models import GPT, GPTConfig, lm_loss

CONFIG = GPTConfig(vocab=37, d_model=32, layers=2, heads=4, seq=16)
GLOBAL_ROWS, STEPS = 4, 3


def batches(name: str = "gpt") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """GPT: next-token targets. Llama: labels shifted over the whole sequence before it is cut, the last position
    ignored (-100), as DeepSpeed ALST's data adapter makes them: the slices hold unequal counts of labels."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        idx = torch.randint(0, CONFIG.vocab, (GLOBAL_ROWS, CONFIG.seq), generator=g)
        if name == "gpt":
            out.append((idx, torch.roll(idx, -1, dims=1)))
        else:
            out.append((idx, torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], dim=1)))
    return out


def llama() -> torch.nn.Module:
    """A Hugging Face Llama built from a config (grouped-query attention, rotary positions), SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=CONFIG.vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def build(name: str = "gpt") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and SGD with momentum (linear in the gradients: float noise in a gradient stays small)."""
    torch.manual_seed(0)
    model = GPT(CONFIG) if name == "gpt" else llama()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _loss(model, idx, tgt):
    if isinstance(model, GPT):
        return lm_loss(model(idx), tgt)
    return model(input_ids=idx, labels=tgt, shift_labels=tgt).loss  # already shifted: no shift inside a slice


def train_step(model, opt, idx, tgt):
    loss = _loss(model, idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def grad_step(model, idx, tgt):
    """Gradients only, left in ``.grad``: every parameter's gradient is compared (none may be dropped)."""
    loss = _loss(model, idx, tgt)
    loss.backward()
    return loss.detach()


def reference(name: str = "gpt") -> dict:
    """Eager PyTorch on one process, whole sequences of the global batch."""
    model, opt = build(name)
    losses = [float(train_step(model, opt, *batch)) for batch in batches(name)]
    grad_step(model, *batches(name)[0])
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": {k: v.clone() for k, v in model.state_dict().items()}, "grads": grads}


def local(batch: tuple, rank: int, world: int, sp: int) -> tuple:
    """Rank ``rank``'s rows (by its data-parallel index) and its slice of each sequence."""
    dp_rank, dp = rank // sp, world // sp
    rows = GLOBAL_ROWS // dp
    mine = tuple(t[dp_rank * rows : (dp_rank + 1) * rows] for t in batch)
    return zgraph.shard_sequence(mine, sp, rank=rank)


def run(rank: int, world: int, out: str, runs: list[tuple[str, str, int, int, dict[str, Any]]]) -> None:
    """Each ``(label, model, sequence_parallel, stage, Config fields)``; rank 0 saves ``{label: result or error}``."""
    results = {}
    for label, name, sp, stage, fields in runs:
        try:
            results[label] = _one(rank, world, name, sp, stage, fields)
        except Exception:
            results[label] = {"error": traceback.format_exc()}
    if rank == 0:
        torch.save(results, out)


def _one(rank: int, world: int, name: str, sp: int, stage: int, fields: dict) -> dict:
    config = zgraph.Config(stage=stage, sequence_parallel=sp, backend="eager", param_persistence_threshold=0, **fields)
    model, opt = build(name)
    step = zgraph.distribute(config)(train_step)
    losses = []
    for batch in batches(name):
        loss = step(model, opt, *local(batch, rank, world, sp)).clone()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    params = zgraph.full_state_dict(model)
    grads = None
    if stage <= 1:  # gradients left whole on every rank
        zgraph.distribute(config)(grad_step)(model, *local(batches(name)[0], rank, world, sp))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    lowered = step.graphs["lower_collectives"].graph.nodes
    collectives = [n.meta["zgraph_collective"][0] for n in lowered if "zgraph_collective" in n.meta]
    return {"losses": losses, "params": params, "grads": grads, "collectives": collectives}


def save_worker(rank: int, world: int, path: str) -> None:
    """The GPT at sequence_parallel=world, stage 3, two steps, then ``zgraph.save`` to ``path``."""
    config = zgraph.Config(stage=3, sequence_parallel=world, backend="eager", param_persistence_threshold=0)
    model, opt = build("gpt")
    step = zgraph.distribute(config)(train_step)
    for batch in batches("gpt")[:2]:
        step(model, opt, *local(batch, rank, world, world))
    zgraph.save(path, model, opt)


def forward_only(model, idx):
    """Split mode: the step returns the logits; the backward runs outside it (``logits.backward(gradient=...)``)."""
    return model(idx)


def split_gradients(rank: int, world: int, out: str, stages: list[int]) -> None:
    """The GPT at sequence_parallel=world in split mode: ``logits.backward(gradient=g)`` on each rank's slice;
    rank 0 saves the whole ``.grad`` of every parameter per stage (``zgraph.gather``)."""
    results = {}
    idx, _ = batches()[0]
    gradient = torch.randn(*idx.shape, CONFIG.vocab, generator=torch.Generator().manual_seed(5))
    for stage in stages:
        config = zgraph.Config(stage=stage, sequence_parallel=world, backend="eager", param_persistence_threshold=0)
        model, _ = build("gpt")
        logits = zgraph.distribute(config)(forward_only)(model, zgraph.shard_sequence(idx, world, rank=rank))
        logits.backward(gradient=zgraph.shard_sequence(gradient, world, rank=rank))
        with zgraph.gather(model):
            results[stage] = {n: p.grad.clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"grads": results, "gradient": gradient}, out)
