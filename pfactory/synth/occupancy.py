"""Collision bookkeeping for scene placement: BEV footprints with a height range, so objects never
interpenetrate (but may occlude each other)."""

from __future__ import annotations

import numpy as np


class Occupancy:
    """Footprints placed so far: oriented rectangles with a height range, `[K, 7]` rows of
    `(x, y, l, w, yaw, z0, z1)`. Used to keep objects from interpenetrating."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, ...]] = []
        self._arr: np.ndarray | None = None

    def add(self, x, y, l, w, yaw, z0, z1) -> None:
        self.rows.append((x, y, l, w, yaw, z0, z1))
        self._arr = None

    def collides(self, x, y, l, w, yaw, z0, z1, margin: float = 0.25) -> bool:
        if not self.rows:
            return False
        if self._arr is None:
            self._arr = np.array(self.rows)
        b = self._arr
        # Cheap circle test first; then the separating-axis test on the few candidates.
        r_a = 0.5 * np.hypot(l, w) + margin
        r_b = 0.5 * np.hypot(b[:, 2], b[:, 3])
        near = (np.hypot(b[:, 0] - x, b[:, 1] - y) < r_a + r_b) & (b[:, 5] < z1) & (b[:, 6] > z0)
        if not near.any():
            return False
        b = b[near]
        ca = _rect_corners(np.array([[x, y, l + 2 * margin, w + 2 * margin, yaw]]))[0]  # [4, 2]
        cb = _rect_corners(b[:, :5])  # [K, 4, 2]
        axes = [np.array([np.cos(yaw), np.sin(yaw)]), np.array([-np.sin(yaw), np.cos(yaw)])]
        separated = np.zeros(len(b), dtype=bool)
        for ax in axes:
            pa, pb = ca @ ax, cb @ ax  # [4], [K, 4]
            separated |= (pb.max(1) < pa.min()) | (pb.min(1) > pa.max())
        for ax in (
            np.stack([np.cos(b[:, 4]), np.sin(b[:, 4])], 1),
            np.stack([-np.sin(b[:, 4]), np.cos(b[:, 4])], 1),
        ):
            pa = ca @ ax.T  # [4, K]
            pb = np.einsum("kcd,kd->kc", cb, ax)  # [K, 4]
            separated |= (pb.max(1) < pa.min(0)) | (pb.min(1) > pa.max(0))
        return bool((~separated).any())


def _rect_corners(r: np.ndarray) -> np.ndarray:
    """BEV corners `[K, 4, 2]` of rectangles `[K, 5]` (x, y, l, w, yaw)."""
    c, s = np.cos(r[:, 4]), np.sin(r[:, 4])
    lx = np.array([0.5, -0.5, -0.5, 0.5])[None] * r[:, 2:3]
    ly = np.array([0.5, 0.5, -0.5, -0.5])[None] * r[:, 3:4]
    return np.stack(
        [r[:, 0:1] + c[:, None] * lx - s[:, None] * ly, r[:, 1:2] + s[:, None] * lx + c[:, None] * ly], -1
    )
