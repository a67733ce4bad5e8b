"""The tiny BEV detector: points -> a hand-made BEV grid -> two-scale convs -> center head -> boxes.

In (a padded batch, lidar frame: x forward, y left, z up, metres; `pfactory.detectors.contract`):
    points     [B, P, 4] float32 (x, y, z, intensity in [0, 1]); rows >= num_points[b] are padding
    num_points [B]       int64
Out of `forward`: `{"heatmap": [B, K, H, W] logits, "reg": [B, 8, H, W]}` on the BEV grid (row along y,
column along x, cell = `cell_m`; K = len(spec.classes)). The 8 regression channels at an object's cell:
    0-1 offset of the box centre inside its cell (x, y), in [0, 1) cells
    2   z of the box centre, metres
    3-5 log(l), log(w), log(h), metres
    6-7 sin(yaw), cos(yaw)          (atan2 gives the heading back, continuous over +-pi)
Out of `forward_export` / `decode`: `(boxes [B, D, 7], scores [B, D], labels [B, D] int64)`, D = max_detections.

1. BEV grid (`bev_grid`, no weights): every valid point in range falls in one cell; per cell, log(1 + count),
   the max and mean of the normalized height, the max and mean of the intensity: [B, 5, H, W]. Two flat
   1-D `scatter_reduce` calls (sum, amax) over `cell * C + c`: ONNX ScatterElements(reduction=add|max),
   opset >= 18, run by ONNX Runtime. Padding and out-of-range points get features 0 and add nothing.
2. Backbone: two 3x3 convs at full resolution, a stride-2 stage, a transposed conv back, concat.
3. Head: a shared 3x3 conv, then a per-class heatmap (logits) and the 8 regression channels.
4. Loss (`loss`): CenterNet's penalty-reduced focal loss on Gaussian heatmaps + L1 on the regressions at
   the object cells, normalized by the global (DDP all-reduced) peak and object counts.
5. Decode: sigmoid, 3x3 max-pool peaks, top-K over classes x cells, gather: static shapes, exportable.
Every normalization is GroupNorm, so a sample's output is independent of its batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pfactory.detectors.contract import DataSpec, Detections, LossContext
from pfactory_tiny_detector.params import TinyBevParams

GRID_CHANNELS = 5  # log1p(count), max z, mean z, max intensity, mean intensity
REG_CHANNELS = 8  # offset x, y; z; log l, w, h; sin yaw, cos yaw
_HEATMAP_PRIOR = 0.1  # initial heatmap probability (CenterNet's bias -log((1 - p) / p))
_MAX_LOG_SIZE = 5.0  # exp() of a larger log-size (148 m) is clamped: an untrained head emits no inf
_MIN_SIZE_M = 1e-3  # log(size) of a degenerate box stays finite


def conv_gn_relu(c_in: int, c_out: int, groups: int, stride: int = 1) -> nn.Sequential:
    """3x3 conv (no bias) + GroupNorm + ReLU: [B, c_in, H, W] -> [B, c_out, H/stride, W/stride]."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.GroupNorm(groups, c_out),
        nn.ReLU(inplace=True),
    )


def bev_grid(
    points: Tensor, num_points: Tensor, pc_range: tuple[float, ...], cell_m: float, hw: tuple[int, int]
) -> Tensor:
    """The hand-made BEV input [B, 5, H, W] of padded points [B, P, 4] with num_points [B] (module docstring).

    Plain tensor ops with shapes fixed by the inputs' (B and P may be symbolic under export). Points that
    are padding or outside `pc_range` are sent to cell 0 with all-zero features: they add 0 to the sums,
    and 0 cannot raise a max of non-negative values whose start is 0, so no trash cell is needed.
    """
    b, p = points.shape[0], points.shape[1]
    h, w = hw
    x0, y0, z0, z1 = (float(pc_range[i]) for i in (0, 1, 2, 5))
    pts = points.float()
    x, y, z, inten = pts[..., 0], pts[..., 1], pts[..., 2], pts[..., 3]  # [B, P] each
    col = torch.floor((x - x0) / cell_m).to(torch.int64)  # [B, P]
    row = torch.floor((y - y0) / cell_m).to(torch.int64)  # [B, P]
    valid = torch.arange(p, device=points.device)[None, :] < num_points[:, None]  # [B, P]
    valid = valid & (col >= 0) & (col < w) & (row >= 0) & (row < h) & (z >= z0) & (z < z1)
    frame = torch.arange(b, device=points.device)[:, None]  # [B, 1]
    cell = (frame * (h * w) + row * w + col) * valid.to(torch.int64)  # [B, P]; invalid -> 0
    keep = valid.to(pts.dtype)  # [B, P]
    zn = ((z - z0) / (z1 - z0)).clamp(0.0, 1.0) * keep  # [B, P] height in [0, 1]
    it = inten.clamp(0.0, 1.0) * keep  # [B, P]
    cells = b * h * w
    flat = cell.reshape(-1)  # [B*P]

    sums_src = torch.stack([keep, zn, it], dim=-1).reshape(-1)  # [B*P*3]: count, z, intensity
    sums_idx = (flat[:, None] * 3 + torch.arange(3, device=points.device)).reshape(-1)  # [B*P*3]
    sums = pts.new_zeros(cells * 3).scatter_reduce(0, sums_idx, sums_src, "sum", include_self=True)
    sums = sums.reshape(b, h, w, 3)  # [B, H, W, 3]

    max_src = torch.stack([zn, it], dim=-1).reshape(-1)  # [B*P*2]
    max_idx = (flat[:, None] * 2 + torch.arange(2, device=points.device)).reshape(-1)  # [B*P*2]
    maxs = pts.new_zeros(cells * 2).scatter_reduce(0, max_idx, max_src, "amax", include_self=True)
    maxs = maxs.reshape(b, h, w, 2)  # [B, H, W, 2]

    count = sums[..., 0]  # [B, H, W]
    denom = count.clamp(min=1.0)
    grid = torch.stack(
        [torch.log1p(count), maxs[..., 0], sums[..., 1] / denom, maxs[..., 1], sums[..., 2] / denom], dim=1
    )  # [B, 5, H, W]
    return grid


def gaussian_radius(l_cells: Tensor, w_cells: Tensor, min_overlap: float) -> Tensor:
    """CenterNet's Gaussian radius (cells) [M] of boxes l x w cells [M]: the smallest centre shift of the
    three CornerNet cases that keeps IoU >= min_overlap."""
    h, w, o = l_cells, w_cells, min_overlap
    b1, c1 = h + w, w * h * (1 - o) / (1 + o)
    r1 = (b1 + torch.sqrt((b1 * b1 - 4 * c1).clamp(min=0))) / 2
    b2, c2 = 2 * (h + w), (1 - o) * w * h
    r2 = (b2 + torch.sqrt((b2 * b2 - 16 * c2).clamp(min=0))) / 2
    a3, b3, c3 = 4 * o, -2 * o * (h + w), (o - 1) * w * h
    r3 = (b3 + torch.sqrt((b3 * b3 - 4 * a3 * c3).clamp(min=0))) / 2
    return torch.minimum(torch.minimum(r1, r2), r3)


class TinyBevDetector(nn.Module):
    """The whole detector (module docstring); satisfies `pfactory.detectors.contract`."""

    inputs = ("points", "num_points")
    deploy_inputs = ("points", "num_points")

    def __init__(self, p: TinyBevParams, spec: DataSpec) -> None:
        super().__init__()
        self.params = p
        self.spec = spec
        x0, y0, _, x1, y1, _ = (float(v) for v in spec.pc_range)
        w, h = (x1 - x0) / p.cell_m, (y1 - y0) / p.cell_m
        if abs(w - round(w)) > 1e-6 or abs(h - round(h)) > 1e-6:
            raise ValueError(
                f"model.tiny_bev.cell_m={p.cell_m}: the pc_range extents ({x1 - x0:g} x {y1 - y0:g} m) must be "
                "whole multiples of it"
            )
        self.grid_hw = (round(h), round(w))  # (H, W) cells
        g, c0, c1 = p.norm_groups, p.stem_channels, p.down_channels
        self.stem = nn.Sequential(conv_gn_relu(GRID_CHANNELS, c0, g), conv_gn_relu(c0, c0, g))
        self.down = nn.Sequential(
            conv_gn_relu(c0, c1, g, stride=2), *[conv_gn_relu(c1, c1, g) for _ in range(p.down_blocks)]
        )
        self.up = nn.Sequential(
            nn.ConvTranspose2d(c1, c0, 2, stride=2, bias=False), nn.GroupNorm(g, c0), nn.ReLU(inplace=True)
        )
        self.shared = conv_gn_relu(2 * c0, c0, g)
        self.heatmap = nn.Conv2d(c0, len(spec.classes), 3, padding=1)
        self.reg = nn.Conv2d(c0, REG_CHANNELS, 3, padding=1)
        nn.init.constant_(self.heatmap.bias, -math.log((1 - _HEATMAP_PRIOR) / _HEATMAP_PRIOR))
        nn.init.normal_(self.reg.weight, std=1e-3)
        nn.init.zeros_(self.reg.bias)

    @property
    def max_detections(self) -> int:
        """D, the fixed number of decoded entries per frame."""
        return int(self.params.max_detections)

    def forward(self, points: Tensor, num_points: Tensor) -> dict[str, Tensor]:
        """points [B, P, 4], num_points [B] -> {"heatmap": [B, K, H, W] logits, "reg": [B, 8, H, W]}."""
        h, w = self.grid_hw
        grid = bev_grid(points, num_points, self.spec.pc_range, float(self.params.cell_m), self.grid_hw)
        x = self.stem(grid)  # [B, C0, H, W]
        # Pad to even sides so the stride-2 stage upsamples back exactly; crop after (static shapes).
        y = self.down(F.pad(x, (0, w % 2, 0, h % 2)))  # [B, C1, ceil(H/2), ceil(W/2)]
        y = self.up(y)[:, :, :h, :w]  # [B, C0, H, W]
        feats = self.shared(torch.cat([x, y], dim=1))  # [B, C0, H, W]
        return {"heatmap": self.heatmap(feats), "reg": self.reg(feats)}

    def decode(self, out: Mapping[str, Tensor]) -> Detections:
        """`forward`'s outputs -> boxes [B, D, 7], scores [B, D] (descending), labels [B, D]."""
        heatmap, reg = out["heatmap"].float(), out["reg"].float()  # [B, K, H, W], [B, 8, H, W]
        b, k, h, w = heatmap.shape
        d = min(self.max_detections, k * h * w)
        heat = heatmap.sigmoid()  # [B, K, H, W]
        n = self.params.nms_kernel
        if n > 1:
            peak = F.max_pool2d(heat, n, stride=1, padding=n // 2)  # [B, K, H, W]
            heat = heat * (peak == heat).to(heat.dtype)  # non-peaks -> 0
        scores, flat = heat.reshape(b, k * h * w).topk(d, dim=1)  # [B, D] each
        labels = torch.div(flat, h * w, rounding_mode="floor")  # [B, D]
        cell = flat - labels * (h * w)  # [B, D] = row * W + col
        row = torch.div(cell, w, rounding_mode="floor")  # [B, D]
        col = cell - row * w  # [B, D]
        r = reg.reshape(b, REG_CHANNELS, h * w).gather(
            2, cell[:, None, :].expand(b, REG_CHANNELS, d)
        )  # [B, 8, D]
        x0, y0 = float(self.spec.pc_range[0]), float(self.spec.pc_range[1])
        s = float(self.params.cell_m)
        x = x0 + (col.to(r.dtype) + r[:, 0]) * s  # [B, D] metres
        y = y0 + (row.to(r.dtype) + r[:, 1]) * s  # [B, D]
        lwh = r[:, 3:6].clamp(max=_MAX_LOG_SIZE).exp()  # [B, 3, D]
        yaw = torch.atan2(r[:, 6], r[:, 7])  # [B, D] in (-pi, pi]
        boxes = torch.stack([x, y, r[:, 2], lwh[:, 0], lwh[:, 1], lwh[:, 2], yaw], dim=-1)  # [B, D, 7]
        return Detections(boxes, scores, labels)

    def forward_export(self, points: Tensor, num_points: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The deployable forward: padded points -> (boxes [B, D, 7], scores [B, D], labels [B, D] int64).
        No Python control flow depends on tensor values: one static graph for every input."""
        det = self.decode(self.forward(points, num_points))
        return det.boxes, det.scores, det.labels

    def targets(self, boxes: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Training targets on the grid for boxes [B, M, 7] (lidar frame) and labels [B, M] (-1: ignore).

        Returns heatmap [B, K, H, W] (a Gaussian per object, peak exactly 1 at its cell, combined by max),
        index [B, M] int64 (`row * W + col` of each object's cell; 0 where masked), mask [B, M] bool (trained
        on: a class label and a centre on the grid), reg [B, M, 8] (module docstring's channels)."""
        p, h, w = self.params, *self.grid_hw
        boxes = boxes.float()
        b, m = labels.shape
        k = len(self.spec.classes)
        s = float(p.cell_m)
        cx = (boxes[..., 0] - float(self.spec.pc_range[0])) / s  # [B, M] cells
        cy = (boxes[..., 1] - float(self.spec.pc_range[1])) / s  # [B, M]
        col, row = torch.floor(cx), torch.floor(cy)  # [B, M]
        mask = (labels >= 0) & (labels < k) & (col >= 0) & (col < w) & (row >= 0) & (row < h)  # [B, M]
        index = torch.where(mask, row * w + col, torch.zeros_like(col)).to(torch.int64)  # [B, M]
        size = boxes[..., 3:6].clamp(min=_MIN_SIZE_M)  # [B, M, 3]
        yaw = boxes[..., 6]
        reg = torch.stack(
            [cx - col, cy - row, boxes[..., 2], *size.log().unbind(-1), torch.sin(yaw), torch.cos(yaw)],
            dim=-1,
        )  # [B, M, 8]
        radius = gaussian_radius(size[..., 0] / s, size[..., 1] / s, p.gaussian_overlap)  # [B, M] cells
        radius = torch.floor(radius).clamp(min=float(p.min_radius))
        sigma = (2 * radius + 1) / 6  # [B, M]
        ys = torch.arange(h, device=boxes.device, dtype=boxes.dtype)[:, None]  # [H, 1]
        xs = torch.arange(w, device=boxes.device, dtype=boxes.dtype)[None, :]  # [1, W]
        d2 = (ys - row[..., None, None]) ** 2 + (xs - col[..., None, None]) ** 2  # [B, M, H, W]
        gauss = torch.exp(-d2 / (2 * sigma[..., None, None] ** 2))  # [B, M, H, W], 1 at the object's cell
        gauss = (
            gauss
            * (d2 <= (radius[..., None, None] ** 2)).to(gauss.dtype)
            * mask[..., None, None].to(gauss.dtype)
        )
        onehot = F.one_hot(labels.clamp(min=0), k).to(gauss.dtype) * mask[..., None].to(
            gauss.dtype
        )  # [B, M, K]
        heat = (gauss[:, :, None] * onehot[..., None, None]).amax(dim=1) if m else boxes.new_zeros(b, k, h, w)
        return heat, index, mask, reg  # heat [B, K, H, W]

    def loss(
        self, out: Mapping[str, Tensor], batch: Mapping[str, Any], ctx: LossContext
    ) -> dict[str, Tensor]:
        """`{"loss", "heatmap", "reg"}` (scalars) of `forward`'s outputs on a batch slice (module docstring).

        The focal sum is divided by the global number of target peaks and the L1 sum by the global number
        of objects (`ctx.all_reduce_sum`), times `world_size`: DDP's gradient average then equals the
        single-process gradient of the whole batch. Computed in fp32 (outside autocast)."""
        p = self.params
        with torch.autocast(batch["boxes"].device.type, enabled=False):
            heat_t, index, mask, reg_t = self.targets(batch["boxes"], batch["labels"])
            logits = out["heatmap"].float()  # [B, K, H, W]
            pos = heat_t.eq(1.0)  # [B, K, H, W]
            prob = logits.sigmoid()
            log_p, log_1mp = F.logsigmoid(logits), F.logsigmoid(-logits)
            pos_term = (1 - prob).pow(p.focal_alpha) * log_p * pos.to(logits.dtype)
            neg_term = (
                (1 - heat_t).pow(p.focal_beta) * prob.pow(p.focal_alpha) * log_1mp * (~pos).to(logits.dtype)
            )
            focal_sum = -(pos_term + neg_term).sum()  # []

            b = reg_t.shape[0]
            reg = out["reg"].float().reshape(b, REG_CHANNELS, -1)  # [B, 8, H*W]
            pred = reg.gather(2, index[:, None, :].expand(b, REG_CHANNELS, index.shape[1])).transpose(
                1, 2
            )  # [B, M, 8]
            l1_sum = ((pred - reg_t).abs() * mask[..., None].to(pred.dtype)).sum()  # []

            counts = torch.stack([pos.sum(), mask.sum()]).to(torch.float64)  # [2]: peaks, objects
            counts = ctx.all_reduce_sum(counts).to(logits.dtype).clamp(min=1.0)
            focal = focal_sum / counts[0] * ctx.world_size
            l1 = l1_sum / counts[1] * ctx.world_size
        total = p.heatmap_weight * focal + p.reg_weight * l1
        return {"loss": total, "heatmap": focal, "reg": l1}
