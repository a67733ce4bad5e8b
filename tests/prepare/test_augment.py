"""Global augmentation: one transform moves points, boxes and camera projections consistently."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pfactory.prepare.augment import (
    AugmentParams,
    GlobalTransform,
    sample_transform,
    transform_boxes,
    transform_points,
    transform_projection,
)
from pfactory.sensors.geometry import box_corners


def _project(P: np.ndarray, pts: np.ndarray) -> np.ndarray:
    uvw = np.concatenate([pts[:, :3], np.ones((len(pts), 1))], 1) @ P.T  # [N, 3]
    return uvw[:, :2] / uvw[:, 2:3]


@pytest.mark.parametrize(
    "t",
    [GlobalTransform(), GlobalTransform(True, 0.0, 1.0), GlobalTransform(False, 0.7, 1.03),
     GlobalTransform(True, -0.6, 0.96), GlobalTransform(True, math.pi / 4, 1.05)],
)  # fmt: skip
def test_points_boxes_and_projection_move_together(t: GlobalTransform) -> None:
    rng = np.random.default_rng(0)
    pts = np.concatenate([rng.uniform([5, -10, -2], [40, 10, 1], (200, 3)), rng.uniform(0, 1, (200, 1))], 1)
    K = np.array([[360.0, 0, 208], [0, 360.0, 64], [0, 0, 1]])
    T = np.array([[0.0, -1, 0, 0.05], [0, 0, -1, -0.08], [1, 0, 0, -0.27], [0, 0, 0, 1]])  # lidar -> cam
    P = K @ T[:3]
    aug_pts = transform_points(pts, t)
    aug_P = transform_projection(P, t)
    # Augmented points through the augmented camera land on the original pixels.
    np.testing.assert_allclose(_project(aug_P, aug_pts), _project(P, pts), atol=1e-3)  # float32 points
    np.testing.assert_array_equal(aug_pts[:, 3], pts[:, 3].astype(np.float32))  # intensity untouched
    # A box's corners transform like points; the box stays a valid (l, w, h > 0) box.
    boxes = np.array([[12.0, 3.0, -1.0, 4.2, 1.8, 1.5, 0.4], [25.0, -6.0, -0.8, 0.7, 0.6, 1.8, -2.9]])
    aug_boxes = transform_boxes(boxes, t)
    corners = box_corners(boxes) @ t.matrix[:3, :3].T  # [M, 8, 3]
    aug_corners = box_corners(aug_boxes)
    # Same corner set (the flip mirrors the corner order, so compare as sets).
    for a, b in zip(aug_corners, corners):
        d = np.linalg.norm(a[:, None] - b[None], axis=-1).min(1)
        assert d.max() < 1e-4
    # And the augmented box's corners project to the original box's pixels.
    np.testing.assert_allclose(
        np.sort(_project(aug_P, aug_corners.reshape(-1, 3)), 0),
        np.sort(_project(P, box_corners(boxes).reshape(-1, 3)), 0),
        atol=1e-3,
    )


def test_transforms_are_deterministic_per_row_and_epoch() -> None:
    p = AugmentParams()
    a = [sample_transform(p, seed=7, epoch=2, row=r) for r in range(50)]
    assert a == [sample_transform(p, seed=7, epoch=2, row=r) for r in range(50)]
    assert a != [sample_transform(p, seed=7, epoch=3, row=r) for r in range(50)]
    assert all(abs(t.rotation) <= math.pi / 4 and 0.95 <= t.scale <= 1.05 for t in a)
    assert 10 < sum(t.flip for t in a) < 40
    assert sample_transform(None, 7, 2, 3) == GlobalTransform()
    with pytest.raises(ValueError, match="lo <= hi"):
        AugmentParams(scale_range=[1.1, 0.9])


def test_box_matrix_equals_the_box_update() -> None:
    t = GlobalTransform(True, 0.5, 1.02)
    M, T = t.box_matrix
    b = np.array([[10.0, 2.0, -1.0, 4.0, 2.0, 1.5, 0.3]])
    np.testing.assert_allclose(b @ M.T + T, transform_boxes(b, t), atol=1e-5)
