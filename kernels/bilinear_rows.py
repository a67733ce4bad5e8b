"""Bilinear row gather: out[s] = sum_k weight[s, k] * table[index[s, k]], the camera painting's sampler.

    bilinear_rows(table [R, C], index [S, 4], weight [S, 4], dest=None, total=0) -> [S or total, C]
    bilinear_rows_reference(...)                    the spec: plain PyTorch ops, autograd by PyTorch

The op `pfk::bilinear_rows` (+ `pfk::bilinear_rows_backward`, its gradient w.r.t. the table, itself an
op) runs four row gathers forward and four row `index_add_`s backward, in sample order (deterministic
on CPU), on the samples with a non-zero weight only: a caller may pass every sample with zero weights
where a camera does not see a point (no data-dependent shape, what torch.compile traces) and pay for
the seen ones (about 37% of the default data's points). As a custom op it is opaque to Dynamo and
Inductor: traced as tensor ops, Inductor lowered the backward to per-lane atomic adds over every
sample (17.7 of a 130 ms compiled training step; docs/MODEL.md, "Speed"); as an op it is the eager
kernels' 1-2 ms. The same values as the reference to float rounding: a skipped sample adds 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels._checks import describe, require, require_tensor

_OP = "bilinear_rows"


# --------------------------------------------------------------------------------------------------
# reference (the spec)
# --------------------------------------------------------------------------------------------------
def bilinear_rows_reference(
    table: Tensor, index: Tensor, weight: Tensor, dest: Tensor | None = None, total: int = 0
) -> Tensor:
    """sum_k weight[:, k:k+1] * table.float()[index[:, k]] -> [S, C] float32, or scattered to rows `dest`
    of a zero [total, C] (the other rows 0). table [R, C] float, index [S, 4] int64, weight [S, 4] float32,
    dest [S] int64 distinct rows or None. Differentiable w.r.t. `table` (PyTorch's autograd)."""
    out = sum(weight[:, k : k + 1] * table.float()[index[:, k]] for k in range(4))  # [S, C]
    if dest is None:
        return out
    return out.new_zeros(total, out.shape[1]).index_copy(0, dest, out)


# --------------------------------------------------------------------------------------------------
# the op's implementation: PyTorch row ops on the live samples
# --------------------------------------------------------------------------------------------------
def _live(weight: Tensor) -> Tensor | None:
    """The samples [L] with a non-zero weight, or None when every sample has one (nothing to skip)."""
    live = weight.ne(0).any(1)  # [S]
    if bool(live.all()):
        return None
    return live.nonzero().squeeze(1)


def _gather(rows: Tensor, index: Tensor, weight: Tensor) -> Tensor:
    """rows [R, C] float32, index [L, 4], weight [L, 4] -> [L, C]."""
    out = rows.index_select(0, index[:, 0]).mul_(weight[:, 0:1])  # [L, C]
    for k in range(1, 4):
        out.addcmul_(rows.index_select(0, index[:, k]), weight[:, k : k + 1])
    return out


@torch.library.custom_op("pfk::bilinear_rows", mutates_args=())
def _bilinear_rows_op(
    table: Tensor, index: Tensor, weight: Tensor, dest: Tensor | None, total: int
) -> Tensor:
    """[S, C] float32 (dest None) or [total, C] float32 (row dest[s] = sample s, other rows 0)."""
    rows = table.float() if table.dtype != torch.float32 else table  # [R, C]
    if dest is None:
        live = _live(weight)
        if live is None:
            return _gather(rows, index, weight)
        dest, index, weight, total = live, index[live], weight[live], index.shape[0]
    out = _gather(rows, index, weight)  # [L, C]
    return out.new_zeros(total, out.shape[1]).index_copy_(0, dest, out)


@_bilinear_rows_op.register_fake
def _(table: Tensor, index: Tensor, weight: Tensor, dest: Tensor | None, total: int) -> Tensor:
    rows = index.shape[0] if dest is None else total
    return table.new_empty((rows, table.shape[1]), dtype=torch.float32)


@torch.library.custom_op("pfk::bilinear_rows_backward", mutates_args=())
def _bilinear_rows_backward_op(
    grad: Tensor, index: Tensor, weight: Tensor, dest: Tensor | None, table_rows: int
) -> Tensor:
    """grad [S or total, C] -> grad_table [table_rows, C] float32: four row `index_add_`s in sample order."""
    grad = grad.float()
    if dest is None:
        live = _live(weight)
        if live is not None:
            dest, index, weight = live, index[live], weight[live]
    grad = grad.index_select(0, dest) if dest is not None else grad.contiguous()  # [L, C]
    grad_table = grad.new_zeros(table_rows, grad.shape[1])  # [R, C]
    term = torch.empty_like(grad)  # [L, C], reused by the four corners
    for k in range(4):
        grad_table.index_add_(0, index[:, k], torch.mul(grad, weight[:, k : k + 1], out=term))
    return grad_table


@_bilinear_rows_backward_op.register_fake
def _(grad: Tensor, index: Tensor, weight: Tensor, dest: Tensor | None, table_rows: int) -> Tensor:
    return grad.new_empty((table_rows, grad.shape[1]), dtype=torch.float32)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor) -> None:
    table, index, weight, dest, _total = inputs
    ctx.save_for_backward(index, weight, dest)
    ctx.table_rows, ctx.table_dtype = table.shape[0], table.dtype


def _backward(
    ctx: torch.autograd.function.FunctionCtx, grad: Tensor
) -> tuple[Tensor, None, None, None, None]:
    index, weight, dest = ctx.saved_tensors
    grad_table = _bilinear_rows_backward_op(grad, index, weight, dest, ctx.table_rows)
    return grad_table.to(ctx.table_dtype), None, None, None, None


_bilinear_rows_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------------
def bilinear_rows(
    table: Tensor, index: Tensor, weight: Tensor, dest: Tensor | None = None, total: int = 0
) -> Tensor:
    """Four weighted row gathers per sample: out[s] = sum_k weight[s, k] * table[index[s, k]].

    table [R, C] float (gathered in float32), index [S, 4] int64 rows of the table, weight [S, 4] float32,
    optionally dest [S] int64 (distinct rows of a [total, C] output the samples go to; the other rows are
    0) -> [S, C] or [total, C] float32. Differentiable w.r.t. `table` only (its gradient in the table's
    dtype); a sample whose four weights are 0 costs nothing either way."""
    require_tensor(table, _OP, "table", dtypes=(torch.float32, torch.bfloat16), ndim=2)
    require_tensor(index, _OP, "index", dtypes=(torch.int64,), ndim=2)
    require_tensor(weight, _OP, "weight", dtypes=(torch.float32,), ndim=2)
    s = index.shape[0]
    require(
        index.shape[1] == 4 and tuple(weight.shape) == (s, 4),
        _OP,
        lambda: f"index and weight must both be [S, 4], got {describe(index)} and {describe(weight)}",
    )
    if dest is not None:
        require_tensor(dest, _OP, "dest", dtypes=(torch.int64,), ndim=1)
        require(dest.shape[0] == s, _OP, lambda: f"dest must be [S] with S = {s}, got {describe(dest)}")
    return _bilinear_rows_op(table, index.contiguous(), weight.contiguous(), dest, total)
