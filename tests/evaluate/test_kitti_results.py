"""KITTI result files of the evaluate stage (pfactory.evaluate.kitti_results): a box written back from the
lidar frame lands on its own label line (2D box by projection and clipping, alpha, location, ry), and a
detection outside the camera's view is left out."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pfactory.evaluate.kitti_results import box_corners_rect, image_boxes, kitti_split, result_lines
from pfactory.metrics.detection import FrameDetections
from pfactory.sensors.kitti import labels_to_boxes, parse_calib, parse_label_file


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Path:
    from pfactory.synth.dataset import generate_dataset

    root = tmp_path_factory.mktemp("synth")
    generate_dataset(root, frames=3, seed=2, cameras=1, image_size=(416, 128))
    return root


def test_labels_round_trip_through_the_result_writer(synth: Path) -> None:
    split = kitti_split(synth)
    assert split is not None
    from pfactory.sensors.io import image_size

    checked = 0
    for label in sorted((split / "label_2").glob("*.txt")):
        calib = parse_calib(split / "calib" / label.name)
        objs = [
            o for o in parse_label_file(label, with_score=False) if o.type in ("Car", "Pedestrian", "Cyclist")
        ]
        if not objs:
            continue
        boxes = labels_to_boxes(objs, calib, label).boxes  # [M, 7] lidar frame
        frame = FrameDetections(label.stem, boxes, [o.type for o in objs], np.linspace(0.9, 0.5, len(objs)))
        w, h = image_size(split / "image_2" / f"{label.stem}.png")
        text, outside = result_lines(frame, calib, w, h)
        assert outside == 0  # the labelled objects are all in view
        lines = [line.split() for line in text.splitlines()]
        assert len(lines) == len(objs)
        for o, cols in zip(objs, lines):
            vals = list(map(float, cols[3:]))
            assert cols[0] == o.type and cols[1:3] == ["-1", "-1"]
            # The label's 2D box is the same projection, clipped the same way; the label's 2-decimal location
            # and size (+-5 mm) move the projected corners of a near box by up to ~0.4 px (seen) in 416 x 128.
            np.testing.assert_allclose(vals[1:5], o.bbox, atol=0.5)
            np.testing.assert_allclose(vals[5:8], o.dimensions_hwl, atol=0.006)
            np.testing.assert_allclose(vals[8:11], o.location, atol=0.006)
            assert math.remainder(vals[11] - o.rotation_y, 2 * math.pi) == pytest.approx(0, abs=0.006)
            assert vals[0] == pytest.approx(
                math.remainder(vals[11] - math.atan2(vals[8], vals[10]), 2 * math.pi)
            )
            checked += 1
    assert checked >= 2


def test_boxes_behind_or_beside_the_camera_are_left_out() -> None:
    P = np.array([[700.0, 0, 600, 0], [0, 700, 180, 0], [0, 0, 1, 0]])
    hwl = np.array([[1.5, 1.6, 3.9]] * 4)
    loc = np.array([[0, 1.6, 20.0], [0, 1.6, -20.0], [200.0, 1.6, 5.0], [0, 1.6, 0.5]])
    boxes, visible = image_boxes(box_corners_rect(hwl, loc, np.zeros(4)), P, 1242, 375)
    # In front; behind; far to the right (projects off the image); straddling the camera (cut at 0.1 m).
    assert visible.tolist() == [True, False, False, True]
    # The near face (z = 20 - 0.8) spans x +-1.95 m, y 0.1 .. 1.6 m; the far top edge (z = 20.8) sets y1.
    want = [600 - 700 * 1.95 / 19.2, 180 + 700 * 0.1 / 20.8, 600 + 700 * 1.95 / 19.2, 180 + 700 * 1.6 / 19.2]
    np.testing.assert_allclose(boxes[0], want, rtol=1e-12)
    # z from -0.3 to 1.3 m: edges cut at 0.1 m, the near part runs off the image (clipped); y1 from z = 1.3.
    np.testing.assert_allclose(boxes[3], [0, 180 + 700 * 0.1 / 1.3, 1241, 374], rtol=1e-12)
