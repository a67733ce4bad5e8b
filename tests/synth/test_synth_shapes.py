"""Synthetic road users (`pfactory.synth.shapes`): every part inside its label box, and
front and back told apart the way real sensors tell them -- by the lidar (a car's cabin sits
behind its centre, a cyclist's chest and head ahead of it, a pedestrian's feet point forward) and
by the camera (red tail lamps seen from behind, not from the front). Labels keep their
conventions: the box centre, size and yaw (x along the heading) are unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from pfactory.sensors.geometry import box_corners
from pfactory.synth.dataset import generate_frame
from pfactory.synth.materials import Mat
from pfactory.synth.raycast import (
    KIND_PRISM,
    PrimitiveBuilder,
    hit_prism,
    surface_normals,
)
from pfactory.synth.road_users import SIZE_RANGES
from pfactory.synth.sensors import render_camera
from pfactory.synth.shapes import BUILDERS, Shape

SMALL = (621, 188)
FRAMES = [generate_frame(11, i, 1, SMALL) for i in range(5)]


def _local(points: np.ndarray, box: np.ndarray) -> np.ndarray:
    """Points `[N, 3]` in the box's frame: x along the heading, y left, z up from the bottom."""
    c, s = np.cos(box[6]), np.sin(box[6])
    d = points[:, :3] - box[:3]
    return np.stack([c * d[:, 0] + s * d[:, 1], -s * d[:, 0] + c * d[:, 1], d[:, 2] + 0.5 * box[5]], 1)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_parts_stay_inside_the_label_box(name):
    """Whatever the sampled size, every part's bounding box is inside `l x w x h` (1 mm slack)."""
    rng = np.random.default_rng(3)
    for _ in range(40):
        l, w, h = (rng.uniform(lo, hi) for lo, hi in SIZE_RANGES[name])
        b = PrimitiveBuilder()
        yaw = rng.uniform(-np.pi, np.pi)
        BUILDERS[name](Shape(b, 5.0, -2.0, -1.73, yaw, 0), l, w, h, rng)
        prims = b.build()
        corners = box_corners(prims.params).reshape(-1, 3)
        loc = _local(corners, np.array([5.0, -2.0, -1.73 + 0.5 * h, l, w, h, yaw]))
        assert np.all(np.abs(loc[:, 0]) <= 0.5 * l + 1e-3), (name, l, np.abs(loc[:, 0]).max())
        assert np.all(np.abs(loc[:, 1]) <= 0.5 * w + 1e-3), (name, w, np.abs(loc[:, 1]).max())
        assert loc[:, 2].min() >= -1e-3 and loc[:, 2].max() <= h + 1e-3, (name, h)
        assert (prims.taper[prims.kind != KIND_PRISM] == 0).all()


def test_prism_normals_and_top_face():
    """Hits on a tapered box get the normal of the face they are on; only the +z face is top."""
    b = PrimitiveBuilder()
    b.add(KIND_PRISM, (0, 0, 0, 4.0, 2.0, 1.0, 0.3), 0, (1, 1, 1), 0.5, taper=(1.0, 0.25))
    prims = b.build()
    c, s = np.cos(0.3), np.sin(0.3)
    # Rays from far away along each face's normal, aimed at the face's middle.
    faces = {  # local normal, a point on the face (local)
        "front": (np.array([1.0, 0, 1.0]) / np.sqrt(2), np.array([1.5, 0, 0])),
        "rear": (np.array([-1.0, 0, 0.25]) / np.hypot(1, 0.25), np.array([-1.875, 0, 0])),
        "left": (np.array([0, 1.0, 0]), np.array([0.2, 1.0, 0])),
        "top": (np.array([0, 0, 1.0]), np.array([0.2, 0, 0.5])),
    }
    for face, (n, q) in faces.items():
        rot = lambda v: np.array([c * v[0] - s * v[1], s * v[0] + c * v[1], v[2]])  # noqa: E731
        origin = rot(q + 10 * n)
        d = -rot(n)
        t = hit_prism(origin, d[:1], d[1:2], d[2:], prims.shape_params()[0])
        assert np.isfinite(t).all() and abs(t[0] - 10) < 1e-6, face
        normals, top = surface_normals(prims, (origin + t[0] * d)[None], np.zeros(1, dtype=np.int64))
        np.testing.assert_allclose(normals[0], rot(n), atol=1e-5, err_msg=face)
        assert bool(top[0]) == (face == "top"), face


def test_lidar_sees_front_and_back():
    """Whichever end the lidar sees, a car's roof returns lie behind the box centre (hood longer
    than trunk, raked windscreen) and a cyclist's chest and head returns ahead of it (the rider
    leans over the front wheel): pooled over the objects seen from the front and from behind."""
    pooled: dict[tuple[str, bool], list[np.ndarray]] = {}
    for fr in FRAMES:
        for i, (box, name) in enumerate(zip(fr.boxes, fr.names)):
            if name not in ("Car", "Cyclist"):
                continue
            loc = _local(fr.points[fr.point_owner == i], box)
            upper = loc[:, 2] > (box[5] - 0.12 if name == "Car" else 1.4)
            facing_away = np.cos(box[6] - np.arctan2(box[1], box[0])) > 0  # its back is seen
            pooled.setdefault((name, bool(facing_away)), []).append(loc[upper, 0] / box[3])
    for (name, away), xs in sorted(pooled.items()):
        x = np.concatenate(xs)
        assert len(x) >= 10, (name, away, len(x))
        if name == "Car":
            assert x.mean() < 0, (name, away, x.mean())
        else:
            assert x.mean() > 0, (name, away, x.mean())


def test_pedestrian_feet_and_face_point_forward():
    """A pedestrian's feet reach further ahead than behind, the face (skin) is ahead of the
    hair, and a backpack (when there is one) is behind the torso."""
    rng = np.random.default_rng(5)
    packs = 0
    for _ in range(30):
        l, w, h = (rng.uniform(lo, hi) for lo, hi in SIZE_RANGES["Pedestrian"])
        b = PrimitiveBuilder()
        BUILDERS["Pedestrian"](Shape(b, 0.0, 0.0, 0.0, 0.0, 0), l, w, h, rng)
        p = b.build()
        x0, x1 = p.params[:, 0] - 0.5 * p.params[:, 3], p.params[:, 0] + 0.5 * p.params[:, 3]
        feet = (p.material[:, 0] == Mat.RUBBER) & (p.params[:, 2] < 0.1)
        assert feet.sum() == 2 and x1[feet].max() > -x0[feet].min()
        skin, hair = p.material[:, 0] == Mat.SKIN, p.material[:, 0] == Mat.HAIR
        assert p.params[skin, 0] > p.params[hair, 0]
        cloth_box = (p.material[:, 0] == Mat.CLOTH) & (p.kind == 0)
        if cloth_box.any():
            packs += 1
            assert p.params[cloth_box, 0].max() < 0
    assert 0 < packs < 30


def test_camera_shows_red_tail_lamps_only_from_behind():
    """Cars near the camera seen from behind show tail-lamp red; seen from the front they do not
    (head lamps are white or yellow). The test reads the rendered pixels (red paint, 8% of cars,
    is far darker than a lit tail lamp)."""
    behind, front = [], []
    for fr in FRAMES:
        cam, img = fr.cameras[0], fr.images[0].astype(np.int32)
        ids = render_camera(fr.scene, cam, np.random.default_rng(0)).ids
        for i, (box, name) in enumerate(zip(fr.boxes, fr.names)):
            if name != "Car" or np.hypot(box[0], box[1]) > 25:
                continue
            mask = ids == fr.scene_index[i]
            # Enough of it in view, its lower body not cut off by the image's bottom edge.
            if mask.sum() < 150 or mask[-3:].any() or fr.occlusion[i] > 1:
                continue
            px = img[mask]
            red = ((px[:, 0] > 150) & (px[:, 1] < 70) & (px[:, 2] < 70)).sum()
            # The camera looks along +x: cos > 0 means the car points away (its back is seen).
            facing = np.cos(box[6] - np.arctan2(box[1], box[0]))
            if facing > 0.7:
                behind.append(red)
            elif facing < -0.7:
                front.append(red)
    assert len(behind) >= 2 and len(front) >= 2, (behind, front)
    assert np.mean(np.array(behind) >= 3) >= 0.8, behind
    assert np.mean(np.array(front) >= 3) <= 0.25, front


def test_lamps_are_retro_reflective_at_the_back():
    """Tail lamps return more lidar intensity than paint: the rear of a car is brighter."""
    rear_i, body_i = [], []
    for fr in FRAMES:
        prims = fr.scene.prims
        lamp = (prims.material[:, 0] == Mat.LAMP) & (prims.color[:, 0, 0] > 2 * prims.color[:, 0, 1])
        for i, (box, name) in enumerate(zip(fr.boxes, fr.names)):
            if name != "Car":
                continue
            pts = fr.points[fr.point_owner == i]
            loc = _local(pts, box)
            at_rear = loc[:, 0] < -0.5 * box[3] + 0.05
            rear_i += pts[at_rear, 3].tolist()
            body_i += pts[~at_rear, 3].tolist()
        assert lamp.any()
    assert np.percentile(rear_i, 90) > np.percentile(body_i, 90), (len(rear_i), len(body_i))
