"""Penalty-reduced focal loss of CenterNet / CenterPoint on sigmoid(logits), fused forward and backward.

    focal_loss(logits [...] float, target [...] float in [0, 1], alpha=2.0, beta=4.0) -> loss [] float32

With p = sigmoid(logits), pos = (target == 1):
    loss = ( sum_pos -log(p) (1 - p)^alpha + sum_not_pos -log(1 - p) p^alpha (1 - target)^beta )
           / max(1, number of pos cells)
Logs come from softplus (log p = -softplus(-x), log(1 - p) = -softplus(x)) and powers of p from
exp(alpha * log p), so no p is ever clamped (CenterPoint clamps p to [1e-4, 1 - 1e-4]; this does not,
the two agree wherever the clamp is inactive). Computed in float32 (float64 for float64 logits);
the loss is float32 (float64); the gradient w.r.t. logits has the logits' dtype; target gets none.

    d loss_pos / dx = -(1 - p)^alpha * ((1 - p) + alpha * p * softplus(-x))
    d loss_neg / dx = (1 - t)^beta * p^alpha * (p + alpha * (1 - p) * softplus(x))

Backends: `pfk::focal_loss` / `pfk::focal_loss_backward` run the Triton kernels
(kernels/_focal_loss_triton.py: one read of logits and target forward, one read + one write backward)
on CUDA once their self-check ("triton.focal_loss", `_check_triton`) has verified them on the device,
and `focal_loss_reference` / `_focal_loss_backward_reference` elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import selfcheck
from kernels._checks import FLOAT_DTYPES, describe, require, require_same_device, require_tensor
from kernels._dispatch import triton_for_check, triton_module, triton_source, use_triton

_OP = "focal_loss"
_PATH = "triton.focal_loss"


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def focal_loss_reference(logits: Tensor, target: Tensor, alpha: float = 2.0, beta: float = 4.0) -> Tensor:
    """Scalar penalty-reduced focal loss (module docstring); differentiable by autograd in both inputs."""
    assert logits.shape == target.shape, f"logits {tuple(logits.shape)} != target {tuple(target.shape)}"
    x = logits.to(_compute_dtype(logits))  # [...]
    t = target.to(x.dtype)  # [...]
    log_p = F.logsigmoid(x)  # [...] log p = -softplus(-x)
    log_1mp = F.logsigmoid(-x)  # [...] log(1 - p) = -softplus(x)
    pos = t == 1  # [...]
    pos_loss = -log_p * torch.exp(alpha * log_1mp)  # -log(p) (1 - p)^alpha
    neg_loss = -log_1mp * torch.exp(alpha * log_p) * (1 - t) ** beta  # -log(1 - p) p^alpha (1 - t)^beta
    num_pos = pos.sum()  # [] int64
    return torch.where(pos, pos_loss, neg_loss).sum() / num_pos.clamp(min=1)


def _focal_loss_backward_reference(
    grad_loss: Tensor, logits: Tensor, target: Tensor, normalizer: Tensor, alpha: float, beta: float
) -> Tensor:
    """grad_logits [...] (logits' dtype) = grad_loss / normalizer * d(summed loss)/d logits."""
    x = logits.to(_compute_dtype(logits))  # [...]
    t = target.to(x.dtype)  # [...]
    p, q = torch.sigmoid(x), torch.sigmoid(-x)  # [...] p and 1 - p, each without cancellation
    sp_pos, sp_neg = F.softplus(x), F.softplus(-x)  # [...] -log(1 - p), -log(p)
    d_pos = -torch.exp(-alpha * sp_pos) * (q + alpha * p * sp_neg)  # [...]
    d_neg = (1 - t) ** beta * torch.exp(-alpha * sp_neg) * (p + alpha * q * sp_pos)  # [...]
    scale = grad_loss.to(x.dtype) / normalizer  # []
    return (scale * torch.where(t == 1, d_pos, d_neg)).to(logits.dtype)


def _focal_loss_forward_reference(
    logits: Tensor, target: Tensor, alpha: float, beta: float
) -> tuple[Tensor, Tensor]:
    """(loss [], normalizer [] = max(1, number of pos cells)), both in the compute dtype."""
    normalizer = (target == 1).sum().clamp(min=1).to(_compute_dtype(logits))  # []
    return focal_loss_reference(logits, target, alpha, beta), normalizer


@torch.library.custom_op("pfk::focal_loss", mutates_args=())
def _focal_loss_op(logits: Tensor, target: Tensor, alpha: float, beta: float) -> tuple[Tensor, Tensor]:
    """(loss [], normalizer []); the normalizer is kept for the backward."""
    if logits.dtype != torch.float64 and use_triton(logits, _PATH):
        return triton_module("_focal_loss_triton").focal_loss_fwd(logits, target, alpha, beta)
    return _focal_loss_forward_reference(logits, target, alpha, beta)


@_focal_loss_op.register_fake
def _(logits: Tensor, target: Tensor, alpha: float, beta: float) -> tuple[Tensor, Tensor]:
    dtype = _compute_dtype(logits)
    return logits.new_empty((), dtype=dtype), logits.new_empty((), dtype=dtype)


@torch.library.custom_op("pfk::focal_loss_backward", mutates_args=())
def _focal_loss_backward_op(
    grad_loss: Tensor, logits: Tensor, target: Tensor, normalizer: Tensor, alpha: float, beta: float
) -> Tensor:
    if logits.dtype != torch.float64 and use_triton(logits, _PATH):
        return triton_module("_focal_loss_triton").focal_loss_bwd(
            grad_loss, logits, target, normalizer, alpha, beta
        )
    return _focal_loss_backward_reference(grad_loss, logits, target, normalizer, alpha, beta)


@_focal_loss_backward_op.register_fake
def _(
    grad_loss: Tensor, logits: Tensor, target: Tensor, normalizer: Tensor, alpha: float, beta: float
) -> Tensor:
    return torch.empty_like(logits)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    logits, target, alpha, beta = inputs
    _loss, normalizer = output
    ctx.save_for_backward(logits, target, normalizer)
    ctx.alpha, ctx.beta = alpha, beta


def _backward(
    ctx: torch.autograd.function.FunctionCtx, grad_loss: Tensor, _grad_normalizer: Tensor | None
) -> tuple[Tensor, None, None, None]:
    logits, target, normalizer = ctx.saved_tensors
    grad_logits = _focal_loss_backward_op(grad_loss, logits, target, normalizer, ctx.alpha, ctx.beta)
    return grad_logits, None, None, None


_focal_loss_op.register_autograd(_backward, setup_context=_setup_context)


def focal_loss(logits: Tensor, target: Tensor, alpha: float = 2.0, beta: float = 4.0) -> Tensor:
    """Scalar penalty-reduced focal loss of sigmoid(logits) against a Gaussian heatmap target.

    logits and target: same shape (e.g. [B, K, H, W]), floating; target in [0, 1] with exactly 1 at
    object peaks. alpha, beta >= 0. Differentiable w.r.t. logits only.
    """
    require_tensor(logits, _OP, "logits", dtypes=FLOAT_DTYPES)
    require_tensor(target, _OP, "target", dtypes=FLOAT_DTYPES)
    require(
        logits.shape == target.shape,
        _OP,
        lambda: f"logits and target must have the same shape, got {describe(logits)} and {describe(target)}",
    )
    require_same_device(_OP, logits=logits, target=target)
    require(float(alpha) >= 0 and float(beta) >= 0, _OP, f"alpha and beta must be >= 0, got {alpha}, {beta}")
    if torch.onnx.is_in_onnx_export():
        return focal_loss_reference(logits, target.detach(), float(alpha), float(beta))
    loss, _normalizer = _focal_loss_op(
        logits.contiguous(), target.detach().contiguous(), float(alpha), float(beta)
    )
    return loss


# --------------------------------------------------------------------------------------------------
# self-check (kernels/selfcheck.py): the Triton kernels against the references on a small heatmap
# --------------------------------------------------------------------------------------------------
# Normwise relative tolerances (max |err| / max |reference|): the loss sums in float32 either way; the
# gradient is rounded to the logits' dtype: 2 units of its last place (one can be 2**-7 of an element in
# bf16: measured 6.9e-3 under the interpreter; tests/kernels/test_focal_loss.py).
_CHECK_TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 2**-6), torch.float16: (1e-5, 2**-9)}


def _check_triton(device: torch.device) -> selfcheck.Figures:
    """Forward and backward of the Triton kernels vs the references, logits [2, 3, 9, 11] in each dtype."""
    triton = triton_for_check("_focal_loss_triton", device)
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(2, 3, 9, 11, generator=g) * 3
    target = torch.rand(x32.shape, generator=g) ** 4
    target.view(-1)[torch.randperm(target.numel(), generator=g)[:4]] = 1.0
    target = target.to(device)
    figures: selfcheck.Figures = {}
    for dtype, (loss_tol, grad_tol) in _CHECK_TOLERANCES.items():
        name = str(dtype).removeprefix("torch.")
        x = x32.to(device=device, dtype=dtype)
        loss, normalizer = triton.focal_loss_fwd(x, target, 2.0, 4.0)
        want_loss, want_norm = _focal_loss_forward_reference(x, target, 2.0, 4.0)
        selfcheck.compare(figures, f"{name} fwd", loss, want_loss, loss_tol, rel=True)
        selfcheck.compare(figures, f"{name} fwd positives", normalizer, want_norm, 0.0)
        grad_loss = torch.tensor(1.0, device=device)
        grad = triton.focal_loss_bwd(grad_loss, x, target, want_norm, 2.0, 4.0)
        want = _focal_loss_backward_reference(grad_loss, x, target, want_norm, 2.0, 4.0)
        selfcheck.compare(figures, f"{name} bwd", grad, want, grad_tol, rel=True)
    return figures


selfcheck.register(
    selfcheck.Check(
        _PATH,
        _check_triton,
        lambda: selfcheck.sources_hash([triton_source("_focal_loss_triton"), __file__]),
        ("cuda", "cpu"),
        "Triton focal loss fwd+bwd vs the reference, fp32/bf16/fp16",
    )
)
