"""Small reference models for the demo, benchmarks and tests: a GPT-2-style decoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a ``GPT``. The defaults are the bench GPT (about 3.4 M parameters)."""

    vocab: int = 1024
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    seq: int = 128
    tie_weights: bool = False


BENCH_GPT = GPTConfig()
GPT_100M = GPTConfig(vocab=32768, d_model=768, layers=12, heads=12, seq=128)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2-style language model: token and learned position embeddings, blocks, final LayerNorm, head."""

    def __init__(self, config: GPTConfig = BENCH_GPT):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.d_model)
        self.pos = nn.Embedding(config.seq, config.d_model)
        self.blocks = nn.ModuleList([Block(config.d_model, config.heads) for _ in range(config.layers)])
        self.ln = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok.weight
        self.register_buffer("pos_ids", torch.arange(config.seq), persistent=False)

    def init_buffers(self) -> None:
        """The position ids (computed, not learned: also what a model built on the meta device gets)."""
        self.pos_ids = torch.arange(self.config.seq, device=self.pos_ids.device)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(self.pos_ids[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_params(model: nn.Module) -> int:
    """Unique parameters' element count (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def weight_decay_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Two optimizer parameter groups as GPT training scripts make them: weight decay on the matrices (embeddings
    and linear weights, ``dim() >= 2``), none on biases and norm parameters."""
    params = list({id(p): p for p in model.parameters()}.values())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
