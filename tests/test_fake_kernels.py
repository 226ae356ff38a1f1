"""zgraph.capture.fake_kernels: the fake kernel of ``aten::_grouped_mm`` agrees with the eager CPU kernel.

For float32, float16 and bfloat16 and every operand layout the CPU kernel takes (2D x 3D with offsets, the MoE
case; 3D x 3D; 2D x 2D; 3D x 2D; a transposed, column-major weight), the fake output has the eager output's
shape, dtype and strides, forward and backward; what the CPU kernel refuses, the fake kernel refuses too; and
devices other than CPU keep torch's own (bf16-only) fake kernel.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import zgraph.capture.fake_kernels  # noqa: F401  (registers the kernel)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OFFS = torch.tensor([3, 3, 8], dtype=torch.int32)  # group sizes 3, 0, 5: an empty group too


def _layouts(dtype: torch.dtype) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "2d_3d": (r(8, 16), r(3, 16, 24), OFFS),
        "2d_3d_transposed_weight": (r(8, 16), r(3, 24, 16).transpose(-2, -1), OFFS),
        "3d_3d": (r(3, 8, 16), r(3, 16, 24), None),
        "2d_2d": (r(8, 16).t().contiguous().t().contiguous(), r(16, 24), OFFS),
        "3d_2d": (r(3, 8, 16), r(16, 24), OFFS),
    }


def _fake(mode: FakeTensorMode, t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else mode.from_tensor(t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(_layouts(torch.float32)))
def test_forward_metadata_equals_eager(dtype, layout):
    a, b, offs = _layouts(dtype)[layout]
    want = torch._grouped_mm(a, b, offs=offs)
    with FakeTensorMode() as mode:
        got = torch._grouped_mm(_fake(mode, a), _fake(mode, b), offs=_fake(mode, offs))
    assert (got.shape, got.dtype, got.stride(), got.device) == (want.shape, want.dtype, want.stride(), want.device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_traces_and_matches_eager(dtype):
    """The MoE pattern (``F.grouped_mm(x, w, offs=...)``, both requiring grad) traced forward and backward with
    fake tensors; the traced graph run on real tensors equals eager."""
    a, b, offs = _layouts(dtype)["2d_3d"]
    grad_out = torch.randn(8, 24, generator=torch.Generator().manual_seed(1)).to(dtype)

    def fwd_bwd(a, b, offs, grad_out):
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        out = torch.nn.functional.grouped_mm(a, b, offs=offs)
        return (out, *torch.autograd.grad(out, (a, b), grad_out))

    gm = make_fx(fwd_bwd, tracing_mode="fake")(a, b, offs, grad_out)
    assert sum(n.target is torch.ops.aten._grouped_mm.default for n in gm.graph.nodes) == 3  # out, d_a, d_b
    for got, want in zip(gm(a, b, offs, grad_out), fwd_bwd(a, b, offs, grad_out), strict=True):
        assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
        assert torch.equal(got, want)


def _refused() -> dict[str, tuple]:
    x, w = torch.randn(8, 16), torch.randn(3, 16, 24)
    return {
        "float64": ((x.double(), w.double()), {"offs": OFFS}),
        "mixed dtypes": ((x, w.bfloat16()), {"offs": OFFS}),
        "int64 offsets": ((x, w), {"offs": OFFS.long()}),
        "missing offsets": ((x, w), {}),
        "offsets for 3d x 3d": ((torch.randn(3, 8, 16), w), {"offs": OFFS}),
        "misaligned stride": ((torch.randn(8, 6), torch.randn(3, 6, 24)), {"offs": OFFS}),
        "contraction mismatch": ((torch.randn(8, 12), w), {"offs": OFFS}),
        "bias": ((x, w), {"offs": OFFS, "bias": torch.randn(3, 24)}),
        "other out_dtype": ((x, w), {"offs": OFFS, "out_dtype": torch.bfloat16}),
    }


@pytest.mark.parametrize("case", list(_refused()))
def test_refuses_what_eager_refuses(case):
    (a, b), kwargs = _refused()[case]
    with pytest.raises(RuntimeError):
        torch._grouped_mm(a, b, **kwargs)
    with FakeTensorMode() as mode:
        fake_kwargs = {k: _fake(mode, v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with pytest.raises(RuntimeError):
            torch._grouped_mm(mode.from_tensor(a), mode.from_tensor(b), **fake_kwargs)


def test_other_devices_keep_torchs_kernel():
    """Only CPU is widened: on any other device (here meta) float32 is refused as torch refuses it."""
    a, b = torch.empty(8, 16, device="meta"), torch.empty(3, 16, 24, device="meta")
    offs = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
        torch._grouped_mm(a, b, offs=offs)
    out = torch._grouped_mm(a.bfloat16(), b.bfloat16(), offs=offs)
    assert out.shape == (8, 24) and out.dtype == torch.bfloat16


def test_nonfinite_flag_is_on_the_gradients_device():
    """zgraph::nonfinite's fake value lies on the gradients' device, as the real op's result does (it was always a
    CPU tensor: beside CUDA gradients the traced graph would have moved the flag)."""
    import zgraph.ops  # noqa: F401  (registers zgraph's operators)

    with FakeTensorMode():
        flag = torch.ops.zgraph.nonfinite([torch.empty(3, device="meta"), torch.empty(2, device="meta")])
    assert flag.device.type == "meta" and flag.dtype == torch.bool and flag.shape == ()
