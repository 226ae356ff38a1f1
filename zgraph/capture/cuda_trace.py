"""Tracing a step as CUDA would run it, on CPU fake tensors: ``step.estimate(..., device="cuda")`` on a host whose
torch cannot trace CUDA tensors (autograd on fake CUDA tensors needs a torch built with CUDA).

The estimate traces on CPU fakes under ``CudaTrace``, a torch-function mode active only during that trace, which
makes the two differences in what a CUDA step allocates explicit:

- **attention**: ``F.scaled_dot_product_attention`` runs as CUDA's dispatcher would choose (torch 2.13,
  ``sdp::select_sdp_backend`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, for an sm80-sm90 GPU:
  A100, H100), in the priority order and with the backends ``torch.nn.attention.sdpa_kernel`` /
  ``torch.backends.cuda.enable_*_sdp`` leave enabled (``cuda_sdpa_backend``): flash attention
  (``aten._scaled_dot_product_flash_attention``) for fp16 / bf16 inputs with equal head dims <= 256 and no
  ``attn_mask`` (``is_causal`` only with as many queries as keys); else memory-efficient attention
  (``aten._scaled_dot_product_efficient_attention``) for fp32 / fp16 / bf16 with head dims a multiple of 4 (fp32)
  or 8 (fp16 / bf16), ``attn_mask`` included; else the math fallback (``aten._scaled_dot_product_attention_math``:
  the attention matrix is materialized). Both fused kernels need 4-d inputs with the same batch, the same heads
  (``enable_gqa``: key/value heads dividing the query's), non-empty sequences and a unit stride in the last dim. What
  the CUDA front end does around the kernel is done too: a boolean mask becomes an additive one in the query's
  dtype, flash pads head dims to a multiple of 8, memory-efficient attention pads a mask whose strides are not
  multiples of 8 and computes the logsumexp only when an input requires grad. So the saved activations are
  CUDA's: the output and an fp32 logsumexp, not the attention matrix a CPU trace may save.
- **autocast**: ``Config.autocast_dtype`` runs each model's forward under CUDA's autocast policy instead of the
  CPU's (their op lists differ), emulated per call at the torch-function level with the lists of torch 2.13's
  ``aten/src/ATen/autocast_mode.h`` (the torch docs' "Autocast Op Reference", CUDA): ``AUTOCAST_LOWER`` ops
  (matmuls, linear, convolutions, RNN cells, attention) cast floating inputs to the autocast dtype, fp32 leaf
  tensors that require grad (weights) once per forward, as autocast's cast cache does; ``AUTOCAST_FP32`` ops
  (pointwise exp / log / pow..., norms, losses, upsampling) cast them to fp32; ``AUTOCAST_FP32_SET_DTYPE`` ops
  (softmax, log_softmax, sum, prod, cumsum...) run with ``dtype=torch.float32`` unless a dtype is given;
  ``AUTOCAST_PROMOTE`` ops cast to the widest floating input; ``binary_cross_entropy`` is refused as CUDA's
  autocast refuses it. fp64 tensors, in-place and ``out=`` calls are left alone. ``cross_entropy`` runs as its
  ATen decomposition does under autocast (``log_softmax`` in the input's dtype, ``nll_loss`` in fp32).
  Softmax and log-softmax of fp16 to fp32 use CUDA's ``half_to_float`` kernels (no fp32 copy of the input).

What is approximated: functions written in Python (``torch.nn.functional``, ``torch.functional``) are re-entered
with the mode active, so the ops inside them are autocast and routed to CUDA's attention as ATen's would be, but
an op implemented in C++ that is in no list runs as called, and the ops it decomposes into are not autocast
(``cross_entropy`` excepted); ``norm`` casts its input to fp32 where CUDA passes ``dtype=float32``; the cuDNN
attention backend, which torch prefers on some sm90 / sm100 setups, is not chosen (it saves the same output and
fp32 logsumexp as flash attention); a step that creates CUDA tensors itself, or recomputes checkpointed
activations under autocast, is not emulated. On a host whose torch has CUDA the estimate traces CUDA fakes
instead, with torch's own autocast and attention choice (``zgraph.inspect.estimate``).
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from zgraph.capture.precision import BACKWARD_CALLS, active_in_engine

aten = torch.ops.aten

AUTOCAST_LOWER = frozenset(
    {
        *("_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d"),
        *("conv_transpose3d", "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "prelu"),
        *("addmm", "addmv", "addr", "matmul", "__matmul__", "__rmatmul__", "einsum", "mm", "mv", "linalg_vecdot"),
        *("linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell"),
        *("_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"),
        *("_scaled_dot_product_flash_attention", "scaled_dot_product_attention"),
    }
)
AUTOCAST_FP32 = frozenset(
    {
        *("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal"),
        *("rsqrt", "sinh", "tan", "pow", "__rpow__", "__rdiv__", "__rtruediv__", "softplus", "layer_norm"),
        *("native_layer_norm", "rms_norm", "group_norm", "frobenius_norm", "nuclear_norm", "norm"),
        *("cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d"),
        *("hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss"),
        *("margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss"),
        *("multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp"),
        *("upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d"),
        *("upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d"),
        *("_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa"),
    }
)
AUTOCAST_FP32_SET_DTYPE = frozenset(
    {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum"}
)
AUTOCAST_PROMOTE = frozenset(
    {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot"}
    | {"scatter_add"}
)
_LISTED = AUTOCAST_LOWER | AUTOCAST_FP32 | AUTOCAST_FP32_SET_DTYPE | AUTOCAST_PROMOTE | {"binary_cross_entropy"}
_PYTHON_MODULES = ("torch.nn.functional", "torch.functional")
_BACKENDS = {
    int(SDPBackend.FLASH_ATTENTION): "flash",
    int(SDPBackend.EFFICIENT_ATTENTION): "efficient",
    int(SDPBackend.MATH): "math",
}
_MASK_ALIGNMENT = 8  # memory-efficient attention's mask alignment (CUDA's preprocess_mask)


# --------------------------------------------------------------------------------------------------- attention
def cuda_sdpa_backend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> str:
    """``"flash"``, ``"efficient"`` or ``"math"``: the ``scaled_dot_product_attention`` backend CUDA picks for these
    inputs on an sm80-sm90 GPU (see the module docstring). Raises ``RuntimeError`` when none is enabled that fits,
    as CUDA does."""
    fits = {
        "flash": lambda: _flash_fits(query, key, value, attn_mask, is_causal, enable_gqa),
        "efficient": lambda: _efficient_fits(query, key, value, attn_mask, enable_gqa),
        "math": torch.backends.cuda.math_sdp_enabled,
    }
    for code in torch._C._get_sdp_priority_order():
        backend = _BACKENDS.get(code)
        if backend is not None and fits[backend]():
            return backend
    raise RuntimeError(
        "scaled_dot_product_attention: no available kernel (CUDA's fused kernels do not fit and math is disabled)"
    )


def _dense_fits(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, gqa: bool, singleton_ok: bool) -> bool:
    """The checks both fused kernels share: 4-d inputs, one batch size, heads (grouped with ``enable_gqa``),
    non-empty sequences, unit stride in the last dim (and in the mask's)."""
    if not q.dim() == k.dim() == v.dim() == 4 or not q.size(0) == k.size(0) == v.size(0):
        return False
    heads_fit = q.size(1) % k.size(1) == 0 and k.size(1) == v.size(1) if gqa else q.size(1) == k.size(1) == v.size(1)
    unit_stride = all(t.stride(-1) == 1 for t in (q, k, v)) or (singleton_ok and q.size(-1) == 1)
    mask_stride = mask is None or mask.stride(-1) == 1
    return heads_fit and q.size(-2) > 0 and k.size(-2) > 0 and unit_stride and mask_stride


def _same_dtype_in(tensors: Iterable[Tensor], allowed: tuple[torch.dtype, ...]) -> bool:
    dtypes = {t.dtype for t in tensors}
    return len(dtypes) == 1 and dtypes <= set(allowed)


def _flash_fits(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, gqa: bool) -> bool:
    return (
        torch.backends.cuda.flash_sdp_enabled()
        and mask is None
        and _dense_fits(q, k, v, mask, gqa, singleton_ok=True)
        and q.size(-1) == k.size(-1) == v.size(-1) <= 256
        and (not causal or q.size(-2) == k.size(-2))
        and _same_dtype_in((q, k, v), (torch.float16, torch.bfloat16))
    )


def _efficient_fits(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, gqa: bool) -> bool:
    half = q.dtype in (torch.float16, torch.bfloat16)
    align = 8 if half else 4  # sm80+: 128-bit tensor-core rows (minimum_gemm_alignment)
    return (
        torch.backends.cuda.mem_efficient_sdp_enabled()
        and _dense_fits(q, k, v, mask, gqa, singleton_ok=False)
        and q.size(-1) == k.size(-1)
        and q.size(-1) % align == 0
        and v.size(-1) % align == 0
        and all(t.numel() == 0 or t.storage_offset() % align == 0 for t in (q, k, v))
        and _same_dtype_in((q, k, v), (torch.float16, torch.bfloat16, torch.float32))
    )


def cuda_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` as CUDA's front end runs it: the backend ``cuda_sdpa_backend`` picks,
    called as ``aten::scaled_dot_product_attention`` calls it on CUDA."""
    backend = cuda_sdpa_backend(query, key, value, attn_mask, is_causal, enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # additive, in the query's dtype
        attn_mask = torch.where(attn_mask, 0.0, torch.scalar_tensor(-math.inf, dtype=query.dtype))
    if backend == "flash":
        head_dim = query.size(-1)
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale  # of the head dim before padding
        q, k, v = (_pad_last_dim(t, 8) for t in (query, key, value))
        out = aten._scaled_dot_product_flash_attention.default(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        return out[..., :head_dim] if out.size(-1) != head_dim else out
    if backend == "efficient":
        logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        mask = _aligned_mask(attn_mask, query, key) if attn_mask is not None else None
        return aten._scaled_dot_product_efficient_attention.default(
            query, key, value, mask, logsumexp, dropout_p, is_causal, scale=scale
        )[0]
    return aten._scaled_dot_product_attention_math.default(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]


def _pad_last_dim(t: Tensor, multiple: int) -> Tensor:
    size = t.size(-1)
    return t if size % multiple == 0 else F.pad(t, (0, multiple - size % multiple))


def _aligned_mask(mask: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """CUDA's ``preprocess_mask``: a mask whose strides are not multiples of 8 is copied into a padded tensor (and
    sliced back), then expanded to (batch, heads, queries, keys)."""
    aligned = mask.stride(-1) == 1 and all(mask.stride(i) % _MASK_ALIGNMENT == 0 for i in range(mask.dim() - 1))
    if not aligned:
        size = mask.size(-1)
        mask = F.pad(mask, (0, _MASK_ALIGNMENT - size % _MASK_ALIGNMENT))[..., :size]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


# ----------------------------------------------------------------------------------------------------- autocast
def _eligible(value: Any) -> bool:
    """A tensor CUDA's autocast casts: floating point, not fp64."""
    return isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _map_tensors(fn: Callable[[Tensor], Tensor], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` / ``kwargs`` with ``fn`` applied to each eligible tensor (in lists and tuples too)."""

    def one(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(fn(v) if _eligible(v) else v for v in value)
        return fn(value) if _eligible(value) else value

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    found: list[Tensor] = []
    _map_tensors(lambda t: found.append(t) or t, args, kwargs)
    return found


def _dtype_given(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)


class CudaTrace(TorchFunctionMode):
    """The torch-function mode of a CUDA estimate's trace (see the module docstring): attention as CUDA picks it
    always; CUDA's autocast policy inside the forward of the modules ``cuda_trace`` hooks, when ``autocast_dtype``
    is set."""

    def __init__(self, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.autocast_dtype = autocast_dtype
        self.depth = 0  # forwards under autocast now running
        self._casts: dict[int, tuple[Tensor, Tensor]] = {}  # autocast's cast cache: id(weight) -> (weight, cast)

    def __torch_function__(self, func: Callable, _types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in BACKWARD_CALLS:  # recomputation inside the backward (checkpointing) sees CUDA's attention too
            with active_in_engine(self):
                return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if self.depth and self.autocast_dtype is not None and "out" not in kwargs:
            return self._autocast(func, name, args, kwargs)
        return self._run(func, name, args, kwargs)

    def enter_forward(self, module: nn.Module, args: Any) -> None:
        self.depth += 1

    def leave_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if not self.depth:  # autocast clears its cast cache when its outermost region ends
            self._casts.clear()

    def _run(self, func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        if name == "scaled_dot_product_attention":
            return cuda_attention(*args, **kwargs)
        if name in ("softmax", "log_softmax"):
            return _softmax(func, name, args, kwargs)
        if name not in _LISTED and isinstance(func, types.FunctionType) and func.__module__ in _PYTHON_MODULES:
            with self:  # a Python composite: the ops inside it go through this mode, as ATen's go through autocast
                return _undispatched(func)(*args, **kwargs)
        return func(*args, **kwargs)

    def _autocast(self, func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        lower = self.autocast_dtype
        if name == "binary_cross_entropy":
            raise RuntimeError(
                "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast (CUDA's "
                "autocast refuses them); use binary_cross_entropy_with_logits"
            )
        if name == "cross_entropy_loss":
            return _cross_entropy(func, args, kwargs)
        if name in AUTOCAST_LOWER:
            args, kwargs = _map_tensors(self._lower, args, kwargs)
        elif name in AUTOCAST_FP32 and not (name == "norm" and _dtype_given(args, kwargs)):
            args, kwargs = _map_tensors(lambda t: t.float(), args, kwargs)
        elif name in AUTOCAST_FP32_SET_DTYPE and args and _eligible(args[0]) and not _dtype_given(args[1:], kwargs):
            kwargs = {**kwargs, "dtype": torch.float32}
        elif name in AUTOCAST_PROMOTE:
            found = _tensors(args, kwargs)
            widest = torch.float32 if any(t.dtype == torch.float32 for t in found) else lower
            args, kwargs = _map_tensors(lambda t: t.to(widest), args, kwargs)
        return self._run(func, name, args, kwargs)

    def _lower(self, t: Tensor) -> Tensor:
        """``t`` in the autocast dtype; an fp32 leaf that requires grad (a weight) is cast once per forward."""
        if t.dtype == self.autocast_dtype:
            return t
        if not (t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view()):
            return t.to(self.autocast_dtype)
        if id(t) not in self._casts:
            self._casts[id(t)] = (t, t.to(self.autocast_dtype))
        return self._casts[id(t)][1]


def _softmax(func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    """Softmax / log-softmax; of fp16 to fp32, CUDA's ``half_to_float`` kernel (no fp32 copy of the input)."""
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    dtype = kwargs.get("dtype") or next((a for a in args[2:] if isinstance(a, torch.dtype)), None)
    if isinstance(x, Tensor) and x.dtype == torch.float16 and dtype == torch.float32 and isinstance(dim, int):
        return (aten._softmax if name == "softmax" else aten._log_softmax).default(x, dim, True)
    return func(*args, **kwargs)


def _cross_entropy(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``cross_entropy_loss`` under CUDA's autocast, for class-index targets without label smoothing: as its ATen
    decomposition runs there, ``log_softmax`` in the input's dtype, ``nll_loss`` in fp32. Other forms run as called."""
    bound = dict(zip(("input", "target", "weight", "reduction", "ignore_index", "label_smoothing"), args))
    bound.update(kwargs)
    x, target, weight = bound["input"], bound["target"], bound.get("weight")
    if not _eligible(x) or bound.get("label_smoothing", 0.0) > 0 or x.shape == target.shape:
        return func(*args, **kwargs)
    log_probs = torch.log_softmax(x, 1 if x.dim() > 1 else 0, dtype=x.dtype)
    weight = weight.float() if _eligible(weight) else weight
    reduction, ignore_index = bound.get("reduction", 1), bound.get("ignore_index", -100)
    return torch._C._nn.nll_loss_nd(log_probs.float(), target, weight, reduction, ignore_index)


_UNDISPATCHED: dict[Callable, Callable] = {}


def _undispatched(fn: types.FunctionType) -> Callable:
    """``fn`` (a torch function written in Python) without its own ``__torch_function__`` check, so that called
    with the mode active it runs its body, whose calls the mode then sees."""
    if fn not in _UNDISPATCHED:
        scope = dict(fn.__globals__)
        for check in ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"):
            scope[check] = lambda *args: False
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        _UNDISPATCHED[fn] = copy
    return _UNDISPATCHED[fn]


@contextlib.contextmanager
def cuda_trace(modules: Iterable[nn.Module], autocast_dtype: torch.dtype | None) -> Iterator[CudaTrace]:
    """``CudaTrace`` active while the block runs; with ``autocast_dtype``, CUDA's autocast policy inside each of
    ``modules``' forward (the models' forwards, as ``Config.autocast_dtype`` asks)."""
    mode = CudaTrace(autocast_dtype)
    handles = []
    if autocast_dtype is not None:
        for module in modules:
            handles.append(module.register_forward_pre_hook(mode.enter_forward))
            handles.append(module.register_forward_hook(mode.leave_forward))
    try:
        with mode:
            yield mode
    finally:
        for handle in handles:
            handle.remove()
