"""``step.estimate(..., device="cuda")`` and ``zgraph estimate --device cuda`` on a host without CUDA: NCCL's
lowering, CUDA's attention and autocast (``zgraph.capture.cuda_trace``), the CUDA caching allocator's blocks
(``zgraph.inspect.liveness.cuda_block_bytes``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings

import cli_runner
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel

import zgraph
from zgraph.capture.cuda_trace import CudaTrace, cuda_sdpa_backend, cuda_trace
from zgraph.cli import estimate as estimate_cli
from zgraph.demos.models import GPT, GPTConfig, lm_loss
from zgraph.inspect.liveness import cuda_block_bytes, liveness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
aten = torch.ops.aten
TINY = GPTConfig(vocab=64, d_model=32, layers=1, heads=2, seq=16)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: Tensor, targets: Tensor) -> Tensor:
    loss = lm_loss(model(idx), targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _estimate(fn, model: nn.Module, batch: tuple, device: str, world: int = 1, **config: object) -> zgraph.Estimate:
    opt = torch.optim.AdamW(model.parameters())
    step = zgraph.distribute(backend="eager", **config)(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stage 3 keeping small parameters whole
        return step.estimate(model, opt, *batch, world_size=world, device=device)


def test_cuda_plan_reduce_scatters_with_nccl():
    """At world 4, stage 3, the CUDA plan lowers reduce-scatters natively (NCCL), the CPU plan as gloo's
    all-to-all; model state is the same but for allocator blocks."""
    with torch.device("meta"):
        model = GPT(TINY)
        idx = torch.zeros(2, TINY.seq, dtype=torch.long)
    config = {"stage": 3, "param_persistence_threshold": 0}
    cuda, cpu = (_estimate(train_step, model, (idx, idx), d, world=4, **config) for d in ("cuda", "cpu"))
    assert cuda.device == "cuda" and cuda.to_json()["device"] == "cuda" and cpu.device == "cpu"
    assert cuda.comm_ops.get("reduce_scatter_tensor", 0) > 0 and "all_to_all_single" not in cuda.comm_ops
    assert cpu.comm_ops.get("all_to_all_single", 0) > 0 and "reduce_scatter_tensor" not in cpu.comm_ops
    assert cuda.comm_count == cpu.comm_count and cuda.comm_bytes == cpu.comm_bytes
    assert cuda.cost_model_source in ("analytical", "cached")
    pieces = len(list(model.parameters()))  # each shard, moment and step counter a block of its own
    for kind in ("params", "optimizer"):
        assert 0 <= cuda.model_state_bytes[kind] - cpu.model_state_bytes[kind] < 512 * 3 * pieces
    assert all(n % 512 == 0 for n in cuda.model_state_bytes.values())


def _trace_cuda(fn, *inputs: Tensor, autocast: torch.dtype | None = None) -> fx.GraphModule:
    """``fn`` traced on CPU fakes under ``CudaTrace``, as one forward under autocast when ``autocast`` is set."""
    mode = CudaTrace(autocast)

    def run(*args: Tensor) -> object:
        with mode:
            if autocast is not None:
                mode.enter_forward(None, args)  # as the hooked model's forward pre-hook does
            return fn(*args)

    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        fakes = [fake.from_tensor(t).requires_grad_(t.requires_grad) for t in inputs]
    return make_fx(run, tracing_mode="fake")(*fakes)


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _vals(gm: fx.GraphModule, target: object) -> list:
    return [n.meta["val"] for n in gm.graph.nodes if n.target is target]


@pytest.mark.parametrize(
    "dtype, head_dim, mask, causal_rows, expected",
    [
        (torch.bfloat16, 16, None, None, aten._scaled_dot_product_flash_attention.default),
        (torch.float16, 12, None, None, aten._scaled_dot_product_flash_attention.default),  # padded to 16
        (torch.float32, 16, None, None, aten._scaled_dot_product_efficient_attention.default),
        (torch.float16, 16, "bool", None, aten._scaled_dot_product_efficient_attention.default),  # a mask: not flash
        (torch.bfloat16, 16, None, 8, aten._scaled_dot_product_efficient_attention.default),  # causal, 8 of 32 rows
        (torch.float32, 6, None, None, "math"),  # 6 % 4: no fused kernel
    ],
)
def test_attention_traces_the_kernel_cuda_picks(dtype, head_dim, mask, causal_rows, expected):
    """Forward and backward of ``F.scaled_dot_product_attention`` trace the op CUDA's dispatcher picks, on CPU."""
    q = torch.randn(2, 2, causal_rows or 32, head_dim, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    attn_mask = torch.ones(q.size(-2), 32, dtype=torch.bool).tril() if mask else None

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=causal_rows is not None)
        out.float().sum().backward()
        return out

    gm = _trace_cuda(attend, q, k, v)
    targets = _targets(gm)
    fused = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default}
    assert aten._scaled_dot_product_flash_attention_for_cpu.default not in targets  # not the CPU's choice
    if expected == "math":  # decomposed: the attention matrix is materialized
        assert not fused & set(targets)
        assert [v.shape[-2:] for v in _vals(gm, aten._safe_softmax.default)] == [(32, 32)]
        return
    assert expected in targets and len(fused & set(targets)) == 1
    assert getattr(aten, f"{expected._opname}_backward").default in targets  # its own backward traces too


def test_attention_choice_follows_the_enabled_backends():
    q = torch.empty(1, 2, 8, 16, dtype=torch.bfloat16, device="meta")
    assert cuda_sdpa_backend(q, q, q) == "flash"
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert cuda_sdpa_backend(q, q, q) == "efficient"
    with sdpa_kernel([SDPBackend.MATH]):
        assert cuda_sdpa_backend(q, q, q) == "math"
    few_heads = torch.empty(1, 1, 8, 16, dtype=torch.float32, device="meta")
    fp32 = q.float()
    assert cuda_sdpa_backend(fp32, few_heads, few_heads, enable_gqa=True) == "efficient"
    assert cuda_sdpa_backend(fp32[:, :, :, :15], fp32[:, :, :, :15], fp32[:, :, :, :15]) == "math"  # stride, 15 % 4


class Attention(nn.Module):
    """Attention with dropout: on the CPU, SDPA's math fallback (CPU flash attention has no dropout), on CUDA the
    memory-efficient kernel."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, -1))
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


def _attention_step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor) -> Tensor:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_cuda_estimate_saves_the_fused_attention_not_the_matrix():
    """Where the CPU materializes the attention matrix (and its dropout mask), the CUDA plan saves the fused
    kernel's output and logsumexp: its peak is lower by at least the matrix."""
    batch, heads, seq = 2, 2, 256
    x = torch.randn(batch, seq, 16)
    cpu, cuda = (_estimate(_attention_step, Attention(), (x,), d) for d in ("cpu", "cuda"))
    matrix = batch * heads * seq * seq * 4
    assert cpu.peak_bytes - cuda.peak_bytes >= matrix, (cpu.peak_bytes, cuda.peak_bytes)
    assert cuda.peak_bytes < matrix  # nothing of the matrix's size is alive on CUDA


def test_cuda_autocast_policy():
    """CUDA's autocast lists, not the CPU's: matmuls in bf16 (a weight cast once per forward), softmax, layer norm,
    exp and sum in fp32, promotion to the widest input, cross-entropy's fp32 loss, fp16 softmax to fp32 without a
    copy of its input; binary cross-entropy refused."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def forward(x: Tensor, w: Tensor) -> tuple:
        h = F.linear(x, w) + F.linear(x, w)  # one bf16 copy of w
        probs = F.softmax(h, -1)
        normed = F.layer_norm(h, (8,))
        loss = F.cross_entropy(h, torch.zeros(4, dtype=torch.long))
        return (
            h,
            probs,
            normed,
            h.exp(),
            h.sum(),
            torch.addcmul(h, h, probs),
            loss,
            F.softmax(h.half(), -1, dtype=torch.float32),
        )

    gm = _trace_cuda(forward, x, w, autocast=torch.bfloat16)
    outs = [a.meta["val"] for a in next(n for n in gm.graph.nodes if n.op == "output").args[0]]
    assert [o.dtype for o in outs] == [torch.bfloat16] + [torch.float32] * 7
    weight = [n for n in gm.graph.nodes if n.op == "placeholder"][1]
    assert len([n for n in weight.users if n.target is aten._to_copy.default]) == 1
    assert [v.dtype for v in _vals(gm, aten._log_softmax.default)] == [torch.bfloat16]  # cross-entropy's
    assert [v.dtype for v in _vals(gm, aten._softmax.default)] == [torch.float32, torch.float32]
    half_to_float = [n for n in gm.graph.nodes if n.target is aten._softmax.default and n.args[2]]
    assert len(half_to_float) == 1 and half_to_float[0].args[0].meta["val"].dtype == torch.float16
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        _trace_cuda(lambda x: F.binary_cross_entropy(x.sigmoid(), x), x, autocast=torch.bfloat16)


def test_autocast_covers_the_forward_only_and_python_composites():
    """``cuda_trace`` autocasts inside the hooked module's forward only, and the ops inside a function written in
    Python (``nn.MultiheadAttention``'s) go through the mode: its attention is CUDA's."""
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 8, 16)

    def step(x: Tensor) -> tuple:
        out, _ = mha(x, x, x, need_weights=False)
        return out, out.float() @ torch.ones(16, 16)

    with FakeTensorMode(allow_non_fake_inputs=True) as fake, cuda_trace([mha], torch.float16):
        gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(fake.from_tensor(x))
    targets = _targets(gm)
    assert aten._scaled_dot_product_flash_attention.default in targets
    mms = [
        n.meta["val"].dtype
        for n in gm.graph.nodes
        if n.target in (aten.mm.default, aten.addmm.default, aten.bmm.default)
    ]
    assert mms[-1] == torch.float32 and set(mms[:-1]) == {torch.float16}  # outside the forward: not autocast


def test_cuda_allocator_blocks():
    assert [cuda_block_bytes(n) for n in (0, 1, 511, 512, 513, 2**20 + 1)] == [0, 512, 512, 512, 1024, 2**20 + 512]

    def f(x: Tensor) -> Tensor:
        return (x * 2 + 1).sum()

    gm = make_fx(f, tracing_mode="fake")(torch.empty(25))  # 100 bytes
    cpu, cuda = liveness(gm), liveness(gm, "cuda")
    assert cpu.peak_bytes == 3 * 100 and cuda.peak_bytes == 3 * 512  # x, x * 2 and the sum's input: one block each
    assert [b // 512 for b in cuda.live_bytes] == [math.ceil(b / 100) if b else 0 for b in cpu.live_bytes]


def _linear_step(model: nn.Module, x: Tensor) -> None:
    model(x).sum().backward()


def test_estimate_device_input():
    model = nn.Linear(4, 4)
    step = zgraph.distribute(backend="eager")(_linear_step)
    assert step.estimate(model, torch.randn(2, 4), device=torch.device("cuda")).device == "cuda"
    assert step.estimate(model, torch.randn(2, 4)).device == "cpu"  # the parameters' device
    with pytest.raises(ValueError, match="device must be one of cpu, cuda"):
        step.estimate(model, torch.randn(2, 4), device="tpu")


def test_cli_device_cuda(capsys):
    """The acceptance command on the bench GPT: NCCL's reduce-scatter in the table, the CPU plan's peak beside."""
    argv = ["--model", "gpt-bench", "--world", "4", "--stage", "3", "--device", "cuda"]
    done = cli_runner.here(capsys, "estimate", *argv)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "4 rank(s) on cuda" in lines[0]
    ops = next(line for line in lines if "as nccl runs them" in line)
    assert "reduce_scatter_tensor" in ops and "all_to_all" not in ops
    assert any(line.strip().startswith("peak on cpu/gloo: ") and "; on cuda/nccl: " in line for line in lines)


def test_cli_json_has_the_device(monkeypatch):
    parser = argparse.ArgumentParser()
    estimate_cli.add_arguments(parser)
    monkeypatch.setitem(estimate_cli.MODELS, "gpt-tiny", (lambda seq: GPT(TINY), TINY.vocab, TINY.seq))
    args = parser.parse_args(["--model", "gpt-tiny", "--world", "2", "--stage", "2", "--device", "cuda", "--json"])
    out = json.loads(estimate_cli.run(args))
    assert out["device"] == "cuda" and out["peak_bytes"] % 512 == 0 and out["cpu_peak_bytes"] > 0
    assert "reduce_scatter_tensor" in out["comm_ops"] and "all_to_all_single" not in out["comm_ops"]
