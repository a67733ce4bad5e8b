"""Parameters of the default architecture, `painted_pillars` (the training loop's are in `pfactory/train/params.py`).

In: the `model.painted_pillars` section of `params.yaml` (`PaintedPillarsParams`, validated when
`model.arch` selects it: `pfactory.detectors.params`); `classes` and `pc_range` come from the prepared
data (`prepare:` section, carried by its manifest) when the network is built (`ModelParams`).
Out: validated pydantic models; `ModelParams` is also written next to the weights as
`model_config.json`, so the optimize/evaluate stages rebuild the exact network from it.

Units: metres in the lidar frame (x forward, y left, z up); BEV cells are square.
The defaults are sized so that `factory run` trains in minutes on a 2-core CPU (docs/MODEL.md has
the measurements behind them and a larger preset for a GPU).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pfactory.config.section import (
    NonNegFloat,
    PillarGrid,
    PositiveFloat,
    PositiveInt,
    Section,
    check_pc_range,
    pillar_misfit,
)


class PaintedPillarsParams(Section):
    """`model.painted_pillars`: the camera-painted pillar detector with a center head (DESIGN.md §5,
    docs/MODEL.md), the factory's default architecture. The classes and the point-cloud range are the
    prepared data's (`prepare.classes`, `prepare.pc_range`), given when the network is built (`ModelParams`)."""

    pillar_size_m: PositiveFloat = 0.4
    """Side of a square pillar (BEV cell of the pillar encoder), metres. (x, y) extents must be multiples."""
    camera: bool = True
    """Paint lidar points with image features (camera fusion). False gives the lidar-only ablation."""
    image_channels: PositiveInt = 32
    """Channels of the image-branch feature map that points are painted with."""
    image_stride: Literal[4, 8] = 4
    """Output stride of the image branch (image pixels per feature cell)."""
    paint_sampler: Literal["grid_sample", "gather"] = "gather"
    """How a point samples its camera's feature map (bilinear, zero padding; the same function to float
    rounding). `gather` (default): the pillar MLP's first layer is applied to the feature-map rows first,
    then only the points a camera sees gather their four projected rows
    (`pfactory.archs.painted_pillars.painting.paint_points_projected`): no per-point image-feature tensor, no concat, a
    row-wise backward (docs/MODEL.md, "Speed"). `grid_sample`: `F.grid_sample` per point, then the
    decoration concat and the whole first layer (`paint_points`), what the ONNX export always uses."""
    point_channels: PositiveInt = 32
    """Channels of the per-point MLP output, i.e. of the scattered BEV pillar canvas."""
    point_layers: Annotated[int, Field(ge=1, le=3)] = 1
    """Linear + LayerNorm + ReLU layers of the per-point MLP (PointPillars: 1)."""
    bev_channels: list[PositiveInt] = Field(default_factory=lambda: [32, 64, 128])
    """Channels of the BEV backbone stages (stage i runs at stride prod(bev_strides[:i+1]) of the pillar grid)."""
    bev_strides: list[PositiveInt] = Field(default_factory=lambda: [2, 2, 2])
    """Stride of the first conv of each backbone stage (relative to the previous stage)."""
    bev_blocks: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [1, 2, 2])
    """Extra 3x3 convs after the strided conv of each stage."""
    bev_stem: Literal["space_to_depth", "conv3x3"] = "conv3x3"
    """How the first backbone stage leaves the pillar grid. `space_to_depth`: the pillar encoder scatters
    into 2x2 pillar blocks ([B, 4 * point_channels, H/2, W/2], a free reshape) and a 1x1 conv (one GEMM)
    mixes them; `conv3x3`: a stride-2 3x3 conv on the [B, point_channels, H, W] canvas (the original
    stem, ~3x the fwd+bwd time of that layer). space_to_depth needs bev_strides[0] = 2. Default conv3x3:
    the default run with space_to_depth + head_kernel 1 scored lower (docs/MODEL.md, "Speed")."""
    up_channels: PositiveInt = 32
    """Channels each stage is projected to before the multi-scale concat at the head stride."""
    neck: Literal["concat", "sum"] = "concat"
    """How the stages' up-projections meet at the head stride. `concat`: stacked, sum(up_channels) channels
    into the head's shared conv; `sum`: added (FPN-style), up_channels channels, a third of that conv's
    MACs with the same 3x3 receptive field (docs/MODEL.md, "Speed")."""
    head_stride: PositiveInt = 2
    """Output stride of the head w.r.t. the pillar grid: head cell = pillar_size_m * head_stride."""
    head_channels: PositiveInt = 32
    """Channels of the shared conv in front of the heatmap and regression convs."""
    head_kernel: Literal[1, 3] = 3
    """Kernel of that shared conv. 1: a GEMM mixing the concatenated scales (the heatmap/regression convs
    behind it are 3x3); 3: the original 3x3 over sum(up_channels) inputs, the costliest layer of the
    network (~9x the MACs of the 1x1; ~25% of the network's MACs). Default 3 (see bev_stem)."""
    heading: Literal["axis_sign", "sincos"] = "axis_sign"
    """Yaw target. `axis_sign` (default): sin/cos of yaw plus sin/cos of 2*yaw (the box axis, defined up to
    pi); the decoder takes the axis from the 2*yaw pair and front/back from the sign of the yaw pair
    projected on it, so an unsure front/back costs pi, never a wrong axis. `sincos`: sin/cos of yaw only
    (the original 8-channel head). On the default data (cars with a hood longer than the trunk, lamps)
    axis_sign lowers the Car heading error, 0.317 -> 0.272 rad val AOE (docs/MODEL.md, "Heading")."""
    heatmap_weight: NonNegFloat = 1.0
    """Weight of the focal heatmap loss."""
    reg_weight: NonNegFloat = 0.25
    """Weight of the L1 regression loss (CenterPoint: 0.25)."""
    reg_code_weights: list[NonNegFloat] | None = None
    """Per-channel weights of the L1 terms, one per regression channel (`ModelParams.reg_channels`:
    offset x, y; z; log l, w, h; sin, cos of yaw; with `heading: axis_sign` also sin, cos of
    2 yaw); null = 1.0 for every channel."""
    norm_groups: PositiveInt = 8
    """GroupNorm groups. GroupNorm (not BatchNorm) keeps a sample's output independent of its batch,
    so DDP and single-process runs agree and export needs no running statistics."""
    gaussian_overlap: Annotated[float, Field(gt=0, lt=1)] = 0.1
    """CenterPoint `min_overlap` for the Gaussian radius of a target peak."""
    min_radius: Annotated[int, Field(ge=0)] = 2
    """Smallest Gaussian radius, head cells (CenterPoint: 2)."""
    max_detections: PositiveInt = 100
    """Top-K peaks kept per frame by the decoder (fixed K: the exported graph has static shapes)."""
    nms_kernel: Literal[1, 3, 5] = 3
    """Max-pool window of the peak extraction (1 disables it)."""

    @model_validator(mode="after")
    def _check_layers(self) -> PaintedPillarsParams:
        if not (len(self.bev_channels) == len(self.bev_strides) == len(self.bev_blocks)):
            raise ValueError("bev_channels, bev_strides and bev_blocks need one entry per stage")
        if self.bev_stem == "space_to_depth" and self.bev_strides[0] != 2:
            raise ValueError(f"bev_stem=space_to_depth needs bev_strides[0] = 2, got {self.bev_strides}")
        strides = [math.prod(self.bev_strides[: i + 1]) for i in range(len(self.bev_strides))]
        if self.head_stride not in strides and self.head_stride != 1:
            raise ValueError(
                f"head_stride must be 1 or one of the stage strides {strides}, got {self.head_stride}"
            )
        for c in (
            self.image_channels,
            self.point_channels,
            *self.bev_channels,
            self.up_channels,
            self.head_channels,
        ):
            if c % self.norm_groups:
                raise ValueError(
                    f"every channel count must be divisible by norm_groups={self.norm_groups}, got {c}"
                )
        if self.reg_code_weights is not None and len(self.reg_code_weights) != len(self.reg_channels):
            raise ValueError(
                f"reg_code_weights has {len(self.reg_code_weights)} entries, the head regresses "
                f"{len(self.reg_channels)} channels ({', '.join(self.reg_channels)}): one weight each, or null"
            )
        return self

    @property
    def reg_channels(self) -> tuple[str, ...]:
        """Names of the regression channels of the head, in order (`pfactory.archs.painted_pillars.targets`)."""
        base = ("off_x", "off_y", "z", "log_l", "log_w", "log_h", "sin", "cos")
        return base + (("sin2", "cos2") if self.heading == "axis_sign" else ())


class ModelParams(PaintedPillarsParams, PillarGrid):
    """The painted pillar detector's params with the prepared data's classes and range: what the network is
    built from and what `model_config.json` stores (`pfactory.archs.painted_pillars.arch` builds it from the section and the
    data)."""

    classes: list[str] = Field(default_factory=lambda: ["Car", "Pedestrian", "Cyclist"])
    """Detected classes in label-index order: the prepared data's (`prepare.classes`, via its manifest)."""
    pc_range: list[float] = Field(default_factory=lambda: [0.0, -40.0, -3.0, 70.4, 40.0, 1.0])
    """BEV region (x_min, y_min, z_min, x_max, y_max, z_max), metres, lidar frame; points outside are dropped.
    The prepared data's (`prepare.pc_range`, via its manifest)."""

    @field_validator("pc_range")
    @classmethod
    def _range(cls, v: list[float]) -> list[float]:
        return check_pc_range(v)

    @model_validator(mode="after")
    def _check(self) -> ModelParams:
        if not self.classes or len(set(self.classes)) != len(self.classes):
            raise ValueError(f"model.classes must be non-empty and unique, got {self.classes}")
        misfit = pillar_misfit(self.pc_range, self.pillar_size_m)
        if misfit is not None:
            name, cells = misfit
            raise ValueError(
                f"model.pc_range {name} extent must be a multiple of pillar_size_m, got {cells:.4f} cells"
            )
        h, w = self.grid
        if h % self.head_stride or w % self.head_stride:
            raise ValueError(
                f"model: the pillar grid (H, W)=({h}, {w}) must be divisible by head_stride={self.head_stride}"
            )
        if self.bev_stem == "space_to_depth" and (h % 2 or w % 2):
            raise ValueError(
                f"model: bev_stem=space_to_depth needs an even pillar grid, got (H, W)=({h}, {w})"
            )
        return self

