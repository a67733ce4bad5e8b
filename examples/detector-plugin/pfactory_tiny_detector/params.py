"""`model.tiny_bev`: the hyper-parameters of the tiny BEV detector (its own params section).

The factory validates this section with this schema when `model.arch: tiny_bev` is selected: unknown keys
are refused, naming the key (`pfactory.config.section.Section`). The defaults are the architecture's defaults, so
nothing needs to be written in params.yaml; override a value with `-S model.tiny_bev.<key>=<value>` or under
`model: tiny_bev:` in params.yaml. The classes and the point-cloud range are NOT set here: they are facts of
the prepared data (`prepare.classes`, `prepare.pc_range`) and reach `build` in the `DataSpec`.

Units: metres in the lidar frame (x forward, y left, z up); BEV cells are square, `cell_m` on a side.
Sized so that a CPU trains it in about a minute on the factory's small runs (12-50 frames, a few epochs):
at the default range (70.4 x 80 m) and 0.8 m cells the grid is 100 x 88 cells, ~30 k weights.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pfactory.config.section import NonNegFloat, PositiveFloat, PositiveInt, Section


class TinyBevParams(Section):
    """`model.tiny_bev` (module docstring)."""

    cell_m: PositiveFloat = 0.8
    """Side of a BEV grid cell, metres. The (x, y) extents of `prepare.pc_range` must be multiples of it."""
    stem_channels: PositiveInt = 16
    """Channels of the full-resolution convs (the stem, and the head's shared conv)."""
    down_channels: PositiveInt = 32
    """Channels of the stride-2 stage (upsampled back and concatenated with the stem's output)."""
    down_blocks: Annotated[int, Field(ge=0, le=4)] = 1
    """Extra 3x3 convs after the strided conv of the stride-2 stage."""
    norm_groups: PositiveInt = 4
    """GroupNorm groups (a sample's output does not depend on its batch: DDP- and export-safe)."""
    heatmap_weight: NonNegFloat = 1.0
    """Weight of the focal heatmap loss."""
    reg_weight: NonNegFloat = 0.5
    """Weight of the L1 box regression loss (offset x/y, z, log l/w/h, sin/cos yaw)."""
    focal_alpha: PositiveFloat = 2.0
    """Focal exponent on the predicted probability (CenterNet: 2)."""
    focal_beta: PositiveFloat = 4.0
    """Exponent of the penalty reduction around a target peak (CenterNet: 4)."""
    gaussian_overlap: Annotated[float, Field(gt=0, lt=1)] = 0.1
    """CenterNet `min_overlap` of the Gaussian radius of a target peak."""
    min_radius: Annotated[int, Field(ge=0, le=8)] = 1
    """Smallest Gaussian radius, cells."""
    max_detections: PositiveInt = 50
    """Top-K peaks decoded per frame (fixed: the exported graph has static output shapes)."""
    nms_kernel: Literal[1, 3, 5] = 3
    """Max-pool window of the peak extraction (1: every cell is a candidate)."""

    @model_validator(mode="after")
    def _groups_divide_channels(self) -> TinyBevParams:
        for name in ("stem_channels", "down_channels"):
            if getattr(self, name) % self.norm_groups:
                raise ValueError(
                    f"{name}={getattr(self, name)} must be divisible by norm_groups={self.norm_groups}"
                )
        return self
