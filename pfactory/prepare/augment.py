"""Global augmentations shared by lidar and cameras: one random similarity transform per frame.

Per frame, `A = S(s) @ Rz(theta) @ F`, a 4x4 acting on reference-frame points:
- `F`: mirror about the x axis (y -> -y) with probability `flip_prob`;
- `Rz(theta)`: rotation about +z, theta uniform in `[-rotation_rad, rotation_rad]`;
- `S(s)`: isotropic scaling, s uniform in `scale_range`.
Applied consistently:
- points: `p' = A p` (intensity unchanged);
- boxes: centre' = `A c`, (l, w, h)' = `s (l, w, h)`, yaw' = `f yaw + theta` (f = -1 when
  flipped) -- not wrapped, use sin/cos of it;
- cameras: `P' = P @ A^-1`, so projecting an augmented point with the augmented matrix gives the
  pixel the original point had in the unchanged image (`P' A p = P p`).
The parameters are drawn from `np.random.default_rng([seed, epoch, row])` (row = the frame's
position in its split), so a frame's transform depends neither on the batch it lands in nor on
the worker that builds it: the DALI loader and the PyTorch reference agree exactly, and a
resumed run sees the same transforms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator


class AugmentParams(BaseModel):
    """Global augmentation ranges (train stage; `None` instead of this = no augmentation)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    flip_prob: float = Field(0.5, ge=0, le=1)
    """Probability of mirroring the scene about the x axis (y -> -y)."""
    rotation_rad: float = Field(math.pi / 4, ge=0, le=math.pi)
    """Rotation about +z, uniform in [-rotation_rad, rotation_rad]."""
    scale_range: list[float] = Field(default_factory=lambda: [0.95, 1.05])
    """Isotropic scale, uniform in [lo, hi]."""

    @field_validator("scale_range")
    @classmethod
    def _scale(cls, v: list[float]) -> list[float]:
        if len(v) != 2 or not 0 < v[0] <= v[1]:
            raise ValueError("[lo, hi] with 0 < lo <= hi")
        return v


@dataclass(frozen=True)
class GlobalTransform:
    """One frame's augmentation: mirror flag, rotation (rad), scale."""

    flip: bool = False
    rotation: float = 0.0
    scale: float = 1.0

    @property
    def matrix(self) -> np.ndarray:
        """`A [4, 4]` float64 = S Rz F (no translation)."""
        c, s = math.cos(self.rotation), math.sin(self.rotation)
        A = np.eye(4)
        A[:3, :3] = (
            self.scale
            * np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
            @ np.diag([1.0, -1.0 if self.flip else 1.0, 1.0])
        )
        return A

    @property
    def box_matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """`(M [7, 7], T [7])` with `box' = M box + T` for a (x, y, z, l, w, h, yaw) row.

        The whole box update as one affine map, so DALI applies it with one `coord_transform`.
        """
        M = np.zeros((7, 7))
        M[:3, :3] = self.matrix[:3, :3]
        M[3:6, 3:6] = self.scale * np.eye(3)
        M[6, 6] = -1.0 if self.flip else 1.0
        T = np.zeros(7)
        T[6] = self.rotation
        return M, T


IDENTITY = GlobalTransform()


def sample_transform(params: AugmentParams | None, seed: int, epoch: int, row: int) -> GlobalTransform:
    """The transform of split row `row` in `epoch` (identity when `params` is None)."""
    if params is None:
        return IDENTITY
    rng = np.random.default_rng([seed, epoch, row])
    flip = bool(rng.random() < params.flip_prob)
    rotation = float(rng.uniform(-params.rotation_rad, params.rotation_rad))
    scale = float(rng.uniform(*params.scale_range))
    return GlobalTransform(flip, rotation, scale)


def transform_points(points: np.ndarray, t: GlobalTransform) -> np.ndarray:
    """`[N, 4]` (x, y, z, intensity) -> augmented `[N, 4]` float32."""
    out = np.array(points, dtype=np.float32, copy=True)
    out[:, :3] = points[:, :3] @ t.matrix[:3, :3].T.astype(np.float32)
    return out


def transform_boxes(boxes: np.ndarray, t: GlobalTransform) -> np.ndarray:
    """`[M, 7]` -> augmented `[M, 7]` float32 (yaw = f yaw + theta, not wrapped)."""
    out = np.array(boxes, dtype=np.float64).reshape(-1, 7)
    out[:, :3] = out[:, :3] @ t.matrix[:3, :3].T
    out[:, 3:6] *= t.scale
    out[:, 6] = (-1.0 if t.flip else 1.0) * out[:, 6] + t.rotation
    return out.astype(np.float32)


def transform_projection(P: np.ndarray, t: GlobalTransform) -> np.ndarray:
    """`[..., 3, 4]` camera projections -> `P @ A^-1` (same pixels for augmented points)."""
    return np.asarray(P, dtype=np.float64) @ np.linalg.inv(t.matrix)
