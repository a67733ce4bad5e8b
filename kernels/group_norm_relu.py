"""GroupNorm + ReLU: relu(group_norm(x.float())) rounded once, the detector's every normalization.

    group_norm_relu(x [B, C, H, W], weight [C], bias [C], groups, eps, out_dtype=None) -> [B, C, H, W]
    group_norm_relu_reference(...)                   the spec: plain PyTorch ops, autograd by PyTorch

The op `pfk::group_norm_relu` (+ `pfk::group_norm_relu_backward`, its gradient, itself an op): on CPU
the C kernels (kernels/native.py, one pass each way reading bf16 directly, channels-last) when the
library is built, its self-check ("native.group_norm_relu", kernels/selfcheck.py) has verified it here and
the input is channels-last float32/bfloat16; elsewhere (CUDA, NCHW, no compiler, `PFK_NATIVE=0`, a failed
check) `_forward_torch` / `_backward_torch`, PyTorch ops with the same contract. Statistics are
float32 whatever x's dtype: on CPU PyTorch's bf16 GroupNorm is ~10x slower on a channels-last input than
its fp32 one (docs/MODEL.md, "Speed"), and fp32 is what autocast's fp32 list would give.
As a custom op it is opaque to Dynamo and Inductor: torch.compile keeps the C kernel and fuses around
it (`register_fake` gives the output metadata). The ONNX export uses the reference (module swap:
pfactory/archs/painted_pillars/variants.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import native, selfcheck
from kernels._checks import FLOAT_DTYPES, describe, require, require_tensor

_OP = "group_norm_relu"
_NATIVE = "native.group_norm_relu"
_CL = torch.channels_last
# Below this many pixels per sample ATen's GroupNorm backward is the faster torch fallback (the
# [B, HW, C] reductions of `_backward_torch` cost ~20 small ops): fwd+bwd at [4, 64, 50, 44] 0.57 vs
# 0.71 ms, at [4, 32, 100, 88] 2.35 vs 1.66 ms (1 process, 2 threads, AMD EPYC).
_OWN_BACKWARD_MIN_PIXELS = 3000


# --------------------------------------------------------------------------------------------------
# reference (the spec)
# --------------------------------------------------------------------------------------------------
def group_norm_relu_reference(
    x: Tensor, weight: Tensor, bias: Tensor, groups: int, eps: float, out_dtype: torch.dtype | None = None
) -> Tensor:
    """relu(F.group_norm(x in float32, groups, weight, bias, eps)) in `out_dtype` (default x's dtype).

    x [B, C, H, W] float; weight, bias [C] float32 -> [B, C, H, W] (float64 stays float64: the tests'
    higher-precision spec)."""
    y = F.relu(F.group_norm(x if x.dtype == torch.float64 else x.float(), groups, weight, bias, eps))
    return y.to(out_dtype or x.dtype)


# --------------------------------------------------------------------------------------------------
# the op off the native path: PyTorch ops, the same contract
# --------------------------------------------------------------------------------------------------
def _forward_torch(
    x: Tensor, weight: Tensor, bias: Tensor, groups: int, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    b, c, h, w = x.shape
    xf = x.float()  # [B, C, H, W] fp32, x's layout (ATen's kernel for it)
    y, mean, rstd = torch.native_group_norm(xf, weight.float(), bias.float(), b, c, h * w, groups, eps)
    return y.relu_().to(out_dtype).contiguous(memory_format=_CL), mean, rstd  # mean, rstd [B, G]


def _backward_torch(
    grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor, groups: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The ReLU mask recomputed from x (x * a + d > 0, a = rstd * w, d = b - mean * a), then GroupNorm's
    backward: ATen's below `_OWN_BACKWARD_MIN_PIXELS` pixels, else its formula on the [B, HW, C] view
    (ATen's channels-last CPU GroupNorm backward is ~4x slower than its NCHW one at the BEV shapes)."""
    b, c, h, w = x.shape
    g, cg, hw = groups, c // groups, h * w
    weight, bias = weight.float(), bias.float()
    xv = x.float().permute(0, 2, 3, 1).reshape(b, hw, c)  # [B, HW, C] fp32
    a = (rstd.view(b, g, 1) * weight.view(1, g, cg)).reshape(b, 1, c)  # [B, 1, C]
    d = bias.view(1, 1, c) - (mean.view(b, g, 1) * a.view(b, g, cg)).reshape(b, 1, c)  # [B, 1, C]
    gv = grad.float().permute(0, 2, 3, 1).reshape(b, hw, c)  # [B, HW, C]
    gv = torch.where(xv * a + d > 0, gv, 0.0)  # [B, HW, C] the ReLU's gradient
    if hw < _OWN_BACKWARD_MIN_PIXELS:
        dx, dweight, dbias = torch.ops.aten.native_group_norm_backward(
            gv.view(b, h, w, c).permute(0, 3, 1, 2), x.float(), mean, rstd, weight, b, c, hw, g, [True] * 3
        )
        return dx.to(x.dtype).contiguous(memory_format=_CL), dweight, dbias
    db = gv.sum(1)  # [B, C] sum of g
    ds = (gv * xv).sum(1)  # [B, C] sum of g * x
    wg = weight.view(1, g, cg)
    dsg = (ds.view(b, g, cg) * wg).sum(-1)  # [B, G]
    dbg = (db.view(b, g, cg) * wg).sum(-1)  # [B, G]
    s = 1.0 / (cg * hw)
    c2 = (dbg * mean - dsg) * rstd.pow(3) * s  # [B, G]
    c3 = -c2 * mean - dbg * rstd * s  # [B, G]
    c1 = (rstd.view(b, g, 1) * wg).reshape(b, 1, c)  # [B, 1, C]
    dx = torch.addcmul(c3.repeat_interleave(cg, 1).view(b, 1, c), gv, c1)  # [B, HW, C] fp32
    dx = dx.addcmul_(xv, c2.repeat_interleave(cg, 1).view(b, 1, c)).to(x.dtype)  # rounded once
    dweight = ((ds.view(b, g, cg) - db.view(b, g, cg) * mean[..., None]) * rstd[..., None]).sum(0)
    return dx.view(b, h, w, c).permute(0, 3, 1, 2), dweight.reshape(c), db.sum(0)


# --------------------------------------------------------------------------------------------------
# custom ops: pfk::group_norm_relu and its backward
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("pfk::group_norm_relu", mutates_args=())
def _group_norm_relu_op(
    x: Tensor, weight: Tensor, bias: Tensor, groups: int, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [B, C, H, W] channels-last out_dtype, mean [B, G] float32, rstd [B, G] float32)."""
    if native.supports(x, groups) and selfcheck.trusted(_NATIVE, x.device):
        return native.group_norm_relu_forward(x, weight, bias, groups, eps, out_dtype)
    return _forward_torch(x, weight, bias, groups, eps, out_dtype)


@_group_norm_relu_op.register_fake
def _(
    x: Tensor, weight: Tensor, bias: Tensor, groups: int, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    b = x.shape[0]
    stats = x.new_empty((b, groups), dtype=torch.float32)
    return torch.empty_like(x, dtype=out_dtype, memory_format=_CL), stats, torch.empty_like(stats)


@torch.library.custom_op("pfk::group_norm_relu_backward", mutates_args=())
def _group_norm_relu_backward_op(
    grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor, groups: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx [B, C, H, W] channels-last in x's dtype, dweight [C] float32, dbias [C] float32)."""
    if (
        native.supports(x, groups)
        and grad.dtype in (torch.float32, torch.bfloat16)
        and selfcheck.trusted(_NATIVE, x.device)
    ):
        return native.group_norm_relu_backward(grad, x, mean, rstd, weight, bias, groups)
    return _backward_torch(grad, x, mean, rstd, weight, bias, groups)


@_group_norm_relu_backward_op.register_fake
def _(
    grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor, groups: int
) -> tuple[Tensor, Tensor, Tensor]:
    c = x.shape[1]
    dweight = x.new_empty((c,), dtype=torch.float32)
    return torch.empty_like(x, memory_format=_CL), dweight, torch.empty_like(dweight)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    x, weight, bias, groups, _eps, _out_dtype = inputs
    _out, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)  # the backward recomputes the ReLU mask from x
    ctx.groups = groups


def _backward(
    ctx: torch.autograd.function.FunctionCtx,
    grad: Tensor,
    _grad_mean: Tensor | None,
    _grad_rstd: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = _group_norm_relu_backward_op(grad, x, mean, rstd, weight, bias, ctx.groups)
    return dx, dweight.to(weight.dtype), dbias.to(bias.dtype), None, None, None


_group_norm_relu_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------------
def group_norm_relu(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    groups: int,
    eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """relu(group_norm(x.float(), groups, weight, bias, eps)) rounded once to `out_dtype` (default x's).

    x [B, C, H, W] float32 or bfloat16 (channels-last is the fast layout; the output is channels-last),
    weight, bias [C] float32 -> [B, C, H, W]. Differentiable w.r.t. x, weight and bias; the gradient of
    x is in x's dtype. The same function as `group_norm_relu_reference` to float rounding."""
    require_tensor(x, _OP, "x", dtypes=(torch.float32, torch.bfloat16), ndim=4)
    require_tensor(weight, _OP, "weight", dtypes=FLOAT_DTYPES, ndim=1)
    require_tensor(bias, _OP, "bias", dtypes=FLOAT_DTYPES, ndim=1)
    c = x.shape[1]
    require(
        weight.shape[0] == c and bias.shape[0] == c and groups > 0 and c % groups == 0,
        _OP,
        lambda: (
            f"weight and bias must be [C] with C = {c} divisible by groups={groups}, got {describe(weight)}"
        ),
    )
    out, _mean, _rstd = _group_norm_relu_op(x, weight, bias, groups, eps, out_dtype or x.dtype)
    return out


# --------------------------------------------------------------------------------------------------
# self-check (kernels/selfcheck.py): the C kernels against the PyTorch ops of the same contract
# --------------------------------------------------------------------------------------------------
# Normwise relative tolerances (max |err| / max |reference|) per dtype, (out, dx; dweight and dbias sum in
# float32): one rounding of the output dtype (tests/kernels/test_group_norm_relu.py).
_CHECK_TOLERANCES = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2**-7, 1e-2)}


def _check_native(device: torch.device) -> selfcheck.Figures:
    """Forward and backward of the C kernels vs `_forward_torch` / `_backward_torch`, x [2, 24, 5, 7]
    channels-last (6 groups) in float32 and bfloat16."""
    if not native.available():
        raise selfcheck.Skip(f"C kernels {native.status()}")
    g = torch.Generator().manual_seed(0)
    x32 = (torch.randn(2, 24, 5, 7, generator=g) * 2 + 0.5).contiguous(memory_format=_CL)
    weight, bias = torch.rand(24, generator=g) + 0.5, torch.randn(24, generator=g) * 0.1
    grad32 = torch.randn(x32.shape, generator=g).contiguous(memory_format=_CL)
    figures: selfcheck.Figures = {}
    for dtype, (tol, grad_tol) in _CHECK_TOLERANCES.items():
        name = str(dtype).removeprefix("torch.")
        x, grad = x32.to(dtype), grad32.to(dtype)
        out, mean, rstd = native.group_norm_relu_forward(x, weight, bias, 6, 1e-5, dtype)
        want, want_mean, want_rstd = _forward_torch(x, weight, bias, 6, 1e-5, dtype)
        selfcheck.compare(figures, f"{name} fwd", out, want, tol, rel=True)
        selfcheck.compare(figures, f"{name} fwd mean", mean, want_mean, 1e-5, rel=True)
        selfcheck.compare(figures, f"{name} fwd rstd", rstd, want_rstd, 1e-5, rel=True)
        got = native.group_norm_relu_backward(grad, x, want_mean, want_rstd, weight, bias, 6)
        expected = _backward_torch(grad, x, want_mean, want_rstd, weight, bias, 6)
        for part, a, e in zip(("dx", "dweight", "dbias"), got, expected):
            selfcheck.compare(figures, f"{name} bwd {part}", a, e, grad_tol, rel=True)
    return figures


native.register_check(_NATIVE, _check_native, __file__, "C GroupNorm+ReLU fwd+bwd vs the PyTorch ops, fp32/bf16")
