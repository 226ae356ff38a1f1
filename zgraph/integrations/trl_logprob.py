"""TRL's chunked log-prob kernel (``trl.kernels.ChunkedLogProbFunction``, under its fused LM head) as two custom ops
a zgraph step traces, one for its forward and one for its backward.

The kernel loops in Python over the tokens, ``range(0, N, TOKEN_CHUNK_SIZE)`` with ``N = batch * (seq - 1)``: a
trace runs that loop for one ``N``, so it fixes the token count, and with dynamic padding each length would be
captured again. As an op the trace records only its outputs' shapes (symbolic in ``N``); the graph's run calls
TRL's own ``forward`` and ``backward`` on the real tensors, so the arithmetic is the eager kernel's at every size
(its tiles, its fp32 accumulation, Triton on CUDA) and so is its memory saving (no ``[N, vocab]`` logits).
``ChunkedLogProb.apply`` takes the kernel's arguments and returns its outputs.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

_OPTIONAL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")  # the kernel's outputs after the log-probs


class _Recorder:
    """The ``ctx`` the kernel's ``forward`` is called with: what it saves for the backward."""

    saved_tensors: tuple = ()

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.saved_tensors = tensors

    def set_materialize_grads(self, value: bool) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Tensor) -> None:
        pass


@torch.library.custom_op("zgraph_trl::chunked_logprob", mutates_args=())
def chunked_logprob(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    chunk_size: int,
    softcap: float | None,
    logit_scale: float,
    outputs: str,
    autocast_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``log_z`` (for the backward), then the kernel's outputs; one not in ``outputs`` (names joined by commas) is
    an empty tensor."""
    ctx = _Recorder()
    autocast = torch.autocast(hidden.device.type, autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with autocast:  # the kernel computes in the autocast dtype the trace had
        results = ChunkedLogProbFunction.forward(
            ctx, hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, tuple(outputs.split(","))
        )
    logprobs, *optional = results
    kept = [_empty(hidden, name) if t is None else t for name, t in zip(_OPTIONAL, optional, strict=True)]
    return (ctx.saved_tensors[4], logprobs, *kept)  # type: ignore[return-value]


def _empty(hidden: Tensor, name: str, n: int | torch.SymInt = 0) -> Tensor:
    """An output of the kernel with ``n`` tokens (0: an output not asked for), in the kernel's dtype."""
    return hidden.new_empty(n, dtype=torch.bool if name == "is_top1" else torch.float32)


@chunked_logprob.register_fake
def _chunked_logprob_fake(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float, chunk_size: int,
    softcap: float | None, logit_scale: float, outputs: str, autocast_dtype: torch.dtype | None,
) -> tuple[Tensor, ...]:  # fmt: skip
    n, wanted = hidden.shape[0], outputs.split(",")
    optional = [_empty(hidden, name, n if name in wanted else 0) for name in _OPTIONAL]
    return (_empty(hidden, "log_z", n), _empty(hidden, "log_probs", n), *optional)


@torch.library.custom_op("zgraph_trl::chunked_logprob_backward", mutates_args=())
def chunked_logprob_backward(
    saved: list[Tensor | None],
    grad_logprobs: Tensor | None,
    grad_entropy: Tensor | None,
    temperature: float,
    chunk_size: int,
    softcap: float | None,
    logit_scale: float,
    autocast_dtype: torch.dtype | None,
    needs: list[bool],
) -> list[Tensor]:
    """The gradients of the inputs ``needs`` marks (hidden, weight, bias): the kernel's ``backward``."""
    hidden = saved[0]
    assert hidden is not None
    ctx = SimpleNamespace(
        saved_tensors=tuple(saved),
        compute_dtype=autocast_dtype or hidden.dtype,
        chunk_size=chunk_size,
        kernel_args={
            "logit_scale": logit_scale,
            "softcap": softcap or 1.0,
            "inv_t": 1 / temperature,
            "HAS_SOFTCAP": softcap is not None,
        },
        needs_input_grad=tuple(needs),
    )
    grads = ChunkedLogProbFunction.backward(ctx, grad_logprobs, grad_entropy)[:3]
    return [g for g in grads if g is not None]


@chunked_logprob_backward.register_fake
def _chunked_logprob_backward_fake(saved: list[Tensor | None], *args: Any) -> list[Tensor]:
    needs = args[-1]
    return [torch.empty_like(t) for t, need in zip(saved[:3], needs) if need and t is not None]


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs, autocast_dtype = inputs
    log_z, _, entropy, log_sum_sq_probs, mean_logits, is_top1 = output
    ctx.set_materialize_grads(False)  # an entropy read for logging only gets no gradient, as in the kernel
    ctx.mark_non_differentiable(log_z, log_sum_sq_probs, mean_logits, is_top1)
    ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy if "entropy" in outputs.split(",") else log_z)
    ctx.settings = (temperature, chunk_size, softcap, logit_scale, autocast_dtype)


def _backward(ctx: Any, grad_log_z: Tensor | None, grad_logprobs: Tensor | None, grad_entropy: Tensor | None,
              *rest: Tensor | None) -> tuple:  # fmt: skip
    needs = list(ctx.needs_input_grad[:3])
    grads = iter(chunked_logprob_backward(list(ctx.saved_tensors), grad_logprobs, grad_entropy, *ctx.settings, needs))
    saved = ctx.saved_tensors
    first = [next(grads) if need and saved[i] is not None else None for i, need in enumerate(needs)]
    return (*first, None, None, None, None, None, None, None)


chunked_logprob.register_autograd(_backward, setup_context=_setup_context)


class ChunkedLogProb:
    """What the fused LM head calls in place of ``ChunkedLogProbFunction`` while a zgraph step is traced."""

    @staticmethod
    def apply(
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = _OPTIONAL,
    ) -> tuple[Tensor | None, ...]:
        device = hidden.device.type
        autocast_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        results = chunked_logprob(
            hidden, weight, bias, targets, float(temperature), chunk_size,
            None if final_logit_softcapping is None else float(final_logit_softcapping), float(logit_scale),
            ",".join(outputs), autocast_dtype,
        )  # fmt: skip
        logprobs, *optional = results[1:]
        return (logprobs, *(t if name in outputs else None for name, t in zip(_OPTIONAL, optional, strict=True)))
