"""A Llama-shaped decoder for estimates (``zgraph estimate --model llama-7b``): RMSNorm, rotary position
embeddings, grouped-query attention, SwiGLU MLP, untied head — the shapes of Llama 2 7B / 13B / 70B. Built on the
meta device it holds no memory; it is not meant to load released weights (transformers is not a dependency)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a ``Llama``."""

    vocab: int = 32000
    d_model: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 32
    hidden: int = 11008
    max_seq: int = 4096


LLAMA_7B = LlamaConfig()
LLAMA_13B = LlamaConfig(d_model=5120, layers=40, heads=40, kv_heads=40, hidden=13824)
LLAMA_70B = LlamaConfig(d_model=8192, layers=80, heads=64, kv_heads=8, hidden=28672)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = config.heads, config.kv_heads
        self.head_dim = config.d_model // config.heads
        self.wq = nn.Linear(config.d_model, config.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.d_model, config.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.d_model, config.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.heads * self.head_dim, config.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model)
        self.w1 = nn.Linear(config.d_model, config.hidden, bias=False)
        self.w3 = nn.Linear(config.d_model, config.hidden, bias=False)
        self.w2 = nn.Linear(config.hidden, config.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """Llama-style language model: token embedding, ``layers`` decoder layers, final RMSNorm, untied head."""

    def __init__(self, config: LlamaConfig = LLAMA_7B):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.d_model)
        self.layers = nn.ModuleList([Layer(config) for _ in range(config.layers)])
        self.norm = RMSNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        self.register_buffer("cos", torch.empty(config.max_seq, config.d_model // config.heads), persistent=False)
        self.register_buffer("sin", torch.empty_like(self.cos), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """The rotary tables (computed, not learned: also what a model built on the meta device gets)."""
        head_dim = self.config.d_model // self.config.heads
        device = self.cos.device if self.cos.device.type != "meta" else None
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        angles = torch.outer(torch.arange(self.config.max_seq, dtype=torch.float32, device=device), inv)
        angles = angles.repeat(1, 2)
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))
