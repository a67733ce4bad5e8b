"""Lidar path of prepare: one sweep and its boxes -> the reference frame, cropped and mapped.

In: `points [N, 4]` float32 (x, y, z, intensity) in the lidar frame, the frame's `Boxes3D`
(lidar frame), `T_ref_from_lidar [4, 4]` and the prepare params. Out: `LidarResult` with
`points [P, 4]` float32 and `boxes [K, 7]` float32 in the reference frame, training labels
(`-1` = not a training class, kept), names, difficulty and points per box.

Steps, in this order:
1. sensor -> reference transform (skipped when it is the identity, e.g. KITTI);
2. NaN/Inf removal, ROI crop `min <= p < max` per axis, removal of ego-vehicle returns
   (BEV distance to the sensor below `ego_radius_m`) -- one fused mask;
3. optional voxel down-sampling: the first point (in sweep order) of every occupied voxel;
4. boxes to the reference frame (centre and heading), kept when the centre is in the ROI,
   names mapped to training classes through `class_map`, points counted per box.

The reference frame is the lidar frame rotated onto the ego vehicle's axes (x forward, y
left, z up), with its origin kept at the sensor: KITTI's velodyne is mounted that way
already (identity); nuScenes' LIDAR_TOP is mounted x-right / y-forward, so without the
rotation pc_range's "x forward" would select the vehicle's right side. Keeping the sensor
origin keeps heights comparable across datasets (ground at about -1.7 m in both).

Why NumPy and not DALI's `fn.coord_transform` or torch here: measured on the real KITTI sweeps
(~119k points, 2 shared cores, `benchmarks/bench_prepare.py`), a column-wise NumPy transform
took 0.7-2.5 ms/frame, `fn.coord_transform` 2.9-6.5 ms/frame (batch of 16, feed and copy back
included) and a torch matmul 5-60 ms/frame (a tall-skinny GEMM that BLAS handles poorly); and
the crop, which DALI has no operator for, needs the points in NumPy anyway. `fn.coord_transform`
is used where the data already live in DALI: the train loader's augmentations
(`pfactory.prepare.loader`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pfactory.sensors.frame import Boxes3D
from pfactory.sensors.geometry import count_points_in_boxes


@dataclass
class LidarResult:
    """The lidar part of one prepared frame (reference frame)."""

    points: np.ndarray  # [P, 4] float32
    n_points_raw: int
    boxes: np.ndarray  # [K, 7] float32
    labels: np.ndarray  # [K] int16, -1 = not a training class
    names: list[str]
    difficulty: np.ndarray  # [K] int8
    num_points_in_box: np.ndarray  # [K] int32
    n_points_roi: int = -1  # points inside the ROI and outside the ego radius, before voxel down-sampling


def reference_transform(dataset: Any, frame_id: str, reference_frame: str = "ego_axes") -> np.ndarray:
    """`T_ref_from_lidar [4, 4]` for one frame of `dataset` (see the module docstring).

    `reference_frame="lidar"`: the identity. `ego_axes`: the reader's own rule
    (`DatasetReader.reference_transform`: the identity for KITTI, the rotation of the LIDAR_TOP
    calibrated_sensor record for nuScenes).
    """
    if reference_frame == "lidar":
        return np.eye(4)
    return dataset.reference_transform(frame_id)


def transform_xyz(points: np.ndarray, T: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`points [N, >=3]` -> transformed x, y, z `[N]` float32 each (column-wise: see module doc)."""
    x, y, z = points[:, 0], points[:, 1], points[:, 2]
    if np.array_equal(T, np.eye(4)):
        return x, y, z
    R = T[:3, :3].astype(np.float32)
    t = T[:3, 3].astype(np.float32)
    return tuple(R[k, 0] * x + R[k, 1] * y + R[k, 2] * z + t[k] for k in range(3))  # type: ignore[return-value]


def crop_mask(
    x: np.ndarray,
    y: np.ndarray,
    z: np.ndarray,
    intensity: np.ndarray,
    pc_range: list[float],
    ego_radius_m: float,
) -> np.ndarray:
    """Points to keep `[N]` bool: finite, inside the ROI (`min <= p < max`), outside the ego radius.

    NaN fails every comparison and +-Inf fails a finite range, so the range test removes
    non-finite coordinates without a separate `isfinite` pass; intensity is checked apart.
    """
    x0, y0, z0, x1, y1, z1 = (np.float32(v) for v in pc_range)
    keep = (x >= x0) & (x < x1) & (y >= y0) & (y < y1) & (z >= z0) & (z < z1)
    keep &= np.isfinite(intensity)
    if ego_radius_m > 0:
        keep &= x * x + y * y >= np.float32(ego_radius_m) ** 2
    return keep


def voxel_downsample(points: np.ndarray, voxel_size: list[float], pc_range: list[float]) -> np.ndarray:
    """One point per occupied voxel, the first in sweep order: `[P, 4]` -> `[P', 4]` (P' <= P).

    Voxels are aligned to the ROI's minimum corner; points must already be inside the ROI.
    """
    if len(points) == 0:
        return points
    lo = np.asarray(pc_range[:3], dtype=np.float64)
    size = np.asarray(voxel_size, dtype=np.float64)
    n = np.ceil((np.asarray(pc_range[3:], dtype=np.float64) - lo) / size).astype(np.int64)  # [3]
    idx = np.floor((points[:, :3].astype(np.float64) - lo) / size).astype(np.int64)  # [P, 3]
    idx = np.clip(idx, 0, n - 1)  # float rounding at the max edge
    key = (idx[:, 0] * n[1] + idx[:, 1]) * n[2] + idx[:, 2]  # [P]
    _, first = np.unique(key, return_index=True)
    first.sort()  # keep sweep order: deterministic and cache-friendly
    return points[first]


def boxes_to_reference(boxes: np.ndarray, T: np.ndarray) -> np.ndarray:
    """Boxes `[M, 7]` (lidar frame) -> reference frame: centre transformed, heading rotated."""
    out = np.array(boxes, dtype=np.float64).reshape(-1, 7)
    if len(out) == 0 or np.array_equal(T, np.eye(4)):
        return out
    R, t = T[:3, :3], T[:3, 3]
    out[:, :3] = out[:, :3] @ R.T + t
    heading = np.stack([np.cos(out[:, 6]), np.sin(out[:, 6]), np.zeros(len(out))], 1) @ R.T  # [M, 3]
    out[:, 6] = np.arctan2(heading[:, 1], heading[:, 0])
    return out


def process_lidar(
    points: np.ndarray,
    boxes: Boxes3D,
    T_ref_from_lidar: np.ndarray,
    pc_range: list[float],
    ego_radius_m: float,
    voxel_size: list[float] | None,
    class_map: dict[str, str],
    classes: list[str],
) -> LidarResult:
    """The whole lidar path for one frame (see the module docstring)."""
    n_raw = len(points)
    x, y, z = transform_xyz(points, T_ref_from_lidar)  # [N] each
    keep = crop_mask(x, y, z, points[:, 3], pc_range, ego_radius_m)  # [N]
    pts = np.stack([x[keep], y[keep], z[keep], points[keep, 3]], axis=1).astype(np.float32, copy=False)
    n_roi = len(pts)
    if voxel_size is not None:
        pts = voxel_downsample(pts, voxel_size, pc_range)

    b = boxes_to_reference(boxes.boxes, T_ref_from_lidar)  # [M, 7] float64
    x0, y0, z0, x1, y1, z1 = pc_range
    c = b[:, :3]
    inside = (
        (c[:, 0] >= x0) & (c[:, 0] < x1) & (c[:, 1] >= y0) & (c[:, 1] < y1) & (c[:, 2] >= z0) & (c[:, 2] < z1)
    )
    b = b[inside]
    names = [n for n, k in zip(boxes.names, inside) if k]
    index = {name: i for i, name in enumerate(classes)}
    labels = np.array([index.get(class_map.get(n, ""), -1) for n in names], dtype=np.int16)
    difficulty = np.asarray(boxes.difficulty, dtype=np.int8)[inside]
    counts = count_points_in_boxes(pts, b)  # [K], without a [K, P] matrix
    return LidarResult(pts, n_raw, b.astype(np.float32), labels, names, difficulty, counts, n_roi)
