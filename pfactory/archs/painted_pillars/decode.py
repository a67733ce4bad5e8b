"""Head outputs -> boxes: sigmoid, max-pool peak extraction, top-K over classes x cells, gather.

In:  heatmap [B, K, Ho, Wo] logits, reg [B, R, Ho, Wo] (channels as `pfactory.archs.painted_pillars.targets`), the
     `ModelParams` that fix the head grid (row along y, column along x, cell = head_cell_m metres).
Out: boxes [B, D, 7] (x, y, z, l, w, h, yaw) lidar frame, scores [B, D] in (0, 1), labels [B, D] int64,
     D = `max_detections`, sorted by descending score. No thresholding: consumers drop low scores.

Plain tensor ops with static shapes (max_pool2d, topk, gather, atan2), so the decoder exports to ONNX
inside the model graph; `max_pool == value` keeps a cell only when it is a local maximum (CenterNet's
NMS replacement), so no box-level NMS is needed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from pfactory.archs.painted_pillars.params import ModelParams

# exp() of a log-size above this (e^5 = 148 m) is clamped: an untrained head must not emit inf.
_MAX_LOG_SIZE = 5.0


def decode(
    heatmap: Tensor, reg: Tensor, p: ModelParams, k: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """`(boxes [B, D, 7], scores [B, D], labels [B, D])` from the head outputs (module docstring)."""
    b, num_classes, h, w = heatmap.shape
    d = min(k or p.max_detections, num_classes * h * w)
    heat = heatmap.float().sigmoid()  # [B, K, Ho, Wo]
    if p.nms_kernel > 1:
        peak = F.max_pool2d(heat, p.nms_kernel, stride=1, padding=p.nms_kernel // 2)  # [B, K, Ho, Wo]
        heat = heat * (peak == heat).to(heat.dtype)  # [B, K, Ho, Wo], non-peaks -> 0
    scores, flat = heat.reshape(b, -1).topk(d, dim=1)  # [B, D] each, sorted descending
    hw = h * w
    labels = torch.div(flat, hw, rounding_mode="floor")  # [B, D] class index
    cell = flat - labels * hw  # [B, D] flattened row * Wo + col
    row = torch.div(cell, w, rounding_mode="floor")  # [B, D]
    col = cell - row * w  # [B, D]
    r = (
        reg.float().reshape(b, reg.shape[1], hw).gather(2, cell[:, None, :].expand(b, reg.shape[1], d))
    )  # [B, R, D]
    x0, y0 = float(p.pc_range[0]), float(p.pc_range[1])
    s = float(p.head_cell_m)
    x = x0 + (col.to(r.dtype) + r[:, 0]) * s  # [B, D] metres
    y = y0 + (row.to(r.dtype) + r[:, 1]) * s  # [B, D]
    z = r[:, 2]  # [B, D]
    lwh = r[:, 3:6].clamp(max=_MAX_LOG_SIZE).exp()  # [B, 3, D]
    yaw = decode_yaw(r[:, 6:], p.heading)  # [B, D]
    boxes = torch.stack([x, y, z, lwh[:, 0], lwh[:, 1], lwh[:, 2], yaw], dim=-1)  # [B, D, 7]
    return boxes, scores, labels


def decode_yaw(code: Tensor, heading: str) -> Tensor:
    """Yaw [..., D] in (-pi, pi] from the heading channels [..., 2 or 4, D] (`pfactory.archs.painted_pillars.targets`).

    `sincos`: atan2(sin, cos). `axis_sign`: the axis phi = atan2(sin 2y, cos 2y) / 2 in (-pi/2, pi/2] from
    the (sin 2y, cos 2y) pair, then yaw = phi or phi + pi, whichever the (sin y, cos y) pair points to
    (the sign of its projection on the axis). Both pairs are continuous in yaw, so neither target has a
    wrap-around jump; an unsure front/back flips the box by pi but never tilts its axis.
    """
    s1, c1 = code[..., 0, :], code[..., 1, :]
    if heading == "sincos":
        return torch.atan2(s1, c1)
    phi = 0.5 * torch.atan2(code[..., 2, :], code[..., 3, :])  # [..., D] in (-pi/2, pi/2]
    backward = (torch.sin(phi) * s1 + torch.cos(phi) * c1) < 0  # [..., D]
    yaw = phi + backward.to(phi.dtype) * math.pi  # [..., D] in (-pi/2, 3pi/2]
    return torch.where(yaw > math.pi, yaw - 2 * math.pi, yaw)
