"""``zgraph demo``: train a small GPT on locally generated text through ``@zgraph.distribute``."""

from __future__ import annotations

import argparse
import os
import time

import torch
from tqdm import tqdm

import zgraph
from zgraph.data import VOCAB, batch, corpus_tokens
from zgraph.explain import human_bytes
from zgraph.models import GPT, GPTConfig, count_params, lm_loss

DEMO_GPT = GPTConfig(vocab=VOCAB, d_model=256, layers=4, heads=4, seq=128)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage (default 3)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--backend", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--dump", default="zgraph_graphs", help="directory for the graphs (default zgraph_graphs)")
    parser.add_argument("--seed", type=int, default=0)


def train_step(model: GPT, opt: torch.optim.Optimizer, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def run(args: argparse.Namespace) -> dict:
    """Train and report; returns the summary numbers."""
    torch.manual_seed(args.seed)
    model = GPT(DEMO_GPT)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    step = zgraph.distribute(zgraph.Config(stage=args.stage, backend=args.backend))(train_step)
    tokens = corpus_tokens()
    generator = torch.Generator().manual_seed(args.seed)
    losses = []
    start = None
    bar = tqdm(range(args.steps), desc=f"zgraph ZeRO-{args.stage}", unit="step")
    for i in bar:
        idx, tgt = batch(tokens, args.batch, DEMO_GPT.seq, generator)
        loss = step(model, opt, idx, tgt).item()
        losses.append(loss)
        if i == 0:
            start = time.perf_counter()  # steady state: after capture and compile
        bar.set_postfix(loss=f"{loss:.3f}")
    seconds = time.perf_counter() - start if start is not None else float("nan")
    tokens_per_s = (args.steps - 1) * args.batch * DEMO_GPT.seq / seconds if args.steps > 1 else float("nan")
    paths = step.dump(args.dump)
    state_bytes = _model_state_bytes(model, opt)
    print(step.explain())
    print(f"model: GPT {count_params(model) / 1e6:.1f} M parameters, AdamW")
    print(f"loss: {losses[0]:.3f} -> {losses[-1]:.3f} after {args.steps} steps")
    print(f"throughput: {tokens_per_s:,.0f} tokens/s (steady state)")
    print(f"model state (params + grads + optimizer state): {human_bytes(state_bytes)}")
    print(f"graphs: {len(paths)} files in {os.path.abspath(args.dump)}")
    return {"losses": losses, "tokens_per_s": tokens_per_s, "state_bytes": state_bytes}


def _model_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = {}
    for p in model.parameters():
        tensors[id(p)] = p
        if p.grad is not None:
            tensors[id(p.grad)] = p.grad
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                tensors[id(v)] = v
    return sum(t.numel() * t.element_size() for t in tensors.values())
