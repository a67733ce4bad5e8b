"""focal_loss: the CenterNet formula, numerical stability, gradients, Triton == reference.

Triton runs under TRITON_INTERPRET=1 on CPU (set below, before any Triton kernel is imported) and
for real on CUDA (`pytest -m gpu`). Tolerances per dtype (TOLERANCES) carry the interpreter
measurements that set them; the GPU figures come from the benchmark's JSON.
"""

from __future__ import annotations

import math

from kernels._testing import enable_triton_interpreter, triton_device_params

enable_triton_interpreter()  # before anything imports the Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import focal_loss, focal_loss_reference  # noqa: E402
from kernels._dispatch import force_triton  # noqa: E402
from kernels.focal_loss import _focal_loss_backward_reference  # noqa: E402

# (loss rtol, grad atol, grad rtol). Both paths compute in float32; they differ in summation order
# (loss) and in exp/log implementations (1-2 ulp). Measured under the interpreter on [2, 3, 17, 19]
# logits ~ N(0, 4^2): fp32 loss diff 0, grad 6e-8 (max |grad| 0.23); bf16 grad 1 ulp (9.8e-4);
# fp16 grad 0. The gradient is rounded to the logits' dtype, so allow 1 ulp of it.
TOLERANCES = {
    torch.float32: (1e-5, 1e-7, 1e-5),
    torch.float16: (1e-5, 1e-6, 2**-10),
    torch.bfloat16: (1e-5, 1e-5, 2**-7),
}


def _naive_loss_float64(x: torch.Tensor, t: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """CenterNet's `_neg_loss` written on probabilities (unstable for |x| > ~30, fine here)."""
    p = 1 / (1 + torch.exp(-x.double()))
    t = t.double()
    pos = t == 1
    pos_loss = -(torch.log(p) * (1 - p) ** alpha)[pos].sum()
    neg_loss = -(torch.log(1 - p) * p**alpha * (1 - t) ** beta)[~pos].sum()
    return (pos_loss + neg_loss) / max(1, int(pos.sum()))


def _heat_like(shape: tuple[int, ...], seed: int, n_peaks: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    target = torch.rand(shape, generator=g) ** 4  # mostly near 0, like a Gaussian heatmap
    flat = target.view(-1)
    if flat.numel():
        flat[torch.randperm(flat.numel(), generator=g)[:n_peaks]] = 1.0
    return target


def test_reference_matches_centernet_formula() -> None:
    x = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(0)) * 3
    t = _heat_like((2, 3, 5, 7), seed=1)
    for alpha, beta in [(2.0, 4.0), (1.5, 3.0), (0.0, 0.5)]:
        expected = _naive_loss_float64(x, t, alpha, beta)
        torch.testing.assert_close(
            focal_loss_reference(x, t, alpha, beta).double(), expected, rtol=1e-5, atol=0
        )
        torch.testing.assert_close(focal_loss(x, t, alpha, beta).double(), expected, rtol=1e-5, atol=0)


def test_hand_values() -> None:
    # One positive at x = 0 (p = 1/2): log(2) * (1/2)^2; one negative at x = 0, t = 0.5:
    # log(2) * (1/2)^2 * (1/2)^4; normalised by 1 positive.
    x = torch.zeros(2)
    t = torch.tensor([1.0, 0.5])
    expected = math.log(2) / 4 + math.log(2) / 4 / 16
    assert focal_loss(x, t).item() == pytest.approx(expected, rel=1e-6)
    # No positive: divided by max(1, 0) = 1, not by 0.
    assert focal_loss(x[1:], t[1:]).item() == pytest.approx(math.log(2) / 64, rel=1e-6)


def test_extreme_logits_are_finite_and_exact() -> None:
    # Confidently wrong: loss ~ |x|, where the naive log(sigmoid) gives inf.
    x = torch.tensor([-1e4, 1e4, -80.0, 80.0, 30.0])
    t = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    x.requires_grad_(True)
    loss = focal_loss(x, t)
    (grad,) = torch.autograd.grad(loss, x)
    assert loss.item() == pytest.approx((1e4 + 1e4 + 80 + 80) / 3, rel=1e-6)
    assert torch.isfinite(grad).all()
    # d/dx of -log p (1 - p)^2 at x -> -inf is -1 (per positive, / 3 positives); at x = 30 it is ~0.
    torch.testing.assert_close(grad, torch.tensor([-1.0, 1.0, -1.0, 1.0, 0.0]) / 3, atol=1e-6, rtol=0)


def test_reference_gradcheck_float64() -> None:
    x = torch.randn(
        3, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True
    )
    t = _heat_like((3, 4, 5), seed=3).double()
    assert torch.autograd.gradcheck(lambda v: focal_loss_reference(v, t), (x,))
    assert torch.autograd.gradcheck(lambda v: focal_loss(v, t, 1.5, 3.0), (x,))  # the op's own backward


def test_analytic_backward_equals_autograd_of_reference() -> None:
    x = torch.randn(4, 3, 9, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 5
    t = _heat_like((4, 3, 9, 11), seed=5, n_peaks=7).double()
    for alpha, beta in [(2.0, 4.0), (1.5, 3.0)]:
        x.requires_grad_(True)
        (expected,) = torch.autograd.grad(focal_loss_reference(x, t, alpha, beta), x)
        normalizer = torch.tensor(7.0, dtype=torch.float64)
        actual = _focal_loss_backward_reference(torch.tensor(1.0), x.detach(), t, normalizer, alpha, beta)
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-14)


def test_target_gets_no_gradient() -> None:
    x = torch.randn(5, requires_grad=True)
    t = torch.rand(5, requires_grad=True)
    (gx, gt) = torch.autograd.grad(focal_loss(x, t), (x, t), allow_unused=True)
    assert gx is not None and gt is None


def test_opcheck() -> None:
    x = torch.randn(2, 2, 5, 6, requires_grad=True)
    t = _heat_like((2, 2, 5, 6), seed=6)
    torch.library.opcheck(torch.ops.pfk.focal_loss.default, (x, t, 2.0, 4.0))
    args = (torch.tensor(1.0), x.detach(), t, torch.tensor(3.0), 2.0, 4.0)
    torch.library.opcheck(torch.ops.pfk.focal_loss_backward.default, args)


def test_validation_errors() -> None:
    with pytest.raises(ValueError, match="same shape"):
        focal_loss(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="logits must have dtype"):
        focal_loss(torch.zeros(2, dtype=torch.int64), torch.zeros(2))
    with pytest.raises(ValueError, match="alpha and beta must be >= 0"):
        focal_loss(torch.zeros(2), torch.zeros(2), alpha=-1.0)


# --------------------------------------------------------------------------------------------------
# Triton == reference
# --------------------------------------------------------------------------------------------------
def _check_triton(x: torch.Tensor, t: torch.Tensor, alpha: float, beta: float) -> None:
    loss_rtol, grad_atol, grad_rtol = TOLERANCES[x.dtype]
    x = x.detach().requires_grad_(True)
    expected = focal_loss_reference(x, t, alpha, beta)
    (expected_grad,) = torch.autograd.grad(expected, x)
    with force_triton():
        actual = focal_loss(x, t, alpha, beta)
        (actual_grad,) = torch.autograd.grad(actual, x)
    assert actual.dtype == torch.float32 and actual_grad.dtype == x.dtype
    torch.testing.assert_close(actual, expected.float(), rtol=loss_rtol, atol=1e-7)
    torch.testing.assert_close(actual_grad.float(), expected_grad.float(), rtol=grad_rtol, atol=grad_atol)


@pytest.mark.parametrize("device", triton_device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1,), (3, 1, 7, 5), (2, 3, 33, 29), (0, 3)], ids=str)
@pytest.mark.parametrize(("alpha", "beta"), [(2.0, 4.0), (1.5, 3.0), (2.0, 0.5)], ids=str)
def test_triton_matches_reference(
    device: str, dtype: torch.dtype, shape: tuple[int, ...], alpha: float, beta: float
) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    t = _heat_like(shape, seed=1).to(dtype)  # a half-precision target, as an AMP model would pass
    _check_triton(x.to(device), t.to(device), alpha, beta)


@pytest.mark.parametrize("device", triton_device_params())
def test_triton_grid_stride_loop(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels._focal_loss_triton as focal_triton

    monkeypatch.setattr(focal_triton, "_MAX_PROGRAMS", 2)  # 5000 elements -> 2 programs x 3 chunks each
    x = torch.randn(5000, generator=torch.Generator().manual_seed(8)) * 3
    _check_triton(x.to(device), _heat_like((5000,), seed=9, n_peaks=11).to(device), 2.0, 4.0)


@pytest.mark.parametrize("device", triton_device_params())
def test_triton_extreme_logits(device: str) -> None:
    x = torch.tensor([-1e4, 1e4, -80.0, 80.0, 30.0, -30.0, 0.0])
    t = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.3])
    _check_triton(x.to(device), t.to(device), 2.0, 4.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_realistic_size() -> None:
    x = torch.randn(4, 3, 200, 176, generator=torch.Generator().manual_seed(0)) * 4
    t = _heat_like((4, 3, 200, 176), seed=1, n_peaks=400)
    _check_triton(x.cuda(), t.cuda(), 2.0, 4.0)
    _check_triton(x.cuda().bfloat16(), t.cuda(), 2.0, 4.0)
