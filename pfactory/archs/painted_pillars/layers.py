"""The detector's building blocks: channels-last 1x1 convolution, GroupNorm + ReLU, conv-norm-act, and
the pillar MLP's first-layer GEMM.

Each block is the math once. Its export twin (`Conv1x1` -> `nn.Conv2d`, `GroupNormReLU` ->
`GroupNormReLUExport`) is swapped in from outside by `pfactory.archs.painted_pillars.variants.for_export`, never chosen
inside a `forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kernels


class Conv1x1(nn.Conv2d):
    """A 1x1, stride-1 convolution that runs as one GEMM on the channels-last view of its input.

    PyTorch's CPU dispatcher sends 1x1 convolutions to its `slow_conv2d` kernels (NCHW GEMMs plus
    layout copies for a channels-last input); `F.linear` on `x.permute(0, 2, 3, 1)`, which *is* the
    contiguous [B, H, W, C] memory of a channels-last tensor, does the same arithmetic with no copy
    (fwd+bwd of [4, 96, 100, 88] -> 32 channels: docs/MODEL.md, "Speed"). Same parameters and state-dict
    keys as `nn.Conv2d`; an NCHW input takes the plain convolution (the layout decides, not the mode).
    """

    def __init__(self, c_in: int, c_out: int, bias: bool = True) -> None:
        super().__init__(c_in, c_out, 1, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if not x.is_contiguous(memory_format=torch.channels_last):
            return super().forward(x)
        y = F.linear(x.permute(0, 2, 3, 1), self.weight.flatten(1), self.bias)  # [B, H, W, Cout]
        return y.permute(0, 3, 1, 2)  # [B, Cout, H, W], channels-last memory


class GroupNormReLU(nn.GroupNorm):
    """`nn.GroupNorm` then ReLU, normalizing in fp32 (`kernels.group_norm_relu`); same parameters and
    state-dict keys as `nn.GroupNorm`.

    In: [B, C, H, W] (a conv output: bf16 under CPU autocast). Out: the same shape, channels-last, in the
    input's dtype (the next convolution would cast it there anyway: the same values), or fp32 with
    `out_fp32` (for an output that is not a convolution's input, e.g. the image features the painting
    samples in fp32). `pfk::group_norm_relu` runs the C kernels on CPU (one pass each way, ReLU and
    casts fused: docs/MODEL.md, "Speed"), is opaque to torch.compile and has its own backward op.
    """

    def __init__(self, num_groups: int, num_channels: int, out_fp32: bool = False) -> None:
        super().__init__(num_groups, num_channels)
        self.out_fp32 = out_fp32

    def forward(self, x: Tensor) -> Tensor:
        out_dtype = torch.float32 if self.out_fp32 else x.dtype
        return kernels.group_norm_relu(x, self.weight, self.bias, self.num_groups, self.eps, out_dtype)


class GroupNormReLUExport(GroupNormReLU):
    """`GroupNormReLU` as plain ONNX-exportable ops (GroupNormalization + Relu), fp32 out: the export's
    twin (`pfactory.archs.painted_pillars.variants.for_export`); the same function."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(nn.GroupNorm.forward(self, x.float() if x.dtype == torch.bfloat16 else x), inplace=True)


def conv_norm_act(
    c_in: int, c_out: int, groups: int, stride: int = 1, kernel: int = 3, out_fp32: bool = False
) -> nn.Sequential:
    """Conv (no bias: the norm has one) -> GroupNorm + ReLU (`GroupNormReLU`)."""
    if kernel == 1 and stride == 1:
        conv: nn.Module = Conv1x1(c_in, c_out, bias=False)
    else:
        conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)
    return nn.Sequential(conv, GroupNormReLU(groups, c_out, out_fp32))


class _LinearLongK(torch.autograd.Function):
    """`F.linear(x, weight)` (no bias) whose weight gradient is computed as `(x^T @ grad)^T`.

    x [N, K], weight [C, K] -> [N, C]. For the pillar MLP's first layer N is every point (~90k), K ~ 10
    and C = 32: autograd's `grad^T @ x` (a [32, N] column-major times [N, K] GEMM) runs ~5x slower in
    MKL on CPU than the same product spelled `x^T @ grad` (5.6 vs 1.1 ms at N = 88k, 2 threads; docs/MODEL.md,
    "Speed"). The same sums in another association: equal to float rounding. Plain tensor ops: Dynamo
    traces it.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: Tensor
    ) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None  # [N, K]
        grad_w = torch.mm(x.t(), grad).t() if ctx.needs_input_grad[1] else None  # [C, K]
        return grad_x, grad_w


def linear_long_k(x: Tensor, weight: Tensor) -> Tensor:
    """x [N, K] @ weight [C, K]^T -> [N, C] (both one dtype, no autocast: the caller disables it) with a
    fast weight gradient for large N (`_LinearLongK`)."""
    return _LinearLongK.apply(x, weight)
