"""Head outputs -> detections: sigmoid, max-pool peaks, top-K over classes x cells, the peak's own head.

In:  heatmap [B, K, Ho, Wo] logits (head order: channel j is class `Geometry.order[j]`), reg [B, G, R, Ho,
     Wo] (`CenterPointLidarParams.reg_channels`), the `Geometry` (head grid: row along y, column along x).
Out: boxes [B, D, 7] (x, y, z, l, w, h, yaw) lidar frame, z at the box centre, yaw in (-pi, pi]; scores
     [B, D] in [0, 1] descending; labels [B, D] int64 (class index); the heading bins' logits [B, n, D] (the
     refiner weighs its turns with them). D = `max_detections`, capped at K*Ho*Wo.
     A cell that is not a local maximum has score 0 (padding: fewer peaks than D).

Plain tensor ops with static shapes (max_pool2d, topk, gather, argmax, atan2): it exports inside the graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pfactory.archs.centerpoint_lidar.params import Geometry
from pfactory.archs.centerpoint_lidar.targets import decode_heading

_MAX_LOG_SIZE = 5.0  # exp(5) = 148 m: an untrained head must not emit inf


def decode(
    heatmap: Tensor, reg: Tensor, geo: Geometry, nms_kernel: int, k: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(boxes [B, D, 7], scores [B, D], labels [B, D], bin logits [B, n, D])` (module docstring)."""
    b, num_ch, h, w = heatmap.shape
    g, r = reg.shape[1:3]
    n = (r - 6) // 3  # heading bins
    d = min(k, num_ch * h * w)
    heat = heatmap.float().sigmoid()  # [B, K, Ho, Wo]
    if nms_kernel > 1:
        peak = F.max_pool2d(heat, nms_kernel, stride=1, padding=nms_kernel // 2)
        heat = heat * (peak == heat).to(heat.dtype)  # non-peaks -> 0
    scores, flat = heat.reshape(b, -1).topk(d, dim=1)  # [B, D] sorted descending
    hw = h * w
    channel = torch.div(flat, hw, rounding_mode="floor")  # [B, D]
    cell = flat - channel * hw  # [B, D] row * Wo + col
    row = torch.div(cell, w, rounding_mode="floor")
    col = cell - row * w
    order = torch.tensor(geo.order, device=heatmap.device)  # [K] class of each channel
    group_of_channel = torch.tensor(
        [gi for gi, grp in enumerate(geo.groups) for _ in grp], device=heatmap.device
    )
    labels = order[channel]  # [B, D]
    group = group_of_channel[channel]  # [B, D]
    at_cell = reg.float().reshape(b, g * r, hw).gather(2, cell[:, None, :].expand(b, g * r, d))  # [B, G*R, D]
    own = at_cell.reshape(b, g, r, d).gather(1, group[:, None, None, :].expand(b, 1, r, d))[:, 0]  # [B, R, D]
    s = float(geo.head_cell_m)
    x = float(geo.pc_range[0]) + (col.to(own.dtype) + own[:, 0]) * s  # [B, D] metres
    y = float(geo.pc_range[1]) + (row.to(own.dtype) + own[:, 1]) * s
    z = own[:, 2]
    lwh = own[:, 3:6].clamp(max=_MAX_LOG_SIZE).exp()  # [B, 3, D]
    yaw = decode_heading(own[:, 6 : 6 + n], own[:, 6 + n :].reshape(b, n, 2, d))  # [B, D]
    boxes = torch.stack([x, y, z, lwh[:, 0], lwh[:, 1], lwh[:, 2], yaw], dim=-1)  # [B, D, 7]
    return boxes, scores, labels, own[:, 6 : 6 + n]
