"""3D geometry shared by readers, the synthetic generator, the model and the KPIs.

Conventions (DESIGN.md §4):
- lidar frame: x forward, y left, z up, metres.
- a box is `(x, y, z, l, w, h, yaw)` in the lidar frame: centre (z at the box centre), length
  along the heading, width across it, height along +z, yaw about +z from +x (radians).
- transforms are 4x4 homogeneous matrices named `T_<to>_from_<from>`; `T_cam_from_lidar @ p_lidar`.
- a camera projects camera-frame points (x right, y down, z forward) with intrinsics `K [3, 3]`.
"""

from __future__ import annotations

import numpy as np

# Corner order of `box_corners`: bottom face counter-clockwise from front-left, then the top
# face in the same order. Edges below index into it (used by renderers).
BOX_EDGES: tuple[tuple[int, int], ...] = (
    (0, 1), (1, 2), (2, 3), (3, 0),  # bottom
    (4, 5), (5, 6), (6, 7), (7, 4),  # top
    (0, 4), (1, 5), (2, 6), (3, 7),  # pillars
)  # fmt: skip


def rot_z(yaw: float | np.ndarray) -> np.ndarray:
    """Rotation matrix about +z: scalar -> [3, 3]; array [M] -> [M, 3, 3]."""
    c, s = np.cos(yaw), np.sin(yaw)
    z, o = np.zeros_like(c), np.ones_like(c)
    m = np.stack([np.stack([c, -s, z], -1), np.stack([s, c, z], -1), np.stack([z, z, o], -1)], -2)
    return m


def make_transform(R: np.ndarray, t: np.ndarray) -> np.ndarray:
    """4x4 homogeneous transform from rotation `R [3, 3]` and translation `t [3]`."""
    T = np.eye(4)
    T[:3, :3] = R
    T[:3, 3] = np.asarray(t, dtype=np.float64).reshape(3)
    return T


def invert_transform(T: np.ndarray) -> np.ndarray:
    """Inverse of a rigid 4x4 transform (rotation transposed, translation rotated back)."""
    R, t = T[:3, :3], T[:3, 3]
    Ti = np.eye(4)
    Ti[:3, :3] = R.T
    Ti[:3, 3] = -R.T @ t
    return Ti


def transform_points(T: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Apply a 4x4 transform to `points [N, >=3]`; columns past xyz are passed through."""
    out = np.array(points, dtype=np.float64, copy=True)
    out[:, :3] = points[:, :3] @ T[:3, :3].T + T[:3, 3]
    return out


def quaternion_to_matrix(q: np.ndarray) -> np.ndarray:
    """Rotation matrix [3, 3] from a unit quaternion `(w, x, y, z)` (nuScenes order)."""
    w, x, y, z = np.asarray(q, dtype=np.float64) / np.linalg.norm(q)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
            [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
            [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
        ]
    )


def matrix_to_quaternion(R: np.ndarray) -> np.ndarray:
    """Unit quaternion `(w, x, y, z)` with w >= 0 from a rotation matrix [3, 3]."""
    R = np.asarray(R, dtype=np.float64)
    tr = np.trace(R)
    if tr > 0:
        s = np.sqrt(tr + 1.0) * 2
        q = [0.25 * s, (R[2, 1] - R[1, 2]) / s, (R[0, 2] - R[2, 0]) / s, (R[1, 0] - R[0, 1]) / s]
    elif R[0, 0] > R[1, 1] and R[0, 0] > R[2, 2]:
        s = np.sqrt(1.0 + R[0, 0] - R[1, 1] - R[2, 2]) * 2
        q = [(R[2, 1] - R[1, 2]) / s, 0.25 * s, (R[0, 1] + R[1, 0]) / s, (R[0, 2] + R[2, 0]) / s]
    elif R[1, 1] > R[2, 2]:
        s = np.sqrt(1.0 + R[1, 1] - R[0, 0] - R[2, 2]) * 2
        q = [(R[0, 2] - R[2, 0]) / s, (R[0, 1] + R[1, 0]) / s, 0.25 * s, (R[1, 2] + R[2, 1]) / s]
    else:
        s = np.sqrt(1.0 + R[2, 2] - R[0, 0] - R[1, 1]) * 2
        q = [(R[1, 0] - R[0, 1]) / s, (R[0, 2] + R[2, 0]) / s, (R[1, 2] + R[2, 1]) / s, 0.25 * s]
    q = np.asarray(q)
    q /= np.linalg.norm(q)
    return q if q[0] >= 0 else -q


def yaw_from_matrix(R: np.ndarray) -> float:
    """Heading about +z of the rotated +x axis of `R [3, 3]`."""
    return float(np.arctan2(R[1, 0], R[0, 0]))


def box_corners(boxes: np.ndarray) -> np.ndarray:
    """Corners of boxes `[M, 7]` (x, y, z, l, w, h, yaw) -> `[M, 8, 3]` in the same frame.

    Order: bottom face (front-left, rear-left, rear-right, front-right), then the top face.
    """
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 7)
    l, w, h = boxes[:, 3:4], boxes[:, 4:5], boxes[:, 5:6]  # [M, 1] each
    sx = np.array([0.5, -0.5, -0.5, 0.5, 0.5, -0.5, -0.5, 0.5])
    sy = np.array([0.5, 0.5, -0.5, -0.5, 0.5, 0.5, -0.5, -0.5])
    sz = np.array([-0.5, -0.5, -0.5, -0.5, 0.5, 0.5, 0.5, 0.5])
    local = np.stack([l * sx, w * sy, h * sz], -1)  # [M, 8, 3]
    R = rot_z(boxes[:, 6])  # [M, 3, 3]
    return local @ R.transpose(0, 2, 1) + boxes[:, None, :3]


def points_in_boxes(points: np.ndarray, boxes: np.ndarray, margin: float = 0.0) -> np.ndarray:
    """Which points lie in which boxes: `points [N, >=3]`, `boxes [M, 7]` -> bool `[M, N]`.

    `margin` (metres) grows every box on all sides (useful for labels drawn tight).
    """
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 7)
    pts = np.asarray(points, dtype=np.float64)[:, :3]
    out = np.zeros((len(boxes), len(pts)), dtype=bool)
    for i, b in enumerate(boxes):
        # Cheap BEV pre-filter by the bounding circle before the exact rotated test.
        r = 0.5 * np.hypot(b[3], b[4]) + margin
        near = np.flatnonzero((np.abs(pts[:, 0] - b[0]) <= r) & (np.abs(pts[:, 1] - b[1]) <= r))
        d = pts[near] - b[:3]
        c, s = np.cos(b[6]), np.sin(b[6])
        lx = d[:, 0] * c + d[:, 1] * s  # coordinates in the box frame
        ly = -d[:, 0] * s + d[:, 1] * c
        inside = (
            (np.abs(lx) <= b[3] / 2 + margin)
            & (np.abs(ly) <= b[4] / 2 + margin)
            & (np.abs(d[:, 2]) <= b[5] / 2 + margin)
        )
        out[i, near[inside]] = True
    return out


def count_points_in_boxes(points: np.ndarray, boxes: np.ndarray, margin: float = 0.0) -> np.ndarray:
    """Points inside each box: `points [N, >=3]`, `boxes [M, 7]` -> int32 `[M]` (`points_in_boxes(...).sum(1)`
    without its `[M, N]` matrix: memory stays O(N) whatever the number of boxes)."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 7)
    pts = np.asarray(points, dtype=np.float64)[:, :3]
    out = np.zeros(len(boxes), dtype=np.int32)
    for i, b in enumerate(boxes):
        r = 0.5 * np.hypot(b[3], b[4]) + margin
        near = np.flatnonzero((np.abs(pts[:, 0] - b[0]) <= r) & (np.abs(pts[:, 1] - b[1]) <= r))
        d = pts[near] - b[:3]
        c, s = np.cos(b[6]), np.sin(b[6])
        lx = d[:, 0] * c + d[:, 1] * s
        ly = -d[:, 0] * s + d[:, 1] * c
        out[i] = int(
            (
                (np.abs(lx) <= b[3] / 2 + margin)
                & (np.abs(ly) <= b[4] / 2 + margin)
                & (np.abs(d[:, 2]) <= b[5] / 2 + margin)
            ).sum()
        )
    return out


def project_to_image(
    points_lidar: np.ndarray, T_cam_from_lidar: np.ndarray, K: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Project lidar-frame points `[N, >=3]` into an image.

    Returns `uv [N, 2]` pixel coordinates (u right, v down; NaN behind the camera) and
    `depth [N]` (metres along the camera's optical axis; <= 0 means behind the camera).
    """
    p_cam = points_lidar[:, :3] @ T_cam_from_lidar[:3, :3].T + T_cam_from_lidar[:3, 3]  # [N, 3]
    depth = p_cam[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        uvw = p_cam @ np.asarray(K, dtype=np.float64).T  # [N, 3]
        uv = uvw[:, :2] / uvw[:, 2:3]
    uv[depth <= 1e-6] = np.nan
    return uv, depth


def box_to_image_rect(
    box: np.ndarray, T_cam_from_lidar: np.ndarray, K: np.ndarray, image_size: tuple[int, int]
) -> np.ndarray | None:
    """Axis-aligned 2D bounding rectangle `[x1, y1, x2, y2]` of a box's projected corners.

    Clipped to the image `(width, height)`; None when any corner is behind the camera or
    the rectangle falls outside the image.
    """
    uv, depth = project_to_image(box_corners(box)[0], T_cam_from_lidar, K)
    if np.any(depth <= 0.1):
        return None
    w, h = image_size
    x1, y1 = np.clip(uv.min(0), 0, [w - 1, h - 1])
    x2, y2 = np.clip(uv.max(0), 0, [w - 1, h - 1])
    if x2 <= x1 or y2 <= y1:
        return None
    return np.array([x1, y1, x2, y2])
