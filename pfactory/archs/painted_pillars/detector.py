"""The default detector: camera-painted pillars, a multi-scale BEV backbone and a center head.

In (a padded batch, lidar frame: x forward, y left, z up, metres):
    points     [B, P, 4]  float32 (x, y, z, intensity); rows >= num_points[b] are padding
    num_points [B]        int64
    images     [B, N, 3, Hi, Wi] float32, normalized (unused when `model.camera` is false)
    proj       [B, N, 3, 4] float32: homogeneous lidar point -> homogeneous pixel of the model-input image
    cam_valid  [B, N]     bool (padding cameras are False)
Out of `forward`: `{"heatmap": [B, K, Ho, Wo] logits, "reg": [B, 8, Ho, Wo]}` on the head grid
(row along y, column along x; `pfactory.archs.painted_pillars.targets` defines the 8 regression channels).
Out of `forward_export`: `(boxes [B, D, 7], scores [B, D], labels [B, D])` — the whole pipeline from
padded points to boxes as plain tensor ops with static shapes, what the optimize stage exports.

DESIGN.md §5, step by step (`forward` is this, once):
1. image branch: a small CNN with weights shared by every camera -> [B*N, Ci, Hi/s, Wi/s];
2. painting (`pfactory.archs.painted_pillars.painting`): every point samples the image features at its projection in
   every camera that sees it, averaged over those cameras. By default (`model.paint_sampler: gather`)
   the pillar MLP's first layer is applied to the feature map before sampling and only seen points sample;
3. pillar encoder (`pfactory.archs.painted_pillars.pillars`): decorated point features -> MLP -> per-point features,
   scattered (max) into the BEV canvas by the backbone's first block (`CanvasStem`);
4. BEV backbone (strided stages, each upsampled to the head stride, concatenated) and the center head.
Every normalization is GroupNorm: a sample's output does not depend on its batch, so DDP splits and
single-process runs compute the same loss, and export needs no running statistics.

Variants are module swaps made when the model is built or converted, never branches in `forward`
(`pfactory.archs.painted_pillars.variants`): `build_model` takes the sparse stem where the C kernels are built;
`for_export` gives the ONNX export's formulation, `for_compile` torch.compile's static-shape painting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from pfactory.archs.painted_pillars import variants
from pfactory.archs.painted_pillars.decode import decode
from pfactory.archs.painted_pillars.layers import GroupNormReLU, conv_norm_act
from pfactory.archs.painted_pillars.loss import detection_loss
from pfactory.archs.painted_pillars.painting import Painter, ProjectedPainter
from pfactory.archs.painted_pillars.params import ModelParams
from pfactory.archs.painted_pillars.pillars import CanvasStem, PillarEncoder, scatter_max_nonnegative
from pfactory.archs.painted_pillars.targets import build_targets
from pfactory.detectors.contract import DataSpec, Detections, LossContext

__all__ = ["PaintedPillarDetector", "build_model", "scatter_max_nonnegative"]  # the last: tests/optimize

_HEATMAP_PRIOR = 0.1  # initial heatmap probability: bias -log((1 - p) / p) = -2.19, as CenterNet/CenterPoint


class ImageBranch(nn.Module):
    """[B*N, 3, Hi, Wi] normalized images -> [B*N, Ci, Hi/s, Wi/s] features (s = 4 or 8)."""

    def __init__(self, p: ModelParams) -> None:
        super().__init__()
        g = p.norm_groups
        c = p.image_channels
        layers = [conv_norm_act(3, 16, g if 16 % g == 0 else 1, stride=2), conv_norm_act(16, c, g, stride=2)]
        if p.image_stride == 8:
            layers.append(conv_norm_act(c, c, g, stride=2))
        # Two convs at the output stride widen the receptive field (~35 px at stride 4) so a point
        # samples its object's appearance, not just its own pixel's colour.
        # The last output is sampled by the painting, in fp32: it stays fp32.
        layers += [conv_norm_act(c, c, g), conv_norm_act(c, c, g, out_fp32=True)]
        self.net = nn.Sequential(*layers)

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)  # [B*N, Ci, Hi/s, Wi/s]


class BevBackbone(nn.Module):
    """Pillar features -> the [B, C0, H, W] canvas (its first block, `CanvasStem`) -> [B, sum(up), H/hs,
    W/hs] multi-scale features at the head stride ([B, up, H/hs, W/hs] with `neck: sum`)."""

    def __init__(self, p: ModelParams) -> None:
        super().__init__()
        g = p.norm_groups
        self.total_stride = math.prod(p.bev_strides)
        self.head_stride = p.head_stride
        self.grid = p.grid  # (H, W) of the pillar grid
        # The space-to-depth stem hands over the canvas at stride 2 already ([B, 4*C0, H/2, W/2]).
        self.input_stride = 2 if p.bev_stem == "space_to_depth" else 1
        self.sum_neck = p.neck == "sum"  # the ups are summed in fp32, not concatenated for a conv
        self.stages = nn.ModuleList()
        self.ups = nn.ModuleList()
        c_prev = p.point_channels * self.input_stride**2
        stride = 1
        for i, (c, s, n) in enumerate(zip(p.bev_channels, p.bev_strides, p.bev_blocks)):
            stride *= s
            if i == 0 and self.input_stride == 2:
                first = conv_norm_act(c_prev, c, g, kernel=1)  # mixes each 2x2 pillar block: one GEMM
            else:
                first = conv_norm_act(c_prev, c, g, stride=s)
            layers = [first] + [conv_norm_act(c, c, g) for _ in range(n)]
            self.stages.append(nn.Sequential(*layers))
            if stride > self.head_stride:  # upsample: transposed conv, kernel = stride (no overlap)
                f = stride // self.head_stride
                up = nn.Sequential(
                    nn.ConvTranspose2d(c, p.up_channels, f, stride=f, bias=False),
                    GroupNormReLU(g, p.up_channels, out_fp32=self.sum_neck),
                )
            else:  # at or below the head stride: (strided) 1x1 / 3x3 conv down to it
                f = self.head_stride // stride
                up = conv_norm_act(
                    c, p.up_channels, g, stride=f, kernel=1 if f == 1 else 3, out_fp32=self.sum_neck
                )
            self.ups.append(up)
            c_prev = c
        self.out_channels = p.up_channels * (1 if self.sum_neck else len(self.stages))
        # The first block reads the pillars: scatter-max canvas, padded to a multiple of the total stride
        # so every stage upsamples back exactly (the head grid is cropped back; static shapes).
        h, w = self.grid
        t = self.total_stride // self.input_stride
        hc, wc = h // self.input_stride, w // self.input_stride
        self.stages[0][0] = CanvasStem(
            self.stages[0][0], self.grid, self.input_stride == 2, ((-hc) % t, (-wc) % t)
        )

    def forward(self, point_feats: Tensor, cell: Tensor, b: int) -> Tensor:
        """point features [N, C0], canvas cell [N] (`PillarEncoder`), batch size -> [B, sum(up), H/hs, W/hs]."""
        h, w = self.grid
        x = self.stages[0][0](point_feats, cell, b)  # [B, c_0, Hp/s_0, Wp/s_0]
        outs = []
        for i, (stage, up) in enumerate(zip(self.stages, self.ups)):
            x = stage[1:](x) if i == 0 else stage(x)  # [B, c_i, Hp/s_i, Wp/s_i]
            outs.append(up(x))  # [B, up, Hp/hs, Wp/hs]
        if self.sum_neck:
            y = outs[0]
            for o in outs[1:]:
                y = y + o  # [B, up, Hp/hs, Wp/hs]
        else:
            y = torch.cat(outs, dim=1)  # [B, n*up, Hp/hs, Wp/hs]
        return y[:, :, : h // self.head_stride, : w // self.head_stride]  # [B, n*up or up, H/hs, W/hs]


class CenterHead(nn.Module):
    """Shared 3x3 conv, then a per-class heatmap (logits) and the 8 regression channels."""

    def __init__(self, c_in: int, p: ModelParams) -> None:
        super().__init__()
        self.shared = conv_norm_act(c_in, p.head_channels, p.norm_groups, kernel=p.head_kernel)
        self.heatmap = nn.Conv2d(p.head_channels, len(p.classes), 3, padding=1)
        self.reg = nn.Conv2d(p.head_channels, len(p.reg_channels), 3, padding=1)
        nn.init.constant_(self.heatmap.bias, -math.log((1 - _HEATMAP_PRIOR) / _HEATMAP_PRIOR))
        # Small initial regressions: the first steps are not dominated by huge L1 gradients.
        nn.init.normal_(self.reg.weight, std=1e-3)
        nn.init.zeros_(self.reg.bias)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        y = self.shared(x)  # [B, Ch, Ho, Wo]
        return {"heatmap": self.heatmap(y), "reg": self.reg(y)}  # [B, K, Ho, Wo], [B, R, Ho, Wo]


class PaintedPillarDetector(nn.Module):
    """The whole detector; see the module docstring for inputs and outputs. It satisfies the detector
    contract (`pfactory.detectors.contract`): `inputs`, `deploy_inputs`, `spec`, `loss`, `decode`,
    `forward_export` and the `for_export` / `for_compile` hooks."""

    inputs = ("points", "num_points", "images", "proj", "cam_valid")
    deploy_inputs = ("points", "num_points", "images", "proj")

    def __init__(
        self, p: ModelParams, image_size: tuple[int, int] = (416, 128), spec: DataSpec | None = None
    ) -> None:
        """`image_size` = (Wi, Hi) of the model-input images (`prepare.image_size`); painting needs it.
        `spec`: the prepared data's facts (default: `p`'s classes and range, `image_size`, no camera names)."""
        super().__init__()
        self.params = p
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.spec = spec or DataSpec(tuple(p.classes), tuple(p.pc_range), self.image_size)  # type: ignore[arg-type]
        self.camera = p.camera
        if self.camera:
            wi, hi = self.image_size
            if wi % p.image_stride or hi % p.image_stride:
                raise ValueError(
                    f"image size {self.image_size} must be divisible by model.image_stride={p.image_stride} "
                    "so the feature map covers the image exactly"
                )
            self.image_branch = ImageBranch(p)
            sampler = p.paint_sampler
            self.painter = (
                ProjectedPainter(self.image_size) if sampler == "gather" else Painter(self.image_size)
            )
        extra = p.image_channels + 1 if self.camera else 0
        self.pillars = PillarEncoder(p, extra)
        self.backbone = BevBackbone(p)
        self.head = CenterHead(self.backbone.out_channels, p)

    def forward(
        self,
        points: Tensor,  # [B, P, 4]
        num_points: Tensor,  # [B]
        images: Tensor | None = None,  # [B, N, 3, Hi, Wi]
        proj: Tensor | None = None,  # [B, N, 3, 4]
        cam_valid: Tensor | None = None,  # [B, N] bool
    ) -> dict[str, Tensor]:
        painted = None
        if self.camera:
            assert images is not None and proj is not None, (
                "model.camera is true: images and proj are required"
            )
            b, n = images.shape[:2]
            if cam_valid is None:
                cam_valid = torch.ones(b, n, dtype=torch.bool, device=images.device)  # [B, N]
            images = images.flatten(0, 1).contiguous(memory_format=torch.channels_last)  # [B*N, 3, Hi, Wi]
            feats = self.image_branch(images)  # [B*N, Ci, h, w]
            feats = feats.reshape(b, n, *feats.shape[1:])  # [B, N, Ci, h, w]
            # [B, P, Ci + 1], or the projected (rows [B, P, C0], flag [B, P]): `pfactory.archs.painted_pillars.painting`
            painted = self.painter(points, feats, proj, cam_valid, self.pillars.painted_weight())
        point_feats, cell = self.pillars(points, num_points, painted)  # [B*P, C0], [B*P]
        return self.head(self.backbone(point_feats, cell, points.shape[0]))  # heatmap, reg

    def forward_export(
        self, points: Tensor, num_points: Tensor, images: Tensor, proj: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Padded inputs -> `(boxes [B, D, 7], scores [B, D], labels [B, D] int64)`, D = max_detections.

        Every camera is taken as valid (the deployed input has no padding cameras). No Python control
        flow depends on tensor values, so the graph is the same for every input: ONNX/compile-safe.
        """
        out = self.forward(points, num_points, images, proj)
        return decode(out["heatmap"], out["reg"], self.params)

    @property
    def max_detections(self) -> int:
        """D, the fixed number of decoded entries per frame."""
        return self.params.max_detections

    def loss(self, out: dict[str, Tensor], batch: Mapping[str, Any], ctx: LossContext) -> dict[str, Tensor]:
        """Focal heatmap + L1 regression loss of `forward`'s outputs on a batch slice (`pfactory.archs.painted_pillars.loss`):
        `{"loss", "heatmap", "reg", "reg/<channel>"}`. The targets are rendered in fp32 (outside autocast);
        their peak and object counts are summed over DDP processes, so the loss does not depend on their number."""
        p = self.params
        boxes = batch["boxes"]  # [B, M, 7]
        with torch.autocast(boxes.device.type, enabled=False):
            targets = build_targets(boxes, batch["labels"], p, batch.get("num_boxes"))
            counts = torch.stack([targets.num_peaks, targets.num_objects]).to(torch.float64)  # [2]
            counts = ctx.all_reduce_sum(counts)  # global normalizers
        return detection_loss(
            out, targets, p.heatmap_weight, p.reg_weight, p.reg_code_weights,
            num_peaks=counts[0], num_objects=counts[1], world_size=ctx.world_size,
        )  # fmt: skip

    def decode(self, out: dict[str, Tensor]) -> Detections:
        """`forward`'s outputs -> boxes [B, D, 7], scores [B, D], labels [B, D] (`pfactory.archs.painted_pillars.decode`)."""
        return Detections(*decode(out["heatmap"], out["reg"], self.params))

    def for_export(self) -> nn.Module:
        """A copy in the ONNX export's formulation (`variants.for_export`)."""
        return variants.for_export(self)

    def for_compile(self) -> None:
        """Static-shape painting for torch.compile, in place (`variants.for_compile`)."""
        variants.for_compile(self)


def build_model(
    p: ModelParams,
    image_size: tuple[int, int] = (416, 128),
    sparse_stem: bool | None = None,
    spec: DataSpec | None = None,
) -> PaintedPillarDetector:
    """The painted pillar detector for `p` (`pfactory.archs.painted_pillars.arch` builds it for the factory from the
    `model.painted_pillars` section and the prepared data's `spec`).

    Conv weights are channels-last: the scattered canvas already is ([B, H, W, C] memory), and oneDNN
    runs the BEV backbone + head ~20% faster that way (fwd+bwd 179 -> 144 ms per batch of 4, 1 thread).
    `sparse_stem` (default: where the C kernels are built, `kernels.native.available()`): the canvas and
    the 3x3 stem conv as one sparse op (`variants.use_sparse_stem`); the same function, the same weights.
    """
    model = PaintedPillarDetector(p, image_size, spec).to(memory_format=torch.channels_last)
    return variants.use_sparse_stem(model, sparse_stem)
