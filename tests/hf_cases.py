"""Tiny Hugging Face transformers models (built from configs, nothing downloaded) trained under zgraph's ZeRO
stages, under DDP, and eagerly on the global batch, on spawned ranks (``run_model``).

Every model is tiny (hidden size 16, one layer) so that a whole rank group with all four stages runs in seconds
on CPU. Dropout is off everywhere (DDP's ranks and zgraph's draw different random numbers; the comparison is of
the arithmetic). Losses are means over equal-sized per-rank batches, so the mean of the ranks' losses and
gradients is the global batch's.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import transformers
from dist_harness import all_gather_values
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

import zgraph

transformers.logging.set_verbosity_error()  # the tiny configs' token ids and loss type draw harmless warnings

STEPS = 4
GLOBAL_BATCH = 4  # 2 rows per rank on 2 ranks
SEQ = 8
VOCAB = 64
LR = 1e-3
WORDS = "the a cat dog bird sat ran flew on under mat tree fast slow red blue big small and".split()


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``WORDS`` (ids 0-2: EOS, padding, unknown), built offline."""
    vocab = {w: i for i, w in enumerate(["<eos>", "<pad>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


@dataclass(frozen=True)
class Model:
    """``make()`` builds the model (seeded); ``batches()`` gives the global ``(input_ids, labels)`` batches."""

    make: Callable[[], nn.Module]
    batches: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]
    bf16: bool = False  # parameters, gradients and optimizer states in bf16
    dropout: bool = False  # draws random numbers: eager runs each rank's rows from the step's generator state


def _lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        out.append((ids, ids))  # causal LM: the model shifts the labels itself
    return out


def _classification_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=0)
    config.eos_token_id = 0
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def gpt2_dropout_checkpointing() -> nn.Module:
    """GPT-2 with its default dropout (0.1 on embeddings, attention and residuals) and transformers' activation
    checkpointing: the usual fine-tuning set-up (issue 25: zgraph's recomputation drew new masks, 69 % off)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=0)
    config.eos_token_id = 0
    model = GPT2LMHeadModel(config)
    model.train()
    model.gradient_checkpointing_enable()
    return model


def _llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )


def llama() -> nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(_llama_config())


def llama_checkpointing() -> nn.Module:
    """Llama with transformers' activation checkpointing (its default: ``use_reentrant=False``)."""
    model = llama()
    model.train()
    model.activation_checkpointing_enable()
    return model


def bert() -> nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    return BertForSequenceClassification(config)


# Both MoE models: hidden and intermediate sizes are multiples of 4 so that fp32 rows are 16-byte aligned, as
# transformers' default experts kernel (``F.grouped_mm``) needs
_TINY_MOE = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=32,
)


def _default_experts(model: nn.Module) -> nn.Module:
    assert model.config._experts_implementation == "grouped_mm", model.config._experts_implementation
    return model


def mixtral() -> nn.Module:
    """Mixtral with transformers' default experts implementation ("grouped_mm": ``F.grouped_mm`` in fp32)."""
    torch.manual_seed(0)
    return _default_experts(MixtralForCausalLM(MixtralConfig(num_local_experts=4, **_TINY_MOE)))


def mixtral_bf16() -> nn.Module:
    """Mixtral in bf16 (parameters, gradients and AdamW states), default experts: eager PyTorch's bf16 training."""
    return mixtral().to(torch.bfloat16)


def qwen2_moe() -> nn.Module:
    """Qwen2-MoE (routed experts plus a gated shared expert) with transformers' default experts implementation."""
    torch.manual_seed(0)
    config = Qwen2MoeConfig(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32, **_TINY_MOE)
    return _default_experts(Qwen2MoeForCausalLM(config))


MODELS = {
    "gpt2": Model(gpt2, _lm_batches),
    "llama": Model(llama, _lm_batches),
    "bert": Model(bert, _classification_batches),
    "mixtral": Model(mixtral, _lm_batches),
    "mixtral_bf16": Model(mixtral_bf16, _lm_batches, bf16=True),
    "qwen2_moe": Model(qwen2_moe, _lm_batches),
    "llama_checkpointing": Model(llama_checkpointing, _lm_batches),
    "gpt2_dropout_checkpointing": Model(gpt2_dropout_checkpointing, _lm_batches, dropout=True),
}


def train_step(model, opt, input_ids, labels):
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


def _local(batch: tuple, rank: int, world: int) -> tuple:
    n = GLOBAL_BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def _rotate(batch: tuple, world: int) -> tuple:
    """The rows of rank 1.. first, then rank 0's: the same global batch, summed in another order."""
    return tuple(torch.cat([*t.chunk(world)[1:], t.chunk(world)[0]]) for t in batch)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def eager(name: str, rotate: bool = False, world: int = 2) -> dict:
    """The model trained eagerly in this process on the global batches (``rotate``: rank slices rotated)."""
    spec = MODELS[name]
    model = spec.make()
    opt = _optimizer(model)
    losses = []
    for batch in spec.batches():
        if rotate:
            batch = _rotate(batch, world)
        if spec.dropout:
            loss = sliced_train_step(model, opt, *batch, world=world)
        else:
            loss = train_step(model, opt, *batch)
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": _state(model)}


def sliced_train_step(model, opt, input_ids, labels, world: int):
    """``train_step`` on the global batch as ``world`` ranks seeded alike run it: each rank slice's forward
    from the step's starting generator state, the loss the mean of the slices'."""
    start, losses = torch.get_rng_state(), []
    for ids, lab in zip(input_ids.chunk(world), labels.chunk(world)):
        torch.set_rng_state(start)
        losses.append(model(input_ids=ids, labels=lab).loss)
    loss = sum(losses) / world
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def ddp(name: str, rank: int, world: int) -> dict:
    spec = MODELS[name]
    model = spec.make()
    wrapped = nn.parallel.DistributedDataParallel(model)
    opt = _optimizer(model)
    losses = []
    for batch in spec.batches():
        loss = train_step(wrapped, opt, *_local(batch, rank, world)).detach().clone()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    return {"losses": losses, "state": _state(model)}


def zero(name: str, stage: int, rank: int, world: int) -> dict:
    spec = MODELS[name]
    model = spec.make()
    opt = _optimizer(model)
    # every parameter sharded at stage 3, however small: the tests check sharding, not the threshold
    config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0)
    step = zgraph.distribute(config)(train_step)
    losses = []
    for batch in spec.batches():
        loss = step(model, opt, *_local(batch, rank, world)).detach().clone()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    return {"losses": losses, "state": zgraph.full_state_dict(model)}


def _guarded(fn: Callable, *args: object) -> dict:
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def capture_mixtral_unaided(rank: int, world: int, out_path: str) -> None:
    """Worker: capture Mixtral's default experts in a process that never imports zgraph.capture.fake_kernels itself;
    saves the error's text, or None."""
    model = mixtral()
    step = zgraph.distribute(zgraph.Config(stage=3, backend="eager"))(train_step)
    try:
        step(model, _optimizer(model), *_lm_batches()[0])
        error = None
    except Exception:
        error = traceback.format_exc()
    torch.save(error, out_path)


def model_results(rank: int, world: int, name: str, stages: list[int]) -> dict:
    """One model on every rank: the eager references (rank 0 the global batch in order, rank 1 with the rank slices
    rotated, at the same time), DDP, then zgraph at each stage: ``{"eager": ..., "rotated": ..., "ddp": ...,
    stage: ...}`` (a failure as ``{"error": traceback}``)."""
    references = all_gather_values(_guarded(eager, name, rank % 2 == 1, world))
    results: dict = {"eager": references[0], "rotated": references[1 % world]}
    results["ddp"] = _guarded(ddp, name, rank, world)
    for stage in stages:
        results[stage] = _guarded(zero, name, stage, rank, world)
        dist.barrier()
    return results


def per_step(step: Callable, rank: int = 0, world: int = 1) -> dict:
    """GPT-2 with dropout under ``gradient_checkpointing_enable()`` trained by ``step`` on this rank's rows of the
    global batches: the loss (the mean over ranks) and the generator's state after every step."""
    model = gpt2_dropout_checkpointing()
    opt = _optimizer(model)
    losses, states = [], []
    for batch in _lm_batches():
        loss = step(model, opt, *_local(batch, rank, world)).detach().clone()
        if world > 1:
            dist.all_reduce(loss)
        losses.append(float(loss) / world)
        states.append(torch.get_rng_state())
    return {"losses": losses, "rng": states}


def inductor_checkpointing(rank: int, world: int) -> dict:
    """``per_step`` for zgraph at stage 3 under inductor (issue 40)."""
    config = zgraph.Config(stage=3, backend="inductor", param_persistence_threshold=0)
    return per_step(zgraph.distribute(config)(train_step), rank, world)


def run_models(rank: int, world: int, out_path: str, names: list[str], stages: list[int]) -> None:
    """Worker: ``model_results`` for each named model in one rank group (``"inductor_checkpointing"``: that case);
    rank 0 saves ``{name: results}``."""
    results = {}
    for name in names:
        if name == "inductor_checkpointing":
            results[name] = _guarded(inductor_checkpointing, rank, world)
        else:
            results[name] = model_results(rank, world, name, stages)
        dist.barrier()
    if rank == 0:
        torch.save(results, out_path)
