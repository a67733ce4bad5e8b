"""`pfk::group_norm_relu` (kernels/group_norm_relu.py) against its reference, forward and backward, on
the C kernels and on the PyTorch fallback; `torch.library.opcheck` on the op and its backward op.
(The model's `GroupNormReLU` module: tests/archs/painted_pillars/test_detector.py.)"""

from __future__ import annotations

import pytest
import torch

from kernels import group_norm_relu, group_norm_relu_reference, native

PATHS = ["native", "torch-ops"]


def _case(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 2 + 0.5).to(dtype).contiguous(memory_format=torch.channels_last)
    c = shape[1]
    return (
        x.requires_grad_(),
        torch.rand(c, generator=g).add(0.5).requires_grad_(),
        torch.randn(c, generator=g).requires_grad_(),
    )


def _use(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "native" and not native.available():
        pytest.skip(f"native CPU kernels: {native.status()}")
    if path == "torch-ops":
        monkeypatch.setattr(native, "supports", lambda x, groups: False)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,groups", [((2, 12, 7, 5), 3), ((1, 6, 61, 53), 2)])  # < / > 3000 pixels
def test_op_forward_and_backward_equal_the_reference(
    path: str, dtype: torch.dtype, shape: tuple, groups: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Values and the gradients of x, weight and bias: the reference's in float64 (the C kernels sum in
    float64), within one rounding of the output dtype (bf16: rtol 2**-8)."""
    _use(path, monkeypatch)
    x, w, b = _case(shape, dtype, seed=shape[2])
    y = group_norm_relu(x, w, b, groups)
    assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = group_norm_relu_reference(x64, w64, b64, groups, 1e-5)
    rtol, atol = (2**-8, 1e-6) if dtype == torch.bfloat16 else (2e-5, 2e-5)
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=atol)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.autograd.grad(y, (x, w, b), g)
    want = torch.autograd.grad(ref, (x64, w64, b64), g.double())
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    grad_rtol = 1e-2 if dtype == torch.bfloat16 else 1e-4  # dx rounded once to bf16; sums in fp32/fp64
    for a, e in zip(got, want):
        torch.testing.assert_close(
            a.double(), e, rtol=grad_rtol, atol=1e-3 if dtype == torch.bfloat16 else 1e-4
        )


@pytest.mark.parametrize("path", PATHS)
def test_opcheck(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Schema, fake (meta) kernel, autograd registration and AOT dispatch, for the op and its backward."""
    _use(path, monkeypatch)
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b = _case((2, 8, 5, 7), dtype, seed=0)
        torch.library.opcheck(torch.ops.pfk.group_norm_relu.default, (x, w, b, 4, 1e-5, dtype))
        torch.library.opcheck(torch.ops.pfk.group_norm_relu.default, (x, w, b, 4, 1e-5, torch.float32))
        _out, mean, rstd = torch.ops.pfk.group_norm_relu(x.detach(), w.detach(), b.detach(), 4, 1e-5, dtype)
        grad = torch.randn(x.shape).to(dtype)
        args = (grad, x.detach(), mean, rstd, w.detach(), b.detach(), 4)
        torch.library.opcheck(torch.ops.pfk.group_norm_relu_backward.default, args)


def test_bad_input_is_refused_with_the_argument_named() -> None:
    x = torch.randn(2, 6, 3, 3)
    with pytest.raises(ValueError, match="group_norm_relu: weight and bias must be \\[C\\] with C = 6"):
        group_norm_relu(x, torch.ones(4), torch.zeros(4), 2)
    with pytest.raises(ValueError, match="group_norm_relu: x must have dtype"):
        group_norm_relu(x.double(), torch.ones(6), torch.zeros(6), 2)
