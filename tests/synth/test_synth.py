"""Synthetic generator (`pfactory.synth`): datasets read back through the real readers,
labels agree with the lidar and the camera, determinism, scene statistics, ray-cast exactness.

Small on purpose (5 KITTI frames at half resolution, 3 nuScenes frames at 320x180): the whole
file runs in ~10 s on 2 cores.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest

from pfactory.sensors.datasets import open_dataset
from pfactory.sensors.geometry import box_to_image_rect, points_in_boxes, project_to_image
from pfactory.sensors.kitti import KittiDataset
from pfactory.sensors.nuscenes import CAMERA_CHANNELS, NuScenesDataset
from pfactory.storage.fsutil import sha256_file
from pfactory.synth.dataset import (
    KITTI_TO_NUSCENES,
    _map,
    camera_rig,
    generate_dataset,
    generate_frame,
    kitti_camera,
    progress_printer,
)
from pfactory.synth.layout import GROUND_Z
from pfactory.synth.raycast import (
    HIT_FUNCTIONS,
    KIND_BOX,
    KIND_CYLINDER,
    KIND_ELLIPSOID,
    KIND_PRISM,
    Window,
    camera_windows,
    cast,
    lidar_windows,
)
from pfactory.synth.road_users import SIZE_RANGES
from pfactory.synth.scene import sample_scene
from pfactory.synth.sensors import camera_rays, hdl64, render_camera

SEED = 7
FRAMES = 5
SMALL = (621, 188)  # half KITTI resolution, same field of view: 4x fewer pixels to render
KITTI_NAMES = set(SIZE_RANGES)


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def kitti_ds(tmp_path_factory) -> tuple[Path, dict, list[int]]:
    out = tmp_path_factory.mktemp("synth") / "kitti"
    calls: list[int] = []
    summary = generate_dataset(out, frames=FRAMES, seed=SEED, image_size=SMALL, progress=calls.append)
    return out, summary, calls


@pytest.fixture(scope="module")
def nus_ds(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("synth") / "nus"
    return out, generate_dataset(out, frames=3, seed=SEED, cameras=6, image_size=(320, 180))


def _frames(root: Path):
    ds = open_dataset(root)
    return ds, [ds.read(fid) for fid in ds.frame_ids()]


# --- KITTI layout ---------------------------------------------------------------------------


def test_kitti_layout_reads_back(kitti_ds):
    out, summary, calls = kitti_ds
    ds, frames = _frames(out)
    assert isinstance(ds, KittiDataset)
    assert ds.frame_ids() == [f"{i:06d}" for i in range(FRAMES)]
    assert calls == list(range(1, FRAMES + 1))  # the progress hook sees every frame, in order
    for fr in frames:
        pts = fr.points
        assert pts.dtype == np.float32 and pts.shape[1] == 4 and len(pts) > 50_000
        assert np.all(np.isfinite(pts)) and pts[:, 3].min() >= 0 and pts[:, 3].max() <= 1
        # Ground at z = -1.73 (lidar 1.73 m up), 2 cm range noise; nothing beyond 100 m.
        assert abs(np.median(pts[pts[:, 2] < -1.5, 2]) - GROUND_Z) < 0.05
        assert np.hypot(pts[:, 0], pts[:, 1]).max() < 100.5
        cam = fr.cameras[0]
        assert cam.image_size == SMALL and cam.load_image().shape == (SMALL[1], SMALL[0], 3)
        np.testing.assert_allclose(cam.K, kitti_camera(SMALL).K, atol=1e-6)
        assert 5 <= len(fr.boxes) <= 25, f"{fr.frame_id}: {len(fr.boxes)} objects"
        assert set(fr.boxes.names) <= KITTI_NAMES
    assert summary["frames"] == FRAMES and sum(summary["objects"].values()) == sum(
        len(f.boxes) for f in frames
    )


def test_kitti_2d_boxes_are_the_projected_corners(kitti_ds):
    _, frames = _frames(kitti_ds[0])
    n_boxes = n_10 = 0
    for fr in frames:
        cam = fr.cameras[0]
        counts = points_in_boxes(fr.points, fr.boxes.boxes).sum(1)
        for i, box in enumerate(fr.boxes.boxes):
            # Labelled objects project in front of the camera and overlap the image (KITTI rule).
            rect = box_to_image_rect(box, cam.T_cam_from_lidar, cam.K, cam.image_size)
            assert rect is not None, f"{fr.frame_id} box {i} is not in the image"
            err = np.abs(rect - fr.boxes.box2d[i]).max()
            # Labels carry 2 decimals (cm, 0.01 rad), which moves corners by ~1-3 px when close.
            assert err <= 10.0, f"{fr.frame_id} box {i}: 2D label {fr.boxes.box2d[i]} vs corners {rect}"
            if counts[i] >= 10:
                n_10 += 1
                assert counts[i] >= 1
            n_boxes += 1
        assert np.all((fr.boxes.truncation >= 0) & (fr.boxes.truncation <= 1))
        assert set(fr.boxes.occlusion.tolist()) <= {0, 1, 2, 3}
    assert n_10 / n_boxes > 0.6, f"only {n_10}/{n_boxes} boxes have >= 10 lidar points"
    occ = np.concatenate([f.boxes.occlusion for f in frames])
    assert (occ == 0).any() and (occ > 0).any(), "objects should both stand free and occlude each other"


def test_kitti_scene_statistics(kitti_ds):
    _, frames = _frames(kitti_ds[0])
    ranges = np.concatenate([np.hypot(f.boxes.boxes[:, 0], f.boxes.boxes[:, 1]) for f in frames])
    assert (ranges > 40).sum() >= 3 and ranges.max() >= 60, f"ranges {np.sort(ranges)[-5:]}"
    names = [n for f in frames for n in f.boxes.names]
    assert {"Car", "Pedestrian", "Cyclist"} <= set(names)
    assert {"Van", "Truck"} & set(names), "the other vehicle classes should appear with their own names"
    for fr in frames:
        inside = points_in_boxes(fr.points, fr.boxes.boxes).any(0)
        above_ground = fr.points[:, 2] > GROUND_Z + 0.3
        # Clutter (poles, trees, walls, façades, bins...) gives returns no label explains.
        assert (above_ground & ~inside).sum() > 2000, fr.frame_id
        # Labelled objects are placed in the camera's view: ahead, within the horizontal FOV.
        assert np.all(fr.boxes.boxes[:, 0] > 0)


def test_lidar_points_land_on_their_object_in_the_image():
    """Lidar and camera see one scene: an object's lidar returns project onto its own pixels."""
    frame = generate_frame(SEED, 0, 1, SMALL)
    # Every return from an object's surface lies in its label box (2 cm range noise: 10 cm = 5 sigma).
    own = frame.point_owner >= 0
    inside = points_in_boxes(frame.points, frame.boxes, margin=0.1)
    assert inside[frame.point_owner[own], np.flatnonzero(own)].all()
    cam = frame.cameras[0]
    img = render_camera(frame.scene, cam, np.random.default_rng(0), track_objects=True)
    own = frame.point_owner >= 0
    uv, depth = project_to_image(frame.points[own], cam.T_cam_from_lidar, cam.K)
    front = depth > 0.1
    px = np.round(uv[front]).astype(int)
    w, h = cam.image_size
    ok = (px[:, 0] >= 0) & (px[:, 0] < w) & (px[:, 1] >= 0) & (px[:, 1] < h)
    ids = img.ids[px[ok, 1], px[ok, 0]]  # scene object index per pixel
    owner_in_scene = frame.scene_index[frame.point_owner[own][front][ok]]
    agree = (ids == owner_in_scene).mean()
    # Parallax (the camera sits 0.27 m ahead of the lidar) and edges cost a few percent.
    assert ok.sum() > 500 and agree > 0.85, f"only {agree:.1%} of object returns land on the object's pixels"


# --- determinism ------------------------------------------------------------------------------


def test_same_seed_is_byte_identical_with_any_worker_count(kitti_ds, tmp_path):
    again = tmp_path / "again"
    summary = generate_dataset(again, frames=FRAMES, seed=SEED, image_size=SMALL, workers=2)
    assert summary["workers"] == 2
    assert _hashes(again) == _hashes(kitti_ds[0])


def _blas_threads(_: int) -> int:
    from threadpoolctl import threadpool_info

    return max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts one thread on a 1-core machine anyway")
def test_pool_workers_use_one_blas_thread(monkeypatch):
    # OpenBLAS's own default (a thread per core) in the workers' environment: the pool must still limit it,
    # or each worker's spinning BLAS threads take the other workers' cores.
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert list(_map(_blas_threads, [0, 1], workers=2)) == [1, 1]


def test_different_seeds_differ(kitti_ds, tmp_path):
    other = tmp_path / "other"
    generate_dataset(other, frames=2, seed=SEED + 1, image_size=SMALL)
    a, b = _hashes(kitti_ds[0]), _hashes(other)
    for rel in ("training/velodyne/000000.bin", "training/image_2/000001.png", "training/label_2/000000.txt"):
        assert a[rel] != b[rel], rel


def test_refuses_to_replace_a_foreign_directory(tmp_path):
    (tmp_path / "mine.txt").write_text("not a dataset")
    with pytest.raises(FileExistsError, match=r"synth\.json"):
        generate_dataset(tmp_path, frames=1, seed=0, image_size=(64, 20))
    assert (tmp_path / "mine.txt").read_text() == "not a dataset"


def test_progress_printer():
    buf = io.StringIO()
    hook = progress_printer(5, every=2, stream=buf)
    for n in range(1, 6):
        hook(n)
    assert buf.getvalue().splitlines() == ["synth: 2/5 frames", "synth: 4/5 frames", "synth: 5/5 frames"]


# --- nuScenes layout ---------------------------------------------------------------------------


def test_nuscenes_layout_reads_back(nus_ds):
    out, summary = nus_ds
    ds, frames = _frames(out)
    assert isinstance(ds, NuScenesDataset) and len(frames) == 3
    for i, fr in enumerate(frames):
        assert sorted(c.name for c in fr.cameras) == sorted(CAMERA_CHANNELS)
        assert all(c.image_size == (320, 180) for c in fr.cameras)
        assert 5 <= len(fr.boxes) <= 25
        assert set(fr.boxes.names) <= set(KITTI_TO_NUSCENES.values())
        # The tables round-trip the generator's boxes and points exactly (to float32 precision).
        ref = generate_frame(SEED, i, 6, (320, 180))
        # (the reader orders annotations by token, so compare in a canonical order)
        got, want = np.argsort(fr.boxes.boxes[:, 0]), np.argsort(ref.boxes[:, 0])
        np.testing.assert_allclose(fr.boxes.boxes[got], ref.boxes[want], atol=1e-5)
        assert [fr.boxes.names[k] for k in got] == [KITTI_TO_NUSCENES[ref.names[k]] for k in want]
        np.testing.assert_allclose(fr.points, ref.points, atol=1e-4)
        # Cameras: each sees what the rig says (T_cam_from_lidar survives the ego-frame tables).
        for cam, spec in zip(
            sorted(fr.cameras, key=lambda c: c.name), sorted(camera_rig(6, (320, 180)), key=lambda c: c.name)
        ):
            np.testing.assert_allclose(cam.T_cam_from_lidar, spec.T_cam_from_lidar, atol=1e-6)
            np.testing.assert_allclose(cam.K, spec.K, atol=1e-9)
    xs = np.concatenate([f.boxes.boxes[:, 0] for f in frames])
    assert (xs < -5).any() and (xs > 5).any(), "nuScenes mode places objects all around the car"
    assert summary["category_map"] == KITTI_TO_NUSCENES


def test_nuscenes_layout_opens_in_the_devkit(nus_ds):
    """The devkit's own NuScenes class loads every table, its reverse index resolves every token, and
    its boxes in the lidar frame are the factory reader's (the same tables read two ways)."""
    pytest.importorskip("nuscenes", reason="nuscenes-devkit not installed (requirements/devkit.txt)")
    from nuscenes.eval.detection.utils import category_to_detection_name
    from nuscenes.nuscenes import NuScenes

    out, _ = nus_ds
    nusc = NuScenes(version="v1.0-synth", dataroot=str(out), verbose=False)
    ds = NuScenesDataset(out, "v1.0-synth")
    assert len(nusc.sample) == 3 and len(nusc.scene) == 3 and nusc.log[0]["map_token"] == nusc.map[0]["token"]
    assert {v["token"] for v in nusc.visibility} == {"1", "2", "3", "4"} and len(nusc.attribute) == 8
    for sample in nusc.sample:
        scene = nusc.get("scene", sample["scene_token"])
        assert scene["first_sample_token"] == scene["last_sample_token"] == sample["token"]
        assert set(sample["data"]) == {"LIDAR_TOP", *CAMERA_CHANNELS}
        # Every annotation's category is a nuScenes one that the detection task knows.
        names = [nusc.get("sample_annotation", a)["category_name"] for a in sample["anns"]]
        assert all(category_to_detection_name(n) in ("car", "pedestrian", "bicycle", "truck") for n in names)
        for a in sample["anns"]:
            ann = nusc.get("sample_annotation", a)
            nusc.get("visibility", ann["visibility_token"])
            attrs = [nusc.get("attribute", t)["name"] for t in ann["attribute_tokens"]]
            assert attrs == (["cycle.with_rider"] if ann["category_name"] == "vehicle.bicycle" else [])
            inst = nusc.get("instance", ann["instance_token"])
            assert inst["first_annotation_token"] == inst["last_annotation_token"] == a
        # The devkit's boxes in the lidar frame = the factory reader's, box by box (both ordered by token).
        _, boxes, _ = nusc.get_sample_data(sample["data"]["LIDAR_TOP"])
        boxes = sorted(boxes, key=lambda b: b.token)
        ours = ds.read(sample["token"]).boxes
        assert len(boxes) == len(ours.boxes) == len(sample["anns"])
        for b, mine, name in zip(boxes, ours.boxes, ours.names):
            w, length, h = b.wlh
            np.testing.assert_allclose([*b.center, length, w, h], mine[:6], atol=1e-6)
            assert abs((b.orientation.yaw_pitch_roll[0] - mine[6] + np.pi) % (2 * np.pi) - np.pi) < 1e-6
            assert b.name == name
    vis = [nusc.get("visibility", a["visibility_token"])["level"] for a in nusc.sample_annotation]
    assert len(set(vis)) > 1, "visibility levels come from the renders, not a constant"


# --- ray casting: exactness against implicit surfaces and brute force --------------------------


def _inside(kind: int, p: np.ndarray, pts: np.ndarray, margin: float) -> np.ndarray:
    """Reference membership test (implicit surfaces) for one primitive, grown by `margin`."""
    c, s = np.cos(p[6]), np.sin(p[6])
    d = pts - p[:3]
    lx, ly, lz = c * d[:, 0] + s * d[:, 1], -s * d[:, 0] + c * d[:, 1], d[:, 2]
    h = 0.5 * p[3:6] + margin
    if kind == KIND_BOX:
        return (np.abs(lx) <= h[0]) & (np.abs(ly) <= h[1]) & (np.abs(lz) <= h[2])
    if kind == KIND_CYLINDER:
        return (lx**2 + ly**2 <= h[0] ** 2) & (np.abs(lz) <= h[2])
    if kind == KIND_PRISM:  # the end planes lean in: x <= hx - taper * (z + hz) / height
        z_up = (lz + 0.5 * p[5]) / p[5]
        x_front, x_rear = 0.5 * p[3] - p[7] * z_up + margin, -0.5 * p[3] + p[8] * z_up - margin
        return (lx <= x_front) & (lx >= x_rear) & (np.abs(ly) <= h[1]) & (np.abs(lz) <= h[2])
    return (lx / h[0]) ** 2 + (ly / h[1]) ** 2 + (lz / h[2]) ** 2 <= 1.0


@pytest.mark.parametrize("kind", [KIND_BOX, KIND_CYLINDER, KIND_ELLIPSOID, KIND_PRISM])
def test_ray_hits_match_implicit_surfaces(kind):
    rng = np.random.default_rng(kind)
    for _ in range(20):
        size = rng.uniform(0.2, 4.0, 3)
        if kind == KIND_CYLINDER:
            size[1] = size[0]
        # Shape params [9]: box params and the prism's top-face insets (front, rear).
        taper = rng.uniform(0, 0.45, 2) * size[0] if kind == KIND_PRISM else np.zeros(2)
        p = np.array([*rng.uniform(-3, 3, 3), *size, rng.uniform(-np.pi, np.pi), *taper])
        # Sensors look at primitives from the side or from above (cylinders have no bottom cap).
        away = rng.normal(0, 1, 3)
        away[2] = abs(away[2]) + 0.3
        origin = p[:3] + away / np.linalg.norm(away) * (np.linalg.norm(size) + 2.0)
        aim = p[:3] + rng.uniform(-1, 1, (301, 3)) * 0.45 * size  # mostly at the primitive, some past it
        d = np.concatenate([aim - origin, rng.normal(0, 1, (100, 3))])  # plus random directions
        d /= np.linalg.norm(d, axis=1, keepdims=True)
        t = HIT_FUNCTIONS[kind](origin, d[:, 0], d[:, 1], d[:, 2], p)
        hit = np.isfinite(t)
        assert 0.1 < hit.mean() < 0.95  # both hits and misses are exercised
        # A hit lies on the surface and nothing of the primitive lies before it on the ray.
        at = origin + d[hit] * t[hit, None]
        assert _inside(kind, p, at, 1e-6).all()
        for f in np.linspace(0.0, 0.999, 60):
            assert not _inside(kind, p, origin + d[hit] * (f * t[hit, None] - 1e-4), -1e-6).any()
        # A miss crosses no part of it.
        for r in np.linspace(0.0, 30.0, 600):
            assert not _inside(kind, p, origin + d[~hit] * r, -1e-6).any()


def test_windowed_cast_equals_brute_force():
    """The angular / pixel windows are conservative: same first hits as testing every ray."""
    scene = sample_scene(np.random.default_rng([SEED, 99]), "around")
    prims = scene.prims
    # Lidar on a coarse grid (64 beams x 720 steps).
    spec = hdl64()
    el = np.radians(spec.elevation_deg)
    n_az, az0 = 720, -np.pi + 0.003
    az = az0 + 2 * np.pi / n_az * np.arange(n_az)
    dirs = (
        np.cos(el)[:, None] * np.cos(az),
        np.cos(el)[:, None] * np.sin(az),
        np.broadcast_to(np.sin(el)[:, None], (64, n_az)),
    )
    full = [Window(0, 64, [(0, n_az)])] * len(prims)
    windows = lidar_windows(prims.params, el, az0, 2 * np.pi / n_az, n_az)
    a = cast(prims, np.zeros(3), dirs, windows, GROUND_Z, 100.0)
    b = cast(prims, np.zeros(3), dirs, full, GROUND_Z, 100.0)
    np.testing.assert_array_equal(a.prim, b.prim)
    np.testing.assert_array_equal(a.t, b.t)
    # Camera, with z-buffer culling and near-to-far order.
    cam = camera_rig(6, (200, 112))[3]
    origin, cdirs = camera_rays(cam)
    windows, min_depth = camera_windows(prims.params, cam.T_cam_from_lidar, cam.K, cam.image_size)
    a = cast(prims, origin, cdirs, windows, GROUND_Z, 400.0, np.argsort(min_depth, kind="stable"), min_depth)
    b = cast(prims, origin, cdirs, [Window(0, 112, [(0, 200)])] * len(prims), GROUND_Z, 400.0)
    np.testing.assert_array_equal(a.prim, b.prim)
    np.testing.assert_array_equal(a.t, b.t)


# --- encoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (5, 1), (17, 33), (188, 621)])
def test_png_encoder_is_lossless_for_any_decoder(shape):
    """`encode_png` (our own Sub filter + Huffman-only zlib) decodes to the exact pixels, in Pillow
    and in libpng (OpenCV), with no metadata; the same pixels give the same bytes."""
    import cv2
    from PIL import Image

    from pfactory.synth.dataset import encode_png

    rgb = np.random.default_rng(shape).integers(0, 256, (*shape, 3), dtype=np.uint8)
    rgb[:, : shape[1] // 2] //= 16  # smooth and noisy parts: small and large filtered values
    data = encode_png(rgb)
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "PNG" and im.mode == "RGB" and im.info == {}
        np.testing.assert_array_equal(np.asarray(im), rgb)
    np.testing.assert_array_equal(
        cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)[..., ::-1], rgb
    )
    assert encode_png(rgb.copy()) == data
    with pytest.raises(ValueError, match="uint8"):
        encode_png(rgb.astype(np.float32))
