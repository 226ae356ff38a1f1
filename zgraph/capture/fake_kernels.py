"""Fake (shape-only) kernels for ops whose fake kernel in torch is narrower than the eager kernel.

zgraph captures a step with fake tensors, so every op in it runs its *fake* kernel during capture and its eager
kernel at run time. Where torch's fake kernel refuses inputs the eager kernel accepts, a model that trains
eagerly cannot be captured. Importing this module registers, for those ops, a fake kernel that accepts what the
eager kernel accepts and computes the same output metadata; everything else still goes to torch's own kernel.

``aten::_grouped_mm`` (``torch.nn.functional.grouped_mm``; transformers' default "grouped_mm" experts of Mixtral,
Qwen2-MoE, ...): torch 2.13's fake kernel (``torch/_meta_registrations.py``, ``_meta_grouped_mm_common``) copies
the checks of the CUDA kernel, which takes bf16 only ("Expected inputs of BF16 type"), while the CPU kernel
(``_grouped_mm_fallback`` in ATen) takes float32, float16 and bfloat16. For CPU inputs the kernel below checks
what the CPU kernel checks (dtypes, 2D/3D layouts, int32 offsets, 16-byte aligned strides, no bias, no other
output dtype) and returns the CPU kernel's contiguous output; for every other device it defers to torch's kernel.
The backward of ``_grouped_mm`` is ``_grouped_mm`` again (on transposed operands), so this covers both passes.

``aten::_fused_adagrad_`` / ``aten::_fused_adagrad`` (``torch.optim.Adagrad(fused=True)``): torch 2.13 has a
CPU and a CUDA kernel but no fake one (``_fused_adam_`` has one); the kernels below give the shapes torch's
``_fused_adam`` fakes give (nothing for the in-place op, copies of the lists for the functional one).

The registrations are process-wide and only widen what capture accepts to what eager PyTorch already runs.
"""

from __future__ import annotations

import torch
from torch._decomp import meta_table

__all__ = ["grouped_mm_fake", "GROUPED_MM_CPU_DTYPES", "fused_adagrad_fake"]

GROUPED_MM_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what ATen's CPU kernel takes

_aten_grouped_mm = torch.ops.aten._grouped_mm.default
_torch_grouped_mm_fake = meta_table[_aten_grouped_mm]  # torch's own (bf16-only) kernel, for other devices


def grouped_mm_fake(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The fake kernel of ``aten::_grouped_mm``: the CPU kernel's checks and output for CPU inputs (float32,
    float16, bfloat16), torch's own fake kernel for any other device."""
    if mat_a.device.type != "cpu":
        return _torch_grouped_mm_fake(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    torch._check(
        mat_a.dtype == mat_b.dtype and mat_a.dtype in GROUPED_MM_CPU_DTYPES,
        lambda: (
            f"grouped_mm on CPU takes float32, float16 or bfloat16 operands of one dtype, "
            f"got mat_a.dtype={mat_a.dtype} and mat_b.dtype={mat_b.dtype}"
        ),
    )
    torch._check(
        out_dtype is None or out_dtype == mat_a.dtype, lambda: "Grouped gemm output dtype must match `mat_a` dtype"
    )
    torch._check(
        mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
        lambda: f"Multiplicands must be 2D or 3D but got mat_a.dim()={mat_a.dim()} and mat_b.dim()={mat_b.dim()}",
    )
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if not a_2d or not b_2d:
        torch._check(mat_a.size(-1) == mat_b.size(-2), lambda: "contraction dimension of mat_a and mat_b must match")
    torch._check(
        (offs is not None) == (a_2d or b_2d),
        lambda: "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d",
    )
    if offs is not None:
        torch._check(offs.dim() == 1, lambda: f"Offsets tensor must be 1D, but got offs.dim()={offs.dim()}.")
        torch._check(offs.dtype == torch.int32, lambda: "Offsets have to be int32")
    torch._check(bias is None, lambda: "Bias not supported yet")
    _check_strides("mat_a", mat_a)
    _check_strides("mat_b", mat_b)

    if a_2d and b_2d:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a_2d:
        torch._check(offs.size(0) == mat_b.size(0), lambda: "matrix batch sizes have to match")
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        torch._check(offs.size(0) == mat_a.size(0), lambda: "matrix batch sizes have to match")
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        torch._check(mat_a.size(0) == mat_b.size(0), lambda: "batched dimension has to match")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return mat_a.new_empty(size)  # contiguous, as the CPU kernel's output


def _check_strides(name: str, mat: torch.Tensor) -> None:
    """The CPU kernel's layout rule: row- or column-major in the last two dims, the leading stride a multiple
    of 16 bytes."""
    alignment = 16 // mat.element_size()
    rows, cols = mat.stride()[-2], mat.stride()[-1]
    if rows == 1 and cols >= max(1, mat.shape[-2]):
        torch._check(cols % alignment == 0, lambda: f"{name}: strides should be multiple of 16 bytes")
    elif cols == 1 and rows >= max(1, mat.shape[-1]):
        torch._check(rows % alignment == 0, lambda: f"{name}: strides should be multiple of 16 bytes")
    else:
        torch._check(False, lambda: f"{name}: invalid strides/sizes, got {mat.stride()} for sizes {tuple(mat.shape)}")


try:
    torch.library.register_fake(_aten_grouped_mm, grouped_mm_fake)
except RuntimeError:  # torch < 2.13 refuses a fake beside its own Meta kernel: that kernel stays (CUDA dtypes only)
    pass


def _fused_adagrad_inplace_fake(*args: object, **kwargs: object) -> None:
    """The fake kernel of ``aten::_fused_adagrad_``: it writes its lists in place and returns nothing."""


def fused_adagrad_fake(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state_sums: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    **kwargs: object,
) -> tuple[list[torch.Tensor], ...]:
    """The fake kernel of ``aten::_fused_adagrad`` (functional): new tensors like each list's."""
    return tuple([torch.empty_like(t) for t in ts] for ts in (params, grads, state_sums, state_steps))


for _op, _fake in (
    (torch.ops.aten._fused_adagrad_.default, _fused_adagrad_inplace_fake),
    (torch.ops.aten._fused_adagrad.default, fused_adagrad_fake),
):
    try:
        torch.library.register_fake(_op, _fake)
    except RuntimeError:  # a torch that has its own fake kernel for it keeps it
        pass
