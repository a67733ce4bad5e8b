"""Triton kernel for `pfk::render_heatmap` (imported lazily: this module imports triton).

    render_heatmap_fwd(centers [M, 2], radii [M], labels [M], batch_index [M], B, K, H, W)
        -> heatmap [B, K, H, W] float32

One program per (TILE_H x TILE_W tile, plane b*K + k). It reads the object table in vectors of
BLOCK_M objects and computes, per object, "is in my plane and its (2r+1)^2 window overlaps my tile";
a block with no such object costs those few vector loads and nothing else (tile-level culling). Then it
visits only the overlapping objects, lowest index first, evaluating one Gaussian over the tile and
keeping the running max in registers. Every output element is written exactly once: no memset, no
atomics, so the result is deterministic. Work is O(tiles x M / BLOCK_M) culling tests plus
O(sum over objects of tiles touched x tile area) exponentials, instead of the reference's O(M H W).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._device import on_device

# Tile and object-block sizes: chosen by reasoning, not yet measured on a GPU (docs/KERNELS.md,
# "Tuning"). 16 x 32 = 512 cells = 4 fp32 per thread at 4 warps; a CenterPoint radius (2-10 cells)
# then touches 1-4 tiles. 128 objects per culling vector.
_TILE_H = 16
_TILE_W = 32
_BLOCK_M = 128


@triton.jit
def _render_heatmap_fwd_kernel(
    centers_ptr,  # [M, 2] float32
    radii_ptr,  # [M] int64
    labels_ptr,  # [M] int64
    batch_ptr,  # [M] int64
    out_ptr,  # [B, K, H, W] float32
    M,
    K,
    H,
    W,
    tiles_w,
    TILE_H: tl.constexpr,
    TILE_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    tile = tl.program_id(0)
    plane = tl.program_id(1)  # b * K + k
    b = plane // K
    k = plane % K
    row0 = (tile // tiles_w) * TILE_H
    col0 = (tile % tiles_w) * TILE_W
    rows = row0 + tl.arange(0, TILE_H)[:, None]  # [TH, 1]
    cols = col0 + tl.arange(0, TILE_W)[None, :]  # [1, TW]
    rows_f = rows.to(tl.float32)
    cols_f = cols.to(tl.float32)
    # Tile bounds as floats: the window test below stays in float32, like the reference, so huge or
    # non-finite centres need no integer overflow handling (NaN fails every comparison).
    top = row0.to(tl.float32)
    bottom = top + (TILE_H - 1)
    left = col0.to(tl.float32)
    right = left + (TILE_W - 1)

    acc = tl.zeros([TILE_H, TILE_W], dtype=tl.float32)  # [TH, TW]
    for m0 in range(0, M, BLOCK_M):
        obj = m0 + tl.arange(0, BLOCK_M)  # [BM]
        obj_ok = obj < M
        label = tl.load(labels_ptr + obj, mask=obj_ok, other=-1)  # [BM]
        batch = tl.load(batch_ptr + obj, mask=obj_ok, other=-1)  # [BM]
        r = tl.load(radii_ptr + obj, mask=obj_ok, other=0).to(tl.float32)  # [BM]
        pc = tl.floor(tl.load(centers_ptr + 2 * obj, mask=obj_ok, other=0.0))  # [BM] peak column
        pr = tl.floor(tl.load(centers_ptr + 2 * obj + 1, mask=obj_ok, other=0.0))  # [BM] peak row
        hit = obj_ok & (label == k) & (batch == b)
        hit = hit & (pc + r >= left) & (pc - r <= right) & (pr + r >= top) & (pr - r <= bottom)  # [BM]
        n_hit = tl.sum(hit.to(tl.int32))
        while n_hit > 0:  # only the objects whose window overlaps this tile
            i = tl.min(tl.where(hit, obj, M))  # lowest overlapping object still to draw
            hit = hit & (obj != i)
            n_hit -= 1
            ri = tl.load(radii_ptr + i).to(tl.float32)
            dx = cols_f - tl.floor(tl.load(centers_ptr + 2 * i))  # [1, TW]
            dy = rows_f - tl.floor(tl.load(centers_ptr + 2 * i + 1))  # [TH, 1]
            sigma = (2 * ri + 1) / 6
            gauss = tl.exp(
                -(dx * dx + dy * dy) / (2 * sigma * sigma)
            )  # [TH, TW], same op order as the reference
            inside = (tl.abs(dx) <= ri) & (tl.abs(dy) <= ri)  # [TH, TW]
            acc = tl.maximum(acc, tl.where(inside, gauss, 0.0))

    out_ok = (rows < H) & (cols < W)  # [TH, TW]; tiles overhang the grid's right and bottom edges
    tl.store(out_ptr + (plane.to(tl.int64) * H + rows) * W + cols, acc, mask=out_ok)


def render_heatmap_fwd(
    centers: Tensor,
    radii: Tensor,
    labels: Tensor,
    batch_index: Tensor,
    batch_size: int,
    num_classes: int,
    height: int,
    width: int,
) -> Tensor:
    """Launch the kernel over (tiles, B*K planes). Inputs already validated and contiguous."""
    out = torch.empty(batch_size, num_classes, height, width, dtype=torch.float32, device=centers.device)
    tiles_w = triton.cdiv(width, _TILE_W)
    grid = (triton.cdiv(height, _TILE_H) * tiles_w, batch_size * num_classes)
    with on_device(centers.device):
        _render_heatmap_fwd_kernel[grid](
            centers.float(),
            radii,
            labels,
            batch_index,
            out,
            centers.shape[0],
            num_classes,
            height,
            width,
            tiles_w,
            TILE_H=_TILE_H,
            TILE_W=_TILE_W,
            BLOCK_M=_BLOCK_M,
        )
    return out


# True when the kernel above was built by Triton's CPU interpreter (see kernels._dispatch).
INTERPRETED = type(_render_heatmap_fwd_kernel).__name__ == "InterpretedFunction"
