"""Triton kernels for `pfk::focal_loss` and its backward (imported lazily: this module imports triton).

    focal_loss_fwd(logits [...], target [...], alpha, beta) -> loss [] float32, normalizer [] float32
    focal_loss_bwd(grad_loss [], logits, target, normalizer [], alpha, beta) -> grad_logits [...]

Forward: `_focal_loss_fwd_kernel` streams logits and target once (a fixed grid of at most
_MAX_PROGRAMS programs, each striding over BLOCK-sized chunks) and writes one partial loss sum and
one positive count per program; `_focal_loss_finalize_kernel` (one program) sums the partials in a
fixed order and writes loss = sum / max(1, count). No float atomics, so the loss is bitwise
reproducible on a given GPU. Backward: `_focal_loss_bwd_kernel` recomputes p from the logits
(cheaper than storing it: 8 bytes read vs 4 written + 4 read per element) and writes
grad = grad_loss / normalizer * dloss/dx in one pass; grad_loss and normalizer are read from device
memory, so nothing syncs with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._device import on_device

# Not yet tuned on a GPU (docs/KERNELS.md, "Tuning"): 1024 elements per chunk = 8 per thread at 4
# warps; 1024 programs is ~8 per SM on an H200 (132 SMs), enough to saturate HBM for a stream.
_BLOCK = 1024
_MAX_PROGRAMS = 1024


@triton.jit
def _log1p_unit(e):
    """log(1 + e) for e in [0, 1], accurate to a few ulp (Goldberg: log(u) * e / (u - 1), u = 1 + e)."""
    u = 1.0 + e
    exact = u == 1.0  # e below half an ulp of 1: log1p(e) = e to float32 precision
    return tl.where(exact, e, tl.log(u) * e / tl.where(exact, 1.0, u - 1.0))


@triton.jit
def _pow_const(q, EXP: tl.constexpr):
    """q ** EXP for q in [0, 1]; integer exponents by multiplication (exact like torch.pow for 0..4)."""
    if EXP == 0.0:
        w = tl.full(q.shape, 1.0, tl.float32)
    elif EXP == 1.0:
        w = q
    elif EXP == 2.0:
        w = q * q
    elif EXP == 3.0:
        w = q * q * q
    elif EXP == 4.0:
        q2 = q * q
        w = q2 * q2
    else:
        w = tl.where(q > 0.0, tl.exp2(EXP * tl.log2(tl.maximum(q, 1e-30))), 0.0)
    return w


@triton.jit
def _softplus_pair(x):
    """(softplus(x), softplus(-x)) = (-log(1 - p), -log(p)), sharing one exp and one log."""
    m = _log1p_unit(tl.exp(-tl.abs(x)))
    return tl.maximum(x, 0.0) + m, tl.maximum(-x, 0.0) + m


@triton.jit
def _focal_loss_fwd_kernel(
    logits_ptr,
    target_ptr,
    partial_loss_ptr,  # [P] float32
    partial_pos_ptr,  # [P] int32
    n,
    iters,
    alpha,
    BETA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    loss_acc = tl.zeros([BLOCK], dtype=tl.float32)
    pos_acc = tl.zeros([BLOCK], dtype=tl.int32)
    for it in range(0, iters):
        offs = (it * nprog + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        ok = offs < n
        x = tl.load(logits_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        t = tl.load(target_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        sp_pos, sp_neg = _softplus_pair(x)
        pos = t == 1.0
        pos_loss = sp_neg * tl.exp(-alpha * sp_pos)  # -log(p) (1 - p)^alpha
        neg_loss = (
            sp_pos * tl.exp(-alpha * sp_neg) * _pow_const(1.0 - t, BETA)
        )  # -log(1-p) p^alpha (1-t)^beta
        loss_acc += tl.where(ok, tl.where(pos, pos_loss, neg_loss), 0.0)
        pos_acc += (ok & pos).to(tl.int32)
    tl.store(partial_loss_ptr + pid, tl.sum(loss_acc))
    tl.store(partial_pos_ptr + pid, tl.sum(pos_acc))


@triton.jit
def _focal_loss_finalize_kernel(
    partial_loss_ptr, partial_pos_ptr, loss_ptr, normalizer_ptr, num_partials, BLOCK_P: tl.constexpr
):
    offs = tl.arange(0, BLOCK_P)
    ok = offs < num_partials
    total = tl.sum(tl.load(partial_loss_ptr + offs, mask=ok, other=0.0))
    count = tl.sum(tl.load(partial_pos_ptr + offs, mask=ok, other=0))
    normalizer = tl.maximum(count, 1).to(tl.float32)
    tl.store(loss_ptr, total / normalizer)
    tl.store(normalizer_ptr, normalizer)


@triton.jit
def _focal_loss_bwd_kernel(
    grad_loss_ptr,  # [] any float
    normalizer_ptr,  # [] float32
    logits_ptr,
    target_ptr,
    grad_ptr,  # like logits
    n,
    alpha,
    BETA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    ok = offs < n
    scale = tl.load(grad_loss_ptr).to(tl.float32) / tl.load(normalizer_ptr)
    x = tl.load(logits_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    t = tl.load(target_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    sp_pos, sp_neg = _softplus_pair(x)
    p = tl.exp(-sp_neg)  # sigmoid(x)
    q = tl.exp(-sp_pos)  # 1 - sigmoid(x), without cancellation
    d_pos = -tl.exp(-alpha * sp_pos) * (q + alpha * p * sp_neg)
    d_neg = _pow_const(1.0 - t, BETA) * tl.exp(-alpha * sp_neg) * (p + alpha * q * sp_pos)
    grad = scale * tl.where(t == 1.0, d_pos, d_neg)
    tl.store(grad_ptr + offs, grad.to(grad_ptr.dtype.element_ty), mask=ok)


def focal_loss_fwd(logits: Tensor, target: Tensor, alpha: float, beta: float) -> tuple[Tensor, Tensor]:
    """Launch forward + finalize. Inputs already validated and contiguous."""
    n = logits.numel()
    device = logits.device
    programs = max(1, min(_MAX_PROGRAMS, triton.cdiv(n, _BLOCK)))
    iters = triton.cdiv(n, programs * _BLOCK)
    partial_loss = torch.empty(programs, dtype=torch.float32, device=device)  # [P]
    partial_pos = torch.empty(programs, dtype=torch.int32, device=device)  # [P]
    loss = torch.empty((), dtype=torch.float32, device=device)
    normalizer = torch.empty((), dtype=torch.float32, device=device)
    with on_device(device):
        _focal_loss_fwd_kernel[(programs,)](
            logits, target, partial_loss, partial_pos, n, iters, float(alpha), BETA=float(beta), BLOCK=_BLOCK
        )
        _focal_loss_finalize_kernel[(1,)](
            partial_loss, partial_pos, loss, normalizer, programs, BLOCK_P=triton.next_power_of_2(programs)
        )
    return loss, normalizer


def focal_loss_bwd(
    grad_loss: Tensor, logits: Tensor, target: Tensor, normalizer: Tensor, alpha: float, beta: float
) -> Tensor:
    """Launch the backward. grad_loss and normalizer are 0-d device tensors."""
    n = logits.numel()
    grad = torch.empty_like(logits)
    if n == 0:
        return grad
    with on_device(logits.device):
        _focal_loss_bwd_kernel[(triton.cdiv(n, _BLOCK),)](
            grad_loss, normalizer, logits, target, grad, n, float(alpha), BETA=float(beta), BLOCK=_BLOCK
        )
    return grad


# True when the kernels above were built by Triton's CPU interpreter (see kernels._dispatch).
INTERPRETED = type(_focal_loss_fwd_kernel).__name__ == "InterpretedFunction"
