"""Ground-truth boxes -> center-head training targets on the head grid.

In:  boxes [B, M, 7] (x, y, z, l, w, h, yaw) lidar frame, labels [B, M] int64 (-1: padding or a class
     not trained on), optional num_boxes [B]; `ModelParams` (range, head cell, Gaussian radius rule).
Out: `Targets`:
     heatmap [B, K, Ho, Wo] float32 — one CenterNet Gaussian per object (`kernels.render_heatmap`, peak 1
             at the object's cell (floor of its centre in cell units), combined by max);
     index   [B, M] int64 — flattened head cell `row * Wo + col` of each object (0 where masked);
     mask    [B, M] bool  — object is trained on (valid label, centre inside the head grid);
     reg     [B, M, R]    — regression targets at that cell (R = len(ModelParams.reg_channels)):
             0-1 offset of the centre inside its cell (x, y) in [0, 1), cells;
             2   z of the box centre, metres;
             3-5 log(l), log(w), log(h), metres;
             6-7 sin(yaw), cos(yaw);
             8-9 sin(2 yaw), cos(2 yaw): the box axis, the same for yaw and yaw + pi
                 (`model.heading: axis_sign` only; the decoder's front/back is the sign of 6-7 on it).
The decoder (`pfactory.archs.painted_pillars.decode`) inverts exactly this encoding; tests round-trip it.
Static shapes throughout (masked objects are sent to the heatmap kernel's trash plane with label -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import kernels
from pfactory.archs.painted_pillars.params import ModelParams

_MIN_SIZE_M = 1e-3  # log(size) of a degenerate box stays finite


@dataclass
class Targets:
    """Center-head targets of a batch (module docstring)."""

    heatmap: Tensor  # [B, K, Ho, Wo]
    index: Tensor  # [B, M] int64
    mask: Tensor  # [B, M] bool
    reg: Tensor  # [B, M, R]

    @property
    def num_objects(self) -> Tensor:
        """[] int64: objects with a regression target (the L1 normalizer)."""
        return self.mask.sum()

    @property
    def num_peaks(self) -> Tensor:
        """[] int64: heatmap cells equal to 1 (the focal-loss normalizer of `kernels.focal_loss`)."""
        return (self.heatmap == 1).sum()


def gaussian_radius(length_cells: Tensor, width_cells: Tensor, min_overlap: float) -> Tensor:
    """CenterNet/CenterPoint Gaussian radius (cells) so a box shifted by it keeps IoU >= min_overlap.

    The smallest root of the three corner-shift cases of CornerNet's `gaussian_radius`
    (CenterPoint `det3d/core/utils/center_utils.py`), vectorized. [M] -> [M] float.
    """
    h, w, o = length_cells, width_cells, min_overlap
    b1 = h + w
    c1 = w * h * (1 - o) / (1 + o)
    r1 = (b1 + torch.sqrt((b1 * b1 - 4 * c1).clamp(min=0))) / 2
    b2 = 2 * (h + w)
    c2 = (1 - o) * w * h
    r2 = (b2 + torch.sqrt((b2 * b2 - 16 * c2).clamp(min=0))) / 2
    a3 = 4 * o
    b3 = -2 * o * (h + w)
    c3 = (o - 1) * w * h
    r3 = (b3 + torch.sqrt((b3 * b3 - 4 * a3 * c3).clamp(min=0))) / 2
    return torch.minimum(torch.minimum(r1, r2), r3)


def build_targets(boxes: Tensor, labels: Tensor, p: ModelParams, num_boxes: Tensor | None = None) -> Targets:
    """Targets for boxes [B, M, 7] with labels [B, M] (module docstring)."""
    b, m, _ = boxes.shape
    h, w = p.head_grid
    k = len(p.classes)
    s = p.head_cell_m
    boxes = boxes.float()
    valid = (labels >= 0) & (labels < k)  # [B, M]
    if num_boxes is not None:
        valid &= torch.arange(m, device=boxes.device)[None, :] < num_boxes[:, None]  # [B, M]
    cx = (boxes[..., 0] - p.pc_range[0]) / s  # [B, M] continuous column
    cy = (boxes[..., 1] - p.pc_range[1]) / s  # [B, M] continuous row
    col, row = torch.floor(cx), torch.floor(cy)  # [B, M]
    valid &= (col >= 0) & (col < w) & (row >= 0) & (row < h)  # [B, M] centre inside the head grid
    valid &= torch.isfinite(boxes).all(-1)  # [B, M]

    size = boxes[..., 3:6].clamp(min=_MIN_SIZE_M)  # [B, M, 3]
    radius = gaussian_radius(size[..., 0] / s, size[..., 1] / s, p.gaussian_overlap)  # [B, M] cells
    radius = radius.floor().clamp(min=p.min_radius).long()  # [B, M], CenterPoint: max(min_radius, int(r))
    centers = torch.stack([cx, cy], dim=-1).where(valid[..., None], 0.0)  # [B, M, 2]
    batch = torch.arange(b, device=boxes.device)[:, None].expand(b, m)  # [B, M]
    heatmap = kernels.render_heatmap(
        centers.reshape(b * m, 2),
        radius.where(valid, 0).reshape(b * m),
        labels.long().where(valid, -1).reshape(b * m),  # -1: the kernel's trash plane, nothing drawn
        batch.reshape(b * m).contiguous(),
        b,
        k,
        h,
        w,
        check_indices=False,
    )  # [B, K, Ho, Wo]

    index = (row * w + col).long().where(valid, 0)  # [B, M]
    yaw = boxes[..., 6]  # [B, M]
    channels = [
        cx - col,
        cy - row,
        boxes[..., 2],
        size[..., 0].log(),
        size[..., 1].log(),
        size[..., 2].log(),
        torch.sin(yaw),
        torch.cos(yaw),
    ]
    if p.heading == "axis_sign":
        channels += [torch.sin(2 * yaw), torch.cos(2 * yaw)]
    reg = torch.stack(channels, dim=-1).where(valid[..., None], 0.0)  # [B, M, R]
    return Targets(heatmap=heatmap, index=index, mask=valid, reg=reg)
