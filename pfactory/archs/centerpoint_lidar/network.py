"""The `centerpoint_lidar` detector: lidar-only pillars, a multi-scale BEV backbone, one center head per class
group with direction-bin headings (docs/models/centerpoint_lidar.md).

In (a padded batch, lidar frame: x forward, y left, z up, metres):
    points     [B, P, 4] float32 (x, y, z, intensity); rows >= num_points[b] are padding
    num_points [B]       int64
Out of `forward`: `{"heatmap": [B, K, Ho, Wo] logits, channels in head order (`Geometry.order`),
                    "reg": [B, G, R, Ho, Wo]}` (G heads, R = `CenterPointLidarParams.reg_channels`).
Out of `forward_export`: `(boxes [B, D, 7], scores [B, D], labels [B, D] int64)`: decode inside the graph.

Building blocks of the default architecture are reused (`pfactory.archs.painted_pillars.pillars`: the pillar encoder and
the scatter-max canvas stem; `pfactory.archs.painted_pillars.layers`; `pfactory.archs.painted_pillars.variants`: the sparse stem and the
export formulation), its network and head are not: the head, targets, loss and decode are this package's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from pfactory.archs.centerpoint_lidar.decode import decode
from pfactory.archs.centerpoint_lidar.loss import detection_loss
from pfactory.archs.centerpoint_lidar.params import CenterPointLidarParams, Geometry
from pfactory.archs.centerpoint_lidar.point_heading import (
    PointHeading,
    heading_from_logits,
    near_square,
    point_heading_loss,
    trained_views,
    turn_by,
)
from pfactory.archs.centerpoint_lidar.refine import (
    TURNS,
    HeadingRefiner,
    fine_canvas,
    first_stage_turn_logp,
    refine_loss,
    turn,
)
from pfactory.archs.centerpoint_lidar.targets import build_targets
from pfactory.archs.painted_pillars import variants
from pfactory.archs.painted_pillars.layers import GroupNormReLU, conv_norm_act
from pfactory.archs.painted_pillars.pillars import CanvasStem, PillarEncoder
from pfactory.detectors.contract import DataSpec, Detections, LossContext

_HEATMAP_PRIOR = 0.1  # initial heatmap probability (CenterNet/CenterPoint bias -2.19)


class Backbone(nn.Module):
    """(point features [N, C0] >= 0, canvas cell [N], B) -> [B, n * up, Ho, Wo]: the scatter-max canvas
    (`CanvasStem`, the first stage's first block), strided stages, each brought to the head stride
    (transposed conv up / strided conv down) and concatenated."""

    def __init__(self, p: CenterPointLidarParams, geo: Geometry) -> None:
        super().__init__()
        g = p.norm_groups
        self.grid = geo.grid
        self.head_stride = p.head_stride
        self.stages = nn.ModuleList()
        self.ups = nn.ModuleList()
        c_prev, stride = p.point_channels, 1
        for c, s, n in zip(p.bev_channels, p.bev_strides, p.bev_blocks):
            stride *= s
            self.stages.append(
                nn.Sequential(
                    conv_norm_act(c_prev, c, g, stride=s), *[conv_norm_act(c, c, g) for _ in range(n)]
                )
            )
            if stride > self.head_stride:
                f = stride // self.head_stride
                up: nn.Module = nn.Sequential(
                    nn.ConvTranspose2d(c, p.up_channels, f, stride=f, bias=False),
                    GroupNormReLU(g, p.up_channels),
                )
            else:
                f = self.head_stride // stride
                up = conv_norm_act(c, p.up_channels, g, stride=f, kernel=1 if f == 1 else 3)
            self.ups.append(up)
            c_prev = c
        self.out_channels = p.up_channels * len(self.stages)
        h, w = self.grid
        t = math.prod(p.bev_strides)
        self.stages[0][0] = CanvasStem(self.stages[0][0], self.grid, False, ((-h) % t, (-w) % t))

    def forward(self, point_feats: Tensor, cell: Tensor, b: int) -> Tensor:
        h, w = self.grid
        x = self.stages[0][0](point_feats, cell, b)  # [B, c0, Hp/s0, Wp/s0]
        outs = []
        for i, (stage, up) in enumerate(zip(self.stages, self.ups)):
            x = stage[1:](x) if i == 0 else stage(x)
            outs.append(up(x))  # [B, up, Hp/hs, Wp/hs]
        y = torch.cat(outs, dim=1)  # [B, n*up, Hp/hs, Wp/hs]
        return y[:, :, : h // self.head_stride, : w // self.head_stride]


class GroupHead(nn.Module):
    """One class group's head on the shared head features: its own 3x3 conv, then a heatmap (one logit per
    class of the group), the box channels (offset x, y, z, log l, w, h) and the heading (bin logits and a
    sin/cos residual per bin)."""

    def __init__(self, c: int, num_classes: int, p: CenterPointLidarParams) -> None:
        super().__init__()
        n = p.heading_bins
        self.own = conv_norm_act(c, c, p.norm_groups)
        self.heatmap = nn.Conv2d(c, num_classes, 3, padding=1)
        self.reg = nn.Conv2d(c, 6 + 3 * n, 3, padding=1)
        nn.init.constant_(self.heatmap.bias, -math.log((1 - _HEATMAP_PRIOR) / _HEATMAP_PRIOR))
        nn.init.normal_(self.reg.weight, std=1e-3)
        nn.init.zeros_(self.reg.bias)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = self.own(x)  # [B, C, Ho, Wo]
        return self.heatmap(y), self.reg(y)  # [B, k_g, Ho, Wo], [B, R, Ho, Wo]


class CenterPointLidar(nn.Module):
    """The detector (module docstring); it satisfies `pfactory.detectors.contract`."""

    inputs = ("points", "num_points")
    deploy_inputs = ("points", "num_points")
    int8_float_modules = ("point_heading",)  # centimetre-scale moments: 8 bits turn a third of the headings

    def __init__(self, p: CenterPointLidarParams, spec: DataSpec) -> None:
        super().__init__()
        self.params = p
        self.spec = spec
        self.geo = Geometry.of(p, spec.classes, spec.pc_range)
        self.pillars = PillarEncoder(self.geo, 0)  # type: ignore[arg-type]  # duck-typed geometry
        self.backbone = Backbone(p, self.geo)
        self.shared = conv_norm_act(self.backbone.out_channels, p.head_channels, p.norm_groups)
        self.heads = nn.ModuleList(GroupHead(p.head_channels, len(g), p) for g in self.geo.groups)
        self.refiner = HeadingRefiner(p, len(spec.classes), spec.pc_range) if p.refine else None
        self.point_heading = PointHeading(p) if p.refine and p.refine_point_heading else None

    @property
    def max_detections(self) -> int:
        """D, the fixed number of decoded entries per frame."""
        return self.params.max_detections

    def forward(self, points: Tensor, num_points: Tensor) -> dict[str, Tensor]:
        """points [B, P, 4], num_points [B] -> {"heatmap": [B, K, Ho, Wo], "reg": [B, G, R, Ho, Wo]} and, with
        the refiner, "fine": [B, 2S, Hf, Wf] (`refine.fine_canvas`: no parameters, no gradient); with the
        point heading, the inputs again ("points", "num_points": its decode reads the points)."""
        point_feats, cell = self.pillars(points, num_points, None)  # [B*P, C0], [B*P]
        x = self.shared(self.backbone(point_feats, cell, points.shape[0]))  # [B, Ch, Ho, Wo]
        outs = [head(x) for head in self.heads]
        heatmap = torch.cat([o[0] for o in outs], dim=1)  # [B, K, Ho, Wo]
        reg = torch.stack([o[1] for o in outs], dim=1)  # [B, G, R, Ho, Wo]
        if self.refiner is None:
            return {"heatmap": heatmap, "reg": reg}
        fine = fine_canvas(points, num_points, self.geo.pc_range, self.params)  # [B, 2S, Hf, Wf]
        out = {"heatmap": heatmap, "reg": reg, "fine": fine}
        if self.point_heading is not None:
            out.update(points=points, num_points=num_points)
        return out

    def forward_export(self, points: Tensor, num_points: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Padded points -> (boxes [B, D, 7], scores [B, D], labels [B, D] int64); no value-dependent control
        flow: the same graph for every input."""
        return tuple(self.decode(self.forward(points, num_points)))  # type: ignore[return-value]

    def loss(self, out: dict[str, Tensor], batch: Mapping[str, Any], ctx: LossContext) -> dict[str, Tensor]:
        """Focal heatmap + L1 box + direction-bin CE + residual L1 of `forward`'s outputs on a batch slice
        (`loss.detection_loss`); targets in fp32, their counts summed over DDP processes."""
        boxes = batch["boxes"]  # [B, M, 7]
        p = self.params
        with torch.autocast(boxes.device.type, enabled=False):
            t = build_targets(boxes, batch["labels"], p, self.geo, batch.get("num_boxes"))
            square = trained_views(t.mask, boxes, p).sum().to(t.num_objects.dtype)
            counts = ctx.all_reduce_sum(torch.stack([t.num_peaks, t.num_objects, square]).to(torch.float64))
            terms = detection_loss(
                out, t, self.params, num_peaks=counts[0], num_objects=counts[1], world_size=ctx.world_size
            )
            if self.refiner is None:
                return terms
            ce_sum, _ = refine_loss(self.refiner, out["fine"], boxes, batch["labels"], t.mask, self.params)
            refine = ce_sum / (TURNS * counts[1].clamp(min=1)).to(ce_sum.dtype) * ctx.world_size
            terms["refine"] = refine
            terms["loss"] = terms["loss"] + p.refine_weight * refine
            if self.point_heading is not None:
                ce_sum, _ = point_heading_loss(
                    self.point_heading, batch["points"], batch["num_points"], boxes, t.mask, p
                )
                heading = ce_sum / counts[2].clamp(min=1).to(ce_sum.dtype) * ctx.world_size
                terms["point_heading"] = heading
                terms["loss"] = terms["loss"] + p.refine_point_weight * heading
            return terms

    def decode(self, out: dict[str, Tensor]) -> Detections:
        """`forward`'s outputs -> boxes [B, D, 7], scores [B, D], labels [B, D] (`decode.decode`), each
        heading turned by the refiner's quarter turn when the section enables it (`refine.turn`), and a
        near-square box's heading from its points when the point heading is on (`point_heading`)."""
        boxes, scores, labels, bins = decode(
            out["heatmap"], out["reg"], self.geo, self.params.nms_kernel, self.max_detections
        )
        if self.refiner is None:
            return Detections(boxes, scores, labels)
        logits = self.refiner(out["fine"], boxes, labels)  # [B, D, 4]
        turned = turn(boxes, logits + first_stage_turn_logp(boxes, bins))
        if self.point_heading is None:
            return Detections(turned, scores, labels)
        candidates = self.point_heading(out["points"], out["num_points"], boxes)  # [B, D, N]
        from_points = turn_by(boxes, heading_from_logits(boxes[..., 6], candidates))
        square = near_square(boxes, self.params.refine_square_aspect)[..., None]  # [B, D, 1]
        return Detections(torch.where(square, from_points, turned), scores, labels)

    def for_export(self) -> nn.Module:
        """A copy in the ONNX export's formulation (`pfactory.archs.painted_pillars.variants.for_export`: plain Conv,
        GroupNormalization + Relu, channels-first decoration, 1-D scatter-max canvas)."""
        return variants.for_export(self)


def build_detector(
    p: CenterPointLidarParams, spec: DataSpec, sparse_stem: bool | None = None
) -> CenterPointLidar:
    """The detector for `p` and the data's `spec`, channels-last, with the sparse canvas stem where the C
    kernels are built (`pfactory.archs.painted_pillars.variants.use_sparse_stem`; `sparse_stem` overrides)."""
    model = CenterPointLidar(p, spec).to(memory_format=torch.channels_last)
    return variants.use_sparse_stem(model, sparse_stem)  # type: ignore[return-value]
