"""Triton kernels for `pfk::pillar_scatter_max` (imported lazily: this module imports triton).

    pillar_scatter_max_fwd(features [N, C], cell_index [N] int64, num_cells, with_winner)
        -> canvas [num_cells, C], winner_cell [N] int64, winner_point [N, C] int32, winner_rows [1] int64
           (the winner table of kernels.pillar_scatter._pillar_scatter_max_op; [0] / [0, C] without winner)
    pillar_scatter_max_bwd(grad_canvas [num_cells, C], winner_cell, winner_point, winner_rows)
        -> grad_features [N, C]

Algorithm (deterministic, no float atomics; docs/KERNELS.md, "pillar_scatter_max"):
1. `_pillar_scatter_max_count_kernel`: counts[cell + 1] += 1 per kept point (int32 atomics, 1 per point).
2. offsets = cumsum(counts): a CSR row pointer, offsets[cell] .. offsets[cell + 1] are cell's slots;
   rank = cumsum(counts > 0) - 1: the compact winner-table row of each occupied cell (no host sync).
3. `_pillar_scatter_max_place_kernel`: perm[offsets[cell] + k] = n (slot k from an atomic cursor; the
   order inside a cell varies run to run, the results below do not).
4. `_pillar_scatter_max_fwd_kernel`: one program per BLOCK_R cells x BLOCK_C channels walks its cells'
   points, keeps the running max and the argmax with the explicit tie-break "lowest point index"
   (order-independent, hence deterministic), writes every canvas element exactly once (0 for empty
   cells: no separate memset) and, for an occupied cell, writes its winner-table row:
   winner_point[rank[cell], c] = argmax, winner_cell[rank[cell]] = cell.
5. `_pillar_scatter_max_bwd_kernel`: one program per BLOCK_R table rows x BLOCK_C channels:
   grad_features[winner_point[m, c], c] = grad_canvas[winner_cell[m], c] for rows m < M, into zeros.
   A (point, channel) wins at most one cell, so every target is written at most once: no atomics.

Bytes moved by the forward ~= features N*C*s (read once) + canvas num_cells*C*s (written once) +
winner table M*C*4 (written) + small index traffic; there is no [num_cells, C] intermediate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._device import on_device

# Tuning constants: chosen from the layout, not yet measured on a GPU (docs/KERNELS.md, "Tuning").
# 1024 elements per program = 8 fp32 per thread at 4 warps; a 64-channel row is one 256 B segment.
_TILE_ELEMENTS = 1024
_MAX_BLOCK_C = 128  # wider feature rows are split over grid axis 1
_POINT_BLOCK = 1024  # points per program in the count / place kernels


@triton.jit
def _pillar_scatter_max_count_kernel(cell_ptr, counts_ptr, n_points, num_cells, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] point ids
    in_bounds = offs < n_points
    cell = tl.load(cell_ptr + offs, mask=in_bounds, other=-1)  # [BLOCK] int64
    kept = in_bounds & (cell >= 0) & (cell < num_cells)
    # counts[cell + 1] so that an inclusive cumsum gives offsets with offsets[0] == 0.
    tl.atomic_add(counts_ptr + cell + 1, 1, mask=kept)


@triton.jit
def _pillar_scatter_max_place_kernel(
    cell_ptr, cursor_ptr, perm_ptr, n_points, num_cells, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] point ids
    in_bounds = offs < n_points
    cell = tl.load(cell_ptr + offs, mask=in_bounds, other=-1)  # [BLOCK]
    kept = in_bounds & (cell >= 0) & (cell < num_cells)
    slot = tl.atomic_add(cursor_ptr + cell, 1, mask=kept)  # [BLOCK] old cursor = this point's slot
    tl.store(perm_ptr + slot, offs, mask=kept)


@triton.jit
def _pillar_scatter_max_fwd_kernel(
    features_ptr,  # [N, C] contiguous
    perm_ptr,  # [N] int32, points grouped by cell
    offsets_ptr,  # [num_cells + 1] int32
    canvas_ptr,  # [num_cells, C] contiguous, written fully
    rank_ptr,  # [num_cells] int32: winner-table row of each occupied cell
    winner_cell_ptr,  # [N] int64, -1 filled; rows < M are written
    winner_point_ptr,  # [N, C] int32, -1 filled; rows < M are written
    num_cells,
    n_points,
    C,
    ACC_DTYPE: tl.constexpr,  # float32, or float64 for float64 features: conversions to it are exact
    WITH_WINNER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R] cell ids
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [Cb] channels
    row_ok = rows < num_cells
    col_ok = cols < C
    start = tl.load(offsets_ptr + rows, mask=row_ok, other=0)  # [R]
    length = tl.load(offsets_ptr + rows + 1, mask=row_ok, other=0) - start  # [R] points in each cell

    best = tl.full([BLOCK_R, BLOCK_C], float("-inf"), ACC_DTYPE)  # [R, Cb]
    arg = tl.full([BLOCK_R, BLOCK_C], 2147483647, tl.int32)  # [R, Cb] int32 max = "none yet"
    # Most BEV cells are empty, so most programs skip this loop and only store zeros. The loop is
    # latency-bound (perm -> features is a dependent gather), so the next perm entry is loaded while
    # the current feature rows are in flight.
    point = tl.load(perm_ptr + start, mask=length > 0, other=0)  # [R] int32, first point of each cell
    for j in range(0, tl.max(length)):
        active = j < length  # [R]
        ptrs = features_ptr + point.to(tl.int64)[:, None] * C + cols[None, :]  # [R, Cb]
        value = tl.load(ptrs, mask=active[:, None] & col_ok[None, :], other=float("-inf")).to(ACC_DTYPE)
        point_next = tl.load(perm_ptr + start + j + 1, mask=j + 1 < length, other=0)  # [R] prefetch
        # Strictly greater, or equal with a lower point index: the result does not depend on the order
        # in which points arrive (step 3 placed them in a run-dependent order). NaN counts as the
        # largest value, as in torch's amax, so a NaN propagates to the canvas.
        value_nan = value != value
        best_nan = best != best
        greater = (value > best) | (value_nan & ~best_nan)
        same = (value == best) | (value_nan & best_nan)
        take = active[:, None] & (greater | (same & (point[:, None] < arg)))
        best = tl.where(take, value, best)
        arg = tl.where(take, point[:, None], arg)
        point = point_next

    occupied = (length > 0)[:, None]  # [R, 1]
    out = tl.where(occupied, best, 0.0).to(canvas_ptr.dtype.element_ty)  # [R, Cb]
    store_ok = row_ok[:, None] & col_ok[None, :]
    tl.store(canvas_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], out, mask=store_ok)
    if WITH_WINNER:
        row_occ = row_ok & (length > 0)  # [R]
        table_row = tl.load(rank_ptr + rows, mask=row_occ, other=0).to(tl.int64)  # [R]
        has_arg = store_ok & occupied & (arg < n_points)  # every occupied cell has one; guard anyway
        tl.store(winner_point_ptr + table_row[:, None] * C + cols[None, :], arg, mask=has_arg)
        if tl.program_id(1) == 0:
            tl.store(winner_cell_ptr + table_row, rows.to(tl.int64), mask=row_occ)


@triton.jit
def _pillar_scatter_max_bwd_kernel(
    grad_canvas_ptr,  # [num_cells, C], any strides
    stride_gc_row,
    stride_gc_col,
    winner_cell_ptr,  # [N] int64
    winner_point_ptr,  # [N, C] int32
    winner_rows_ptr,  # [1] int64: M, read on the device (no host sync)
    grad_features_ptr,  # [N, C] contiguous, zero-filled
    n_rows,
    C,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R] winner-table rows
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [Cb]
    m = tl.load(winner_rows_ptr)
    row_ok = (rows < n_rows) & (rows < m)
    cell = tl.load(winner_cell_ptr + rows, mask=row_ok, other=0)  # [R] int64
    elem_ok = row_ok[:, None] & (cols < C)[None, :]  # [R, Cb]
    point = tl.load(winner_point_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=elem_ok, other=-1)
    ok = elem_ok & (point >= 0)
    g_ptrs = grad_canvas_ptr + cell[:, None] * stride_gc_row + cols[None, :] * stride_gc_col
    grad = tl.load(g_ptrs, mask=ok, other=0.0)  # [R, Cb] only occupied cells' gradients are read
    tl.store(grad_features_ptr + point.to(tl.int64) * C + cols[None, :], grad, mask=ok)


def _tile(c: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) for C channels."""
    block_c = min(triton.next_power_of_2(max(c, 1)), _MAX_BLOCK_C)
    return max(1, _TILE_ELEMENTS // block_c), block_c


def pillar_scatter_max_fwd(
    features: Tensor, cell_index: Tensor, num_cells: int, with_winner: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launch steps 1-4 (module docstring). Inputs already validated and contiguous."""
    n, c = features.shape
    device = features.device
    rows = n if with_winner else 0
    canvas = torch.empty(num_cells, c, dtype=features.dtype, device=device)  # [num_cells, C]
    winner_cell = torch.full((rows,), -1, dtype=torch.int64, device=device)  # [N]
    winner_point = torch.full((rows, c), -1, dtype=torch.int32, device=device)  # [N, C]
    winner_rows = torch.zeros(1, dtype=torch.int64, device=device)  # [1] M
    if num_cells == 0 or c == 0:
        return canvas, winner_cell, winner_point, winner_rows
    with on_device(device):
        counts = torch.zeros(num_cells + 1, dtype=torch.int32, device=device)  # [cells+1]
        perm = torch.empty(max(n, 1), dtype=torch.int32, device=device)  # [N]
        point_grid = (triton.cdiv(n, _POINT_BLOCK),)
        if n > 0:
            _pillar_scatter_max_count_kernel[point_grid](cell_index, counts, n, num_cells, BLOCK=_POINT_BLOCK)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [cells+1] CSR row pointer
        occupied = counts[1:] > 0  # [cells]
        rank = torch.cumsum(occupied, 0, dtype=torch.int32) - 1  # [cells] winner-table row
        if with_winner:
            winner_rows = occupied.sum(0, keepdim=True, dtype=torch.int64)  # [1], stays on the device
        if n > 0:
            cursor = offsets.clone()  # [cells+1]
            _pillar_scatter_max_place_kernel[point_grid](
                cell_index, cursor, perm, n, num_cells, BLOCK=_POINT_BLOCK
            )
        block_r, block_c = _tile(c)
        grid = (triton.cdiv(num_cells, block_r), triton.cdiv(c, block_c))
        _pillar_scatter_max_fwd_kernel[grid](
            features,
            perm,
            offsets,
            canvas,
            rank,
            winner_cell,
            winner_point,
            num_cells,
            n,
            c,
            ACC_DTYPE=tl.float64 if features.dtype == torch.float64 else tl.float32,
            WITH_WINNER=with_winner,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
        )
    return canvas, winner_cell, winner_point, winner_rows


def pillar_scatter_max_bwd(
    grad_canvas: Tensor, winner_cell: Tensor, winner_point: Tensor, winner_rows: Tensor
) -> Tensor:
    """Launch step 5. grad_canvas may be strided (e.g. the transpose of a [B, C, H, W] gradient)."""
    n, c = winner_point.shape
    grad_features = torch.zeros(n, c, dtype=grad_canvas.dtype, device=grad_canvas.device)  # [N, C]
    if n == 0 or c == 0 or grad_canvas.shape[0] == 0:
        return grad_features
    block_r, block_c = _tile(c)
    grid = (triton.cdiv(n, block_r), triton.cdiv(c, block_c))
    with on_device(grad_canvas.device):
        _pillar_scatter_max_bwd_kernel[grid](
            grad_canvas,
            grad_canvas.stride(0),
            grad_canvas.stride(1),
            winner_cell,
            winner_point,
            winner_rows,
            grad_features,
            n,
            c,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
        )
    return grad_features


# True when the kernels above were built by Triton's CPU interpreter (see kernels._dispatch).
INTERPRETED = type(_pillar_scatter_max_fwd_kernel).__name__ == "InterpretedFunction"
