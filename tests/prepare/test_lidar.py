"""Lidar path: reference transform, crop, ego and NaN removal, voxels, boxes and class mapping."""

from __future__ import annotations

import numpy as np

from pfactory.prepare.lidar import (
    boxes_to_reference,
    process_lidar,
    reference_transform,
    voxel_downsample,
)
from pfactory.sensors.datasets import open_dataset
from pfactory.sensors.frame import Boxes3D
from pfactory.sensors.geometry import box_corners, make_transform, rot_z

RANGE = [0.0, -40.0, -3.0, 70.4, 40.0, 1.0]
CLASSES = ["Car", "Pedestrian", "Cyclist"]
CLASS_MAP = {"Car": "Car", "Pedestrian": "Pedestrian", "vehicle.car": "Car"}


def _run(points, boxes=None, T=None, voxel=None, ego=2.0):
    return process_lidar(
        np.asarray(points, dtype=np.float32),
        boxes or Boxes3D.empty(),
        np.eye(4) if T is None else T,
        RANGE,
        ego,
        voxel,
        CLASS_MAP,
        CLASSES,
    )


def test_crop_removes_out_of_range_ego_and_non_finite_points_keeping_order() -> None:
    pts = np.array(
        [
            [10.0, 0.0, -1.0, 0.5],  # kept
            [1.0, 0.5, -1.0, 0.1],  # ego (BEV 1.1 m < 2 m)
            [80.0, 0.0, -1.0, 0.1],  # beyond x_max
            [70.4, 0.0, -1.0, 0.1],  # x == x_max: out (half-open range)
            [0.0, 39.9, -3.0, 0.2],  # on x_min / z_min: in
            [5.0, 0.0, 1.5, 0.1],  # above z_max
            [np.nan, 1.0, 0.0, 0.1],  # NaN coordinate
            [5.0, np.inf, 0.0, 0.1],  # Inf coordinate
            [5.0, 1.0, 0.0, np.nan],  # NaN intensity
            [-5.0, 0.0, 0.0, 0.3],  # behind: out of the default ROI
            [30.0, -20.0, 0.5, 0.9],  # kept
        ]
    )
    res = _run(pts)
    np.testing.assert_array_equal(res.points, pts[[0, 4, 10]].astype(np.float32))
    assert res.n_points_raw == len(pts) and res.points.dtype == np.float32


def test_reference_transform_moves_points_and_boxes_together() -> None:
    T = make_transform(rot_z(-np.pi / 2), [0.0, 0.0, 0.0])  # nuScenes-like: lidar x = ego right
    # An object 20 m ahead of the vehicle sits at lidar (0, 20) when lidar y points forward.
    box = Boxes3D(
        np.array([[0.0, 20.0, -1.0, 4.0, 2.0, 1.5, np.pi / 2]]), ["vehicle.car"], np.array([-1], np.int8)
    )
    pts = np.array([[0.0, 20.0, -1.0, 0.5], [0.5, 19.0, -0.5, 0.5], [-20.0, 0.0, -1.0, 0.5]])
    res = _run(pts, box, T)
    np.testing.assert_allclose(res.boxes[0, :3], [20.0, 0.0, -1.0], atol=1e-5)
    assert abs(res.boxes[0, 6]) < 1e-6  # heading now along +x
    assert res.labels.tolist() == [0] and res.names == ["vehicle.car"]
    np.testing.assert_allclose(res.points[:, :2], [[20.0, 0.0], [19.0, -0.5]], atol=1e-5)
    assert res.num_points_in_box.tolist() == [2]
    # Corners: transforming the box equals transforming its corners.
    b = boxes_to_reference(box.boxes, T)
    np.testing.assert_allclose(box_corners(b)[0], box_corners(box.boxes)[0] @ T[:3, :3].T, atol=1e-9)


def test_boxes_outside_the_roi_are_dropped_and_unknown_classes_get_minus_one() -> None:
    boxes = Boxes3D(
        np.array(
            [
                [10.0, 0.0, -1.0, 4.0, 2.0, 1.5, 0.0],  # Car, inside
                [90.0, 0.0, -1.0, 4.0, 2.0, 1.5, 0.0],  # Car, beyond x_max
                [20.0, 5.0, -1.0, 8.0, 2.5, 3.0, 0.3],  # Truck (not a training class), inside
                [15.0, -3.0, -0.9, 0.6, 0.6, 1.7, 1.0],  # Pedestrian, inside
            ]
        ),
        ["Car", "Car", "Truck", "Pedestrian"],
        np.array([0, 1, 2, -1], np.int8),
    )
    res = _run(np.array([[10.0, 0.2, -1.0, 0.5], [10.5, -0.3, -0.5, 0.5], [15.0, -3.0, -0.5, 0.1]]), boxes)
    assert res.names == ["Car", "Truck", "Pedestrian"]
    assert res.labels.tolist() == [0, -1, 1]
    assert res.difficulty.tolist() == [0, 2, -1]
    assert res.num_points_in_box.tolist() == [2, 0, 1]
    assert res.boxes.dtype == np.float32 and res.boxes.shape == (3, 7)


def test_voxel_downsample_keeps_the_first_point_of_each_voxel() -> None:
    pts = np.array(
        [[1.05, 0.05, 0.05, 0.1], [1.09, 0.01, 0.02, 0.2], [1.25, 0.05, 0.05, 0.3], [1.01, 0.02, 0.09, 0.4]],
        dtype=np.float32,
    )
    out = voxel_downsample(pts, [0.1, 0.1, 0.1], [0.0, -40.0, -3.0, 70.4, 40.0, 1.0])
    np.testing.assert_array_equal(out, pts[[0, 2]])
    rng = np.random.default_rng(0)
    many = rng.uniform([0, -40, -3, 0], [70, 40, 1, 1], (50_000, 4)).astype(np.float32)
    ds = voxel_downsample(many, [2.0, 2.0, 4.0], RANGE)
    keys = np.floor((ds[:, :3] - np.array(RANGE[:3])) / [2.0, 2.0, 4.0]).astype(int)
    assert len(np.unique(keys, axis=0)) == len(ds)  # one point per voxel
    assert len(ds) <= 36 * 40 * 1


def test_reference_transform_of_real_layouts(real_kitti_dir, nuscenes_tables) -> None:
    kitti = open_dataset(real_kitti_dir)
    np.testing.assert_array_equal(reference_transform(kitti, "000001"), np.eye(4))
    nus = open_dataset(nuscenes_tables.root)
    T = reference_transform(nus, nuscenes_tables.demo_token)
    # nuScenes' LIDAR_TOP: x to the vehicle's right, y forward. After the transform the
    # lidar's +y is the reference +x (forward), within the mount's ~1 deg of tilt.
    np.testing.assert_allclose(T[:3, :3] @ [0.0, 1.0, 0.0], [1.0, 0.0, 0.0], atol=0.03)
    np.testing.assert_allclose(T[:3, 3], 0.0)  # origin stays at the lidar
    np.testing.assert_array_equal(reference_transform(nus, nuscenes_tables.demo_token, "lidar"), np.eye(4))
