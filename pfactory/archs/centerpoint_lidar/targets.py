"""Ground-truth boxes -> the training targets of the class-group heads, and the direction-bin heading code.

In:  boxes [B, M, 7] (x, y, z, l, w, h, yaw) lidar frame (x forward, y left, z up, metres, z at the box
     centre, yaw about +z), labels [B, M] int64 (-1: padding or an untrained class), num_boxes [B] or None.
Out: `Targets`:
     heatmap [B, K, Ho, Wo] float32, one Gaussian per object (`kernels.render_heatmap`), channels in head
             order (`Geometry.order`: channel j is class order[j]);
     index   [B, M] int64, flattened head cell `row * Wo + col` (0 where masked);
     group   [B, M] int64, the head of the object's class (0 where masked);
     mask    [B, M] bool, trained on (valid label, centre inside the head grid, finite);
     box     [B, M, 6]: offset of the centre in its cell (x, y) in [0, 1) cells, z (m), log l, w, h (m);
     bin     [B, M] int64, the direction bin of the yaw (`encode_heading`);
     res     [B, M, 2]: sin, cos of the yaw's residual to that bin's centre.

Heading: n bins of width 2 pi / n centred at c_k = k * 2 pi / n (k = 0..n-1). A yaw's bin is the nearest
centre, its residual r = yaw - c_k wrapped to [-pi/n, pi/n]; `decode_heading` inverts it exactly
(yaw = c_k + atan2(sin r, cos r), wrapped to (-pi, pi]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

import kernels
from pfactory.archs.centerpoint_lidar.params import CenterPointLidarParams, Geometry
from pfactory.archs.painted_pillars.targets import gaussian_radius

_MIN_SIZE_M = 1e-3  # log(size) of a degenerate box stays finite


def wrap_angle(a: Tensor) -> Tensor:
    """Angles [...] wrapped to (-pi, pi] (plain ops: atan2-free, so exact for values already inside)."""
    a = torch.where(a > math.pi, a - 2 * math.pi, a)
    return torch.where(a <= -math.pi, a + 2 * math.pi, a)


def bin_centres(n: int, like: Tensor) -> Tensor:
    """[n] centres k * 2 pi / n of the direction bins, wrapped to (-pi, pi], dtype/device of `like`."""
    return wrap_angle(torch.arange(n, dtype=like.dtype, device=like.device) * (2 * math.pi / n))


def encode_heading(yaw: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """yaw [...] rad -> (bin [...] int64 in [0, n), residual [..., 2] = (sin r, cos r)), r = yaw - centre."""
    width = 2 * math.pi / n
    k = torch.round(yaw / width).long().remainder(n)  # [...] nearest centre (any yaw, not only (-pi, pi])
    r = yaw - bin_centres(n, yaw)[k]  # [...] the residual up to 2 pi
    return k, torch.stack([torch.sin(r), torch.cos(r)], dim=-1)


def decode_heading(bin_logits: Tensor, residuals: Tensor) -> Tensor:
    """bin_logits [..., n, D], residuals [..., n, 2, D] (sin, cos per bin) -> yaw [..., D] in (-pi, pi]: the
    most likely bin's centre plus its own residual."""
    n = bin_logits.shape[-2]
    k = bin_logits.argmax(dim=-2, keepdim=True)  # [..., 1, D]
    pair = residuals.gather(-3, k[..., None, :].expand(*k.shape[:-1], 2, k.shape[-1]))  # [..., 1, 2, D]
    r = torch.atan2(pair[..., 0, 0, :], pair[..., 0, 1, :])  # [..., D]
    centre = bin_centres(n, r)[k[..., 0, :]]  # [..., D]
    return wrap_angle(centre + r)


@dataclass
class Targets:
    """Targets of a batch (module docstring)."""

    heatmap: Tensor  # [B, K, Ho, Wo]
    index: Tensor  # [B, M] int64
    group: Tensor  # [B, M] int64
    mask: Tensor  # [B, M] bool
    box: Tensor  # [B, M, 6]
    bin: Tensor  # [B, M] int64
    res: Tensor  # [B, M, 2]

    @property
    def num_objects(self) -> Tensor:
        """[] int64: objects with a regression target (the regression normalizer)."""
        return self.mask.sum()

    @property
    def num_peaks(self) -> Tensor:
        """[] int64: heatmap cells equal to 1 (the focal-loss normalizer of `kernels.focal_loss`)."""
        return (self.heatmap == 1).sum()


def build_targets(
    boxes: Tensor, labels: Tensor, p: CenterPointLidarParams, geo: Geometry, num_boxes: Tensor | None = None
) -> Targets:
    """Targets for boxes [B, M, 7] with labels [B, M] (module docstring). Static shapes."""
    b, m, _ = boxes.shape
    h, w = geo.head_grid
    k = len(geo.classes)
    s = geo.head_cell_m
    boxes = boxes.float()
    labels = labels.long()
    valid = (labels >= 0) & (labels < k)  # [B, M]
    if num_boxes is not None:
        valid &= torch.arange(m, device=boxes.device)[None, :] < num_boxes[:, None]
    cx = (boxes[..., 0] - geo.pc_range[0]) / s  # [B, M] continuous column
    cy = (boxes[..., 1] - geo.pc_range[1]) / s  # [B, M] continuous row
    col, row = torch.floor(cx), torch.floor(cy)
    valid &= (col >= 0) & (col < w) & (row >= 0) & (row < h) & torch.isfinite(boxes).all(-1)

    size = boxes[..., 3:6].clamp(min=_MIN_SIZE_M)  # [B, M, 3]
    radius = gaussian_radius(size[..., 0] / s, size[..., 1] / s, p.gaussian_overlap)  # [B, M] cells
    radius = radius.floor().clamp(min=p.min_radius).long()
    centers = torch.stack([cx, cy], dim=-1).where(valid[..., None], 0.0)  # [B, M, 2]
    batch = torch.arange(b, device=boxes.device)[:, None].expand(b, m)
    heat = kernels.render_heatmap(
        centers.reshape(b * m, 2), radius.where(valid, 0).reshape(b * m),
        labels.where(valid, -1).reshape(b * m), batch.reshape(b * m).contiguous(), b, k, h, w,
        check_indices=False,
    )  # fmt: skip  # [B, K, Ho, Wo] in class order
    order = list(geo.order)
    if order != list(range(k)):
        heat = heat[:, order]  # [B, K, Ho, Wo] in head order

    group_of = torch.tensor(geo.group_of_class, device=boxes.device)  # [K]
    group = group_of[labels.clamp(0, k - 1)].where(valid, 0)  # [B, M]
    index = (row * w + col).long().where(valid, 0)  # [B, M]
    box = torch.stack(
        [cx - col, cy - row, boxes[..., 2], size[..., 0].log(), size[..., 1].log(), size[..., 2].log()],
        dim=-1,
    ).where(valid[..., None], 0.0)  # [B, M, 6]
    yaw = boxes[..., 6].where(valid, 0.0)  # [B, M]
    bins, res = encode_heading(yaw, p.heading_bins)  # [B, M], [B, M, 2]
    return Targets(heat, index, group, valid, box, bins.where(valid, 0), res.where(valid[..., None], 0.0))
