"""The sparse BEV stem: the pillar canvas' scatter-max and the first 3x3, stride-2 conv as one op.

    pillar_stem(features [N, C], cell_index [N], weight [Cout, C, 3, 3], batch, grid, out_hw,
                round_bf16=False, out_dtype=float32) -> [B, Cout, Ho, Wo] channels-last
    pillar_stem_reference(...)              the spec: `pillar_scatter_max_reference` canvas, then conv2d

conv2d(canvas, weight, stride 2, padding 1, no bias), the canvas [B, C, H, W] being the per-cell max of
the point features (`kernels.pillar_scatter_max`, 0 in empty cells) zero-padded at the bottom/right to
the conv's output size `out_hw`. With `round_bf16` the canvas maxima and the weight are rounded to
bfloat16 values first and the output rounded once (what the dense conv under bf16 autocast computes).
Backward: the canvas gradient at each occupied cell goes to the point holding each channel's max (the
lowest index on a tie, as `pillar_scatter_max`), and the weight's gradient.

The op `pfk::pillar_stem` (+ `pfk::pillar_stem_backward`, itself an op): on CPU the C kernels
(kernels/native.py) compute it from the occupied pillars only (~6% of the default canvas): the dense
canvas, its fill, its gradient and the conv's dense backward are never made (docs/MODEL.md, "Speed"),
once their self-check ("native.pillar_stem", kernels/selfcheck.py) has verified them on this machine.
Elsewhere (CUDA, no compiler, `PFK_NATIVE=0`, a failed check) `_forward_torch` / `_backward_torch`: the compact
scatter-max op, a dense conv and its gradients, the same saved tensors. Opaque to torch.compile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

import kernels.pillar_scatter  # noqa: F401  (registers pfk::pillar_scatter_max, used by the torch path)
from kernels import native, selfcheck
from kernels._checks import describe, require, require_tensor
from kernels.native import stem_operand
from kernels.pillar_scatter import pillar_scatter_max_reference

_OP = "pillar_stem"
_NATIVE = "native.pillar_stem"
_CL = torch.channels_last


def _image(rows: Tensor, batch: int, grid: tuple[int, int], out_hw: tuple[int, int]) -> Tensor:
    """canvas rows [B*H*W, C] -> [B, C, 2*Ho, 2*Wo] (zero rows/columns added at the bottom/right): what
    a 3x3 stride-2 padding-1 conv turns into [B, C, Ho, Wo]."""
    h, w = grid
    ho, wo = out_hw
    img = rows.reshape(batch, h, w, -1).permute(0, 3, 1, 2)  # [B, C, H, W]
    return F.pad(img, (0, 2 * wo - w, 0, 2 * ho - h))


# --------------------------------------------------------------------------------------------------
# reference (the spec)
# --------------------------------------------------------------------------------------------------
def pillar_stem_reference(
    features: Tensor,
    cell_index: Tensor,
    weight: Tensor,
    batch: int,
    grid: tuple[int, int],
    out_hw: tuple[int, int],
    round_bf16: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """conv2d(scatter-max canvas, weight, stride 2, padding 1) -> [B, Cout, Ho, Wo]; autograd by PyTorch."""
    h, w = grid
    canvas = pillar_scatter_max_reference(features, cell_index, batch * h * w)  # [B*H*W, C]
    img = _image(stem_operand(canvas, round_bf16), batch, grid, out_hw)  # [B, C, 2Ho, 2Wo]
    return F.conv2d(img, stem_operand(weight, round_bf16), stride=2, padding=1).to(out_dtype)


# --------------------------------------------------------------------------------------------------
# the op off the native path: PyTorch ops, the same saved tensors
# --------------------------------------------------------------------------------------------------
def _forward_torch(
    features: Tensor,
    cell_index: Tensor,
    weight: Tensor,
    batch: int,
    grid: tuple[int, int],
    out_hw: tuple[int, int],
    round_bf16: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`native.pillar_stem_forward` in PyTorch ops: the same arguments -> the same (out, seg, occupied, win,
    first, rows), from the compact scatter-max op and a dense conv (seg's rows M.. are 0 here)."""
    h, w = grid
    cells = batch * h * w
    canvas, occupied, win, rows = torch.ops.pfk.pillar_scatter_max(
        features.detach().float(), cell_index, cells, True, torch.float32
    )  # [cells, C], the winner table [N], [N, C], M
    canvas = stem_operand(canvas, round_bf16)
    seg = torch.where(occupied[:, None] >= 0, canvas.index_select(0, occupied.clamp(min=0)), 0.0)  # [N, C]
    img = _image(canvas, batch, grid, out_hw)
    out = F.conv2d(img, stem_operand(weight.detach(), round_bf16), stride=2, padding=1)  # [B, Cout, Ho, Wo]
    starts = torch.arange(batch + 1, device=features.device) * (h * w)  # [B + 1] first cell per sample
    first = torch.searchsorted(occupied[: int(rows[0])], starts)  # [B + 1] first row per sample
    return out.to(out_dtype).contiguous(memory_format=_CL), seg, occupied, win, first, rows


def _backward_torch(
    grad: Tensor,
    weight: Tensor,
    seg: Tensor,
    occupied: Tensor,
    win: Tensor,
    rows: Tensor,
    grid: tuple[int, int],
    round_bf16: bool,
) -> tuple[Tensor, Tensor]:
    """`native.pillar_stem_backward` in PyTorch ops: grad [B, Cout, Ho, Wo] and `_forward_torch`'s saved
    tensors -> (grad_features [N, C] float32, grad_weight [Cout, C, 3, 3] float32), by the dense canvas."""
    batch, _cout, ho, wo = grad.shape
    h, w = grid
    m = int(rows[0])
    canvas = seg.new_zeros(batch * h * w, seg.shape[1]).index_copy_(0, occupied[:m], seg[:m])  # [cells, C]
    img = _image(canvas, batch, grid, (ho, wo))  # [B, C, 2Ho, 2Wo]
    g, wq = grad.float(), stem_operand(weight.detach(), round_bf16)
    grad_img = torch.nn.grad.conv2d_input(img.shape, wq, g, stride=2, padding=1)  # [B, C, 2Ho, 2Wo]
    grad_weight = torch.nn.grad.conv2d_weight(img, wq.shape, g, stride=2, padding=1)  # [Cout, C, 3, 3]
    grad_canvas = grad_img[:, :, :h, :w].permute(0, 2, 3, 1).reshape(batch * h * w, -1)  # [cells, C]
    grad_canvas = stem_operand(grad_canvas, round_bf16)
    grad_features = torch.ops.pfk.pillar_scatter_max_backward(grad_canvas, occupied, win, rows, torch.float32)
    return grad_features, grad_weight.contiguous()


# --------------------------------------------------------------------------------------------------
# custom ops: pfk::pillar_stem and its backward
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("pfk::pillar_stem", mutates_args=())
def _pillar_stem_op(
    features: Tensor,
    cell_index: Tensor,
    weight: Tensor,
    batch: int,
    height: int,
    width: int,
    out_height: int,
    out_width: int,
    round_bf16: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out [B, Cout, Ho, Wo] channels-last out_dtype, and for the backward: seg [N, C] float32 (rows
    0..M-1: the occupied cells' maxima), occupied [N] int64 (their cells, then -1), win [N, C] int32 (the
    point holding each max), first [B + 1] int64 (each sample's first row), rows [1] int64 = M). Rows
    M.. of seg and win are unspecified (the C kernel leaves them unwritten: ~20 MB of stores a step)."""
    args = (batch, (height, width), (out_height, out_width), round_bf16, out_dtype)
    if native.pillar_stem_supported(features, cell_index, weight) and selfcheck.trusted(
        _NATIVE, features.device
    ):
        return native.pillar_stem_forward(features, cell_index, weight, *args)
    return _forward_torch(features, cell_index, weight, *args)


@_pillar_stem_op.register_fake
def _(
    features: Tensor,
    cell_index: Tensor,
    weight: Tensor,
    batch: int,
    height: int,
    width: int,
    out_height: int,
    out_width: int,
    round_bf16: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    n, c = features.shape
    out = torch.empty(
        (batch, weight.shape[0], out_height, out_width),
        dtype=out_dtype,
        device=features.device,
        memory_format=_CL,
    )
    return (
        out,
        features.new_empty((n, c), dtype=torch.float32),
        features.new_empty((n,), dtype=torch.int64),
        features.new_empty((n, c), dtype=torch.int32),
        features.new_empty((batch + 1,), dtype=torch.int64),
        features.new_empty((1,), dtype=torch.int64),
    )


@torch.library.custom_op("pfk::pillar_stem_backward", mutates_args=())
def _pillar_stem_backward_op(
    grad: Tensor,
    weight: Tensor,
    seg: Tensor,
    occupied: Tensor,
    win: Tensor,
    first: Tensor,
    rows: Tensor,
    height: int,
    width: int,
    round_bf16: bool,
) -> tuple[Tensor, Tensor]:
    """(grad_features [N, C] float32, grad_weight [Cout, C, 3, 3] float32) from grad [B, Cout, Ho, Wo]."""
    cpu = grad.device.type == "cpu" and seg.device.type == "cpu"
    if cpu and native.available() and selfcheck.trusted(_NATIVE, grad.device):
        return native.pillar_stem_backward(
            grad, weight, seg, occupied, win, first, rows, (height, width), round_bf16
        )
    return _backward_torch(grad, weight, seg, occupied, win, rows, (height, width), round_bf16)


@_pillar_stem_backward_op.register_fake
def _(
    grad: Tensor,
    weight: Tensor,
    seg: Tensor,
    occupied: Tensor,
    win: Tensor,
    first: Tensor,
    rows: Tensor,
    height: int,
    width: int,
    round_bf16: bool,
) -> tuple[Tensor, Tensor]:
    return seg.new_empty(seg.shape), weight.new_empty(weight.shape, dtype=torch.float32)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    features, _cell, weight, _b, height, width, _ho, _wo, round_bf16, _dtype = inputs
    _out, seg, occupied, win, first, rows = output
    ctx.save_for_backward(weight, seg, occupied, win, first, rows)
    ctx.grid, ctx.round_bf16, ctx.features_dtype = (height, width), round_bf16, features.dtype


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor, *_grad_saved: Tensor | None) -> tuple:
    weight, seg, occupied, win, first, rows = ctx.saved_tensors
    grad_features, grad_weight = _pillar_stem_backward_op(
        grad, weight, seg, occupied, win, first, rows, *ctx.grid, ctx.round_bf16
    )
    return grad_features.to(ctx.features_dtype), None, grad_weight.to(weight.dtype), *([None] * 7)


_pillar_stem_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------------
def pillar_stem(
    features: Tensor,
    cell_index: Tensor,
    weight: Tensor,
    batch: int,
    grid: tuple[int, int],
    out_hw: tuple[int, int],
    round_bf16: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """conv2d(scatter-max canvas of `features` by `cell_index`, weight, stride 2, padding 1), sparse.

    features [N, C] float32, cell_index [N] int64 (`b*H*W + row*W + col`; outside [0, B*H*W): dropped),
    weight [Cout, C, 3, 3], grid (H, W), out_hw (Ho, Wo) with H <= 2*Ho and W <= 2*Wo -> [B, Cout, Ho, Wo]
    channels-last `out_dtype`. Differentiable w.r.t. features and weight."""
    require_tensor(features, _OP, "features", dtypes=(torch.float32,), ndim=2)
    require_tensor(cell_index, _OP, "cell_index", dtypes=(torch.int64,), ndim=1)
    require_tensor(weight, _OP, "weight", dtypes=(torch.float32, torch.bfloat16), ndim=4)
    (h, w), (ho, wo) = grid, out_hw
    require(
        tuple(weight.shape[1:]) == (features.shape[1], 3, 3) and h <= 2 * ho and w <= 2 * wo,
        _OP,
        lambda: (
            f"weight must be [Cout, {features.shape[1]}, 3, 3] and grid {grid} <= 2 * out_hw {out_hw}, "
            f"got {describe(weight)}"
        ),
    )
    out, *_saved = _pillar_stem_op(
        features.contiguous(), cell_index.contiguous(), weight, batch, h, w, ho, wo, round_bf16, out_dtype
    )
    return out


# --------------------------------------------------------------------------------------------------
# self-check (kernels/selfcheck.py): the C kernels against the spec and its autograd
# --------------------------------------------------------------------------------------------------
def _check_native(device: torch.device) -> selfcheck.Figures:
    """The C forward and backward vs `pillar_stem_reference` and its autograd gradients (features and
    weight), 2 samples of a 9 x 7 grid, 5 -> 20 channels, fp32 and bf16-rounded: normwise relative error
    <= 1e-5 (fp32), 2e-2 (bf16; tests/kernels/test_native.py)."""
    if not native.available():
        raise selfcheck.Skip(f"C kernels {native.status()}")
    g = torch.Generator().manual_seed(0)
    b, h, w, c, cout, n = 2, 9, 7, 5, 20, 150
    features = torch.randn(n, c, generator=g)
    cell_index = torch.randint(-1, b * h * w, (n,), generator=g)
    weight = torch.randn(cout, c, 3, 3, generator=g) * 0.2
    out_hw = ((h - 1) // 2 + 1, (w - 1) // 2 + 1)
    grad = torch.randn(b, cout, *out_hw, generator=g)
    figures: selfcheck.Figures = {}
    for round_bf16, dtype, tol in ((False, torch.float32, 1e-5), (True, torch.bfloat16, 2e-2)):
        name = str(dtype).removeprefix("torch.")
        out, *saved = native.pillar_stem_forward(
            features, cell_index, weight, b, (h, w), out_hw, round_bf16, dtype
        )
        fr, wr = features.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with torch.enable_grad():
            want = pillar_stem_reference(fr, cell_index, wr, b, (h, w), out_hw, round_bf16, dtype)
            want_f, want_w = torch.autograd.grad(want, [fr, wr], grad.to(dtype))
        selfcheck.compare(figures, f"{name} fwd", out, want.detach(), tol, rel=True)
        got_f, got_w = native.pillar_stem_backward(grad.to(dtype), weight, *saved, (h, w), round_bf16)
        selfcheck.compare(figures, f"{name} bwd features", got_f, want_f, tol, rel=True)
        selfcheck.compare(figures, f"{name} bwd weight", got_w, want_w, tol, rel=True)
    return figures


native.register_check(_NATIVE, _check_native, __file__, "C sparse BEV stem fwd+bwd vs the dense conv's autograd, fp32/bf16")
