"""Parameters of the `centerpoint_lidar` architecture: the `model.centerpoint_lidar` section of params.yaml.

In: that section (validated with `CenterPointLidarParams` when `model.arch: centerpoint_lidar` selects it;
unknown keys are refused, naming the key). `classes` and `pc_range` are the prepared data's (`DataSpec`),
given to `build`; `Geometry` combines them with the section into what the network is built from.
Units: metres in the lidar frame (x forward, y left, z up); BEV cells are square. The defaults are sized to
train in a few minutes on a 2-core CPU at the default data size (docs/models/centerpoint_lidar.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, model_validator

from pfactory.config.section import (
    NonNegFloat,
    PillarGrid,
    PositiveFloat,
    PositiveInt,
    Section,
    pillar_misfit,
)

BOX_CHANNELS = ("off_x", "off_y", "z", "log_l", "log_w", "log_h")


class CenterPointLidarParams(Section):
    """`model.centerpoint_lidar`: lidar-only pillars, one center head per class group, and the heading as
    direction-bin classification + a per-bin sin/cos residual (docs/models/centerpoint_lidar.md)."""

    pillar_size_m: PositiveFloat = 0.4
    """Side of a square pillar, metres. The (x, y) extents of the data's pc_range must be multiples."""
    point_channels: PositiveInt = 32
    """Channels of the per-point MLP output, i.e. of the scattered BEV pillar canvas."""
    point_layers: Annotated[int, Field(ge=1, le=3)] = 2
    """Linear + LayerNorm + ReLU layers of the per-point MLP. Two (PointPillars has one): the max over a
    pillar's points of a nonlinear feature keeps more of the small shapes (a pedestrian is 1-4 pillars)
    that the heading of pedestrians and cyclists is read from."""
    bev_channels: list[PositiveInt] = Field(default_factory=lambda: [32, 64, 128])
    """Channels of the BEV backbone stages (stage i runs at stride prod(bev_strides[:i+1]))."""
    bev_strides: list[PositiveInt] = Field(default_factory=lambda: [2, 2, 2])
    """Stride of each stage's first conv, relative to the previous stage (the first reads the canvas)."""
    bev_blocks: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [1, 2, 2])
    """Extra 3x3 convs after each stage's strided conv."""
    up_channels: PositiveInt = 32
    """Channels each stage is projected to at the head stride (concatenated: len(stages) * up_channels)."""
    head_stride: PositiveInt = 2
    """Output stride of the heads w.r.t. the pillar grid: head cell = pillar_size_m * head_stride."""
    head_channels: PositiveInt = 32
    """Channels of the shared 3x3 head conv and of each group's own 3x3 conv."""
    class_groups: list[list[str]] | None = None
    """Classes that share one head (heatmap, box and heading convs), e.g. [[Car], [Pedestrian, Cyclist]];
    every class of the data exactly once. null: one head per class (CenterPoint's task heads)."""
    heading_bins: Annotated[int, Field(ge=2, le=12)] = 4
    """Direction bins of the heading: bin k is centred at k * 2 pi / n (wrapped to (-pi, pi]); the head
    classifies the bin and regresses sin/cos of the yaw's residual to that bin's centre, one pair per bin."""
    heatmap_weight: NonNegFloat = 1.0
    """Weight of the focal heatmap loss."""
    box_weight: NonNegFloat = 0.25
    """Weight of the L1 loss on offset, z and log-size (CenterPoint: 0.25)."""
    dir_cls_weight: NonNegFloat = 0.4
    """Weight of the direction-bin cross-entropy."""
    dir_res_weight: NonNegFloat = 0.5
    """Weight of the L1 loss on the target bin's residual (sin, cos)."""
    refine: bool = True
    """The second stage (`refine.py`): each detection's heading turned by the quarter turn that a fine,
    box-aligned raster of its points says points forward. false: the first stage's heading as it is."""
    refine_cell_m: PositiveFloat = 0.1
    """BEV cell of the fine raster, metres (the data's x and y extents must be multiples)."""
    refine_slices: Annotated[int, Field(ge=1, le=16)] = 6
    """Height slices of the fine raster over `refine_z_range` (feet, legs, hips, torso, shoulders, head)."""
    refine_z_range: tuple[float, float] = (-2.0, 0.4)
    """Heights (lidar z, metres) the slices cover: from below the road to above a rider's head."""
    refine_grid: Annotated[int, Field(ge=4, le=32)] = 16
    """Samples per side of a detection's square patch (side max(l, w) + 2 * refine_margin_m)."""
    refine_margin_m: NonNegFloat = 0.25
    """Margin around the box in its patch, metres."""
    refine_channels: PositiveInt = 16
    """Channels of the refiner's first conv (the second has twice as many)."""
    refine_weight: NonNegFloat = 0.5
    """Weight of the refiner's cross-entropy over the four turns."""
    refine_jitter_m: NonNegFloat = 0.1
    """Training views: standard deviation of the centre jitter, metres (the first stage's centre error)."""
    refine_jitter_rad: NonNegFloat = 0.08
    """Training views: standard deviation of the yaw jitter, rad."""
    refine_point_heading: bool = True
    """With `refine`: near-square boxes (people) take their heading from the moments of their own points
    (`point_heading.py`) instead of a quarter turn of the first stage's. false: every box as the rest."""
    refine_square_aspect: Annotated[float, Field(ge=1.0)] = 1.5
    """A box is near square when max(l, w) / min(l, w) <= this (pedestrians ~1.1; cyclists, cars > 2)."""
    refine_point_bins: Annotated[int, Field(ge=4, le=64)] = 16
    """Candidate headings of the point heading, every 2 pi / n; the result is their softmax-weighted
    circular mean."""
    refine_points: Annotated[int, Field(ge=8, le=1024)] = 256
    """Points gathered per detection (the nearest to its BEV centre; those beyond max(l, w) / 2 +
    refine_margin_m are dropped)."""
    refine_point_slices: Annotated[int, Field(ge=1, le=16)] = 6
    """Height slices of the box the point moments are taken over (feet ... head)."""
    refine_point_hidden: PositiveInt = 128
    """Width of the point heading's MLP (two hidden layers)."""
    refine_point_views: Annotated[int, Field(ge=1, le=16)] = 4
    """Training views per near-square ground-truth box per step, each from a random heading."""
    refine_point_weight: NonNegFloat = 0.5
    """Weight of the point heading's cross-entropy over the candidates."""
    norm_groups: PositiveInt = 8
    """GroupNorm groups (every channel count must be divisible): batch-independent, export-friendly."""
    gaussian_overlap: Annotated[float, Field(gt=0, lt=1)] = 0.1
    """CenterPoint `min_overlap` for the Gaussian radius of a target peak."""
    min_radius: Annotated[int, Field(ge=0)] = 2
    """Smallest Gaussian radius, head cells."""
    max_detections: PositiveInt = 100
    """Top-K peaks kept per frame (fixed: the exported graph has static shapes)."""
    nms_kernel: Literal[1, 3, 5] = 3
    """Max-pool window of the peak extraction (1 disables it)."""

    @model_validator(mode="after")
    def _check(self) -> CenterPointLidarParams:
        if not (len(self.bev_channels) == len(self.bev_strides) == len(self.bev_blocks)):
            raise ValueError("bev_channels, bev_strides and bev_blocks need one entry per stage")
        strides = [math.prod(self.bev_strides[: i + 1]) for i in range(len(self.bev_strides))]
        if self.head_stride != 1 and self.head_stride not in strides:
            raise ValueError(
                f"head_stride must be 1 or one of the stage strides {strides}, got {self.head_stride}"
            )
        for c in (*self.bev_channels, self.up_channels, self.head_channels):
            if c % self.norm_groups:
                raise ValueError(
                    f"every BEV/head channel count must be divisible by norm_groups={self.norm_groups}, got {c}"
                )
        if not self.refine_z_range[0] < self.refine_z_range[1]:
            raise ValueError(
                f"refine_z_range must be [low, high] with low < high, got {list(self.refine_z_range)}"
            )
        if self.class_groups is not None:
            flat = [c for g in self.class_groups for c in g]
            if not all(self.class_groups) or len(set(flat)) != len(flat):
                raise ValueError(f"class_groups: non-empty groups, each class once; got {self.class_groups}")
        return self

    @property
    def reg_channels(self) -> tuple[str, ...]:
        """Channels of a group head's regression map, in order: box, then bin logits, then residuals."""
        n = self.heading_bins
        bins = tuple(f"bin{k}" for k in range(n))
        res = tuple(f"{t}{k}" for k in range(n) for t in ("res_sin", "res_cos"))
        return BOX_CHANNELS + bins + res


@dataclass(frozen=True)
class Geometry(PillarGrid):
    """The section plus the data's range and classes: grids, head groups (what `build` derives).

    Also the attributes `pfactory.archs.painted_pillars.pillars.PillarEncoder` reads (pc_range, pillar_size_m, grid,
    bev_stem, point_channels, point_layers)."""

    pc_range: tuple[float, float, float, float, float, float]
    pillar_size_m: float
    point_channels: int
    point_layers: int
    head_stride: int
    classes: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...]  # class indices per head, in head order
    bev_stem: str = "conv3x3"

    @classmethod
    def of(cls, p: CenterPointLidarParams, classes: tuple[str, ...], pc_range: tuple[float, ...]) -> Geometry:
        """Validated geometry; ValueError naming the key when the section does not fit the data."""
        classes = tuple(classes)
        if not classes or len(set(classes)) != len(classes):
            raise ValueError(f"the data's classes must be non-empty and unique, got {classes}")
        if p.class_groups is None:
            groups = tuple((i,) for i in range(len(classes)))
        else:
            flat = [c for g in p.class_groups for c in g]
            if sorted(flat) != sorted(classes):
                raise ValueError(
                    f"model.centerpoint_lidar.class_groups {p.class_groups} must list every class of the data "
                    f"{list(classes)} exactly once"
                )
            groups = tuple(tuple(classes.index(c) for c in g) for g in p.class_groups)
        misfit = pillar_misfit(pc_range, p.pillar_size_m)
        if misfit is not None:
            name, cells = misfit
            raise ValueError(
                f"model.centerpoint_lidar.pillar_size_m: the {name} extent of pc_range {list(pc_range)} "
                f"must be a multiple of it ({cells:.4f} pillars)"
            )
        if p.refine and (misfit := pillar_misfit(pc_range, p.refine_cell_m)) is not None:
            name, cells = misfit
            raise ValueError(
                f"model.centerpoint_lidar.refine_cell_m: the {name} extent of pc_range {list(pc_range)} "
                f"must be a multiple of it ({cells:.4f} cells)"
            )
        geo = cls(tuple(float(v) for v in pc_range), float(p.pillar_size_m), p.point_channels,  # type: ignore[arg-type]
                  p.point_layers, p.head_stride, classes, groups)  # fmt: skip
        h, w = geo.grid
        if h % p.head_stride or w % p.head_stride:
            raise ValueError(
                f"model.centerpoint_lidar.head_stride: the pillar grid (H, W)=({h}, {w}) must be divisible by it"
            )
        return geo

    @property
    def order(self) -> tuple[int, ...]:
        """Class index of each heatmap channel (the heads' classes, concatenated in head order)."""
        return tuple(c for g in self.groups for c in g)

    @property
    def group_of_class(self) -> tuple[int, ...]:
        """Head index of each class."""
        out = [0] * len(self.classes)
        for gi, g in enumerate(self.groups):
            for c in g:
                out[c] = gi
        return tuple(out)
