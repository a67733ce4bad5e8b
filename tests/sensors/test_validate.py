"""`check_dataset` / `check_frame`: every planted corruption is reported with its file and field.

Each test plants problems in a copy (tmp_path) of a clean dataset -- the 6 real KITTI frames, or
the small nuScenes table set of conftest.py -- and checks that the report names the right
file and field, says what was expected, and still lists the untouched frames as fine.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pfactory.sensors.datasets import open_dataset
from pfactory.sensors.validate import (
    MIN_POINTS,
    CheckReport,
    check_dataset,
    check_frame,
    format_report,
    inspect_frame,
)

KITTI_IDS = ["000000", "000001", "000002", "000003", "000004", "000005"]


def _find(report: CheckReport, frame_id: str | None, file_end: str, field: str, words: str = "") -> dict:
    """The one problem matching frame, file suffix, field (substring) and reason words."""
    hits = [
        p
        for p in report.problems
        if p["frame_id"] == frame_id
        and p["file"].endswith(file_end)
        and field in p["field"]
        and all(w in p["reason"] for w in words.split("|") if w)
    ]
    assert hits, f"no problem ({frame_id}, *{file_end}, {field}, {words!r}) in:\n" + format_report(
        report, 200
    )
    return hits[0]


def _assert_only_frame_bad(report: CheckReport, bad: str, all_ids: list[str]) -> None:
    assert not report.ok
    assert report.frames_bad == [bad], report.frames_bad
    assert report.frames_ok == [f for f in all_ids if f != bad]


# ---------------------------------------------------------------------------------------------
# KITTI


def test_clean_real_kitti_is_clean(kitti_copy: Path, real_kitti_dir: Path) -> None:
    report = check_dataset(kitti_copy)
    assert report.ok, format_report(report)
    assert report.layout == "kitti" and report.n_frames == 6 and report.frames_ok == KITTI_IDS
    d = json.loads(report.to_json())
    assert d["ok"] is True and d["n_frames_ok"] == 6 and d["problems"] == []
    assert "OK: no problems" in format_report(report)
    # the shared originals check the same way (read-only: nothing is written there)
    assert check_dataset(real_kitti_dir).frames_ok == KITTI_IDS


def _write(path: Path, data: bytes | str) -> None:
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)


def _points(root: Path, fid: str) -> np.ndarray:
    return np.fromfile(root / f"training/velodyne/{fid}.bin", dtype=np.float32).reshape(-1, 4).copy()


def _set_points(root: Path, fid: str, pts: np.ndarray) -> None:
    _write(root / f"training/velodyne/{fid}.bin", pts.astype(np.float32).tobytes())


def _edit_text(root: Path, rel: str, fn: Callable[[str], str]) -> None:
    p = root / "training" / rel
    p.write_text(fn(p.read_text()))


def _nan_points(root: Path) -> None:
    pts = _points(root, "000002")
    pts[[5, 500, 5000], 0] = np.nan
    _set_points(root, "000002", pts)


def _inf_points(root: Path) -> None:
    pts = _points(root, "000002")
    pts[7, 2] = np.inf
    _set_points(root, "000002", pts)


def _resize_image(root: Path, size: tuple[int, int]) -> None:
    from PIL import Image

    p = root / "training/image_2/000002.png"
    with Image.open(p) as im:
        im.resize(size).save(p)


def _replace_line(rel: str, lineno: int, new: str) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        def fn(t: str) -> str:
            lines = t.splitlines()
            lines[lineno - 1] = new
            return "\n".join(lines) + "\n"

        _edit_text(root, rel, fn)

    return edit


def _first_line_field(field_index: int, value: str) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        def fn(t: str) -> str:
            lines = t.splitlines()
            parts = lines[0].split()
            parts[field_index] = value
            lines[0] = " ".join(parts)
            return "\n".join(lines) + "\n"

        _edit_text(root, "label_2/000002.txt", fn)

    return edit


P2_0002 = "P2: 7.215377000000e+02 0.000000000000e+00 6.095593000000e+02 4.485728000000e+01"

# (name, corruption of frame 000002, file suffix, field, words in the reason)
KITTI_CASES = [
    ("missing velodyne", lambda r: (r / "training/velodyne/000002.bin").unlink(), "velodyne/000002.bin", "velodyne", "missing"),
    ("missing image", lambda r: (r / "training/image_2/000002.png").unlink(), "image_2/000002.png", "image_2", "missing"),
    ("missing calib", lambda r: (r / "training/calib/000002.txt").unlink(), "calib/000002.txt", "calib", "missing"),
    ("missing label", lambda r: (r / "training/label_2/000002.txt").unlink(), "label_2/000002.txt", "label_2", "missing"),
    ("empty lidar", lambda r: _write(r / "training/velodyne/000002.bin", b""), "velodyne/000002.bin", "points", "empty"),
    ("ragged lidar", lambda r: _write(r / "training/velodyne/000002.bin", (r / "training/velodyne/000002.bin").read_bytes() + b"abc"), "velodyne/000002.bin", "points", "multiple of 16"),
    ("nan lidar", _nan_points, "velodyne/000002.bin", "points", "NaN/Inf|3 of"),
    ("inf lidar", _inf_points, "velodyne/000002.bin", "points", "NaN/Inf|1 of"),
    ("too few points", lambda r: _set_points(r, "000002", _points(r, "000002")[:40]), "velodyne/000002.bin", "points", f"at least {MIN_POINTS}|got 40"),
    ("intensity scale", lambda r: _set_points(r, "000002", _points(r, "000002") * [1, 1, 1, 255]), "velodyne/000002.bin", "intensity", "[0, 1]"),
    ("garbage coordinates", lambda r: _set_points(r, "000002", _points(r, "000002") + np.array([0, 0, 5e3, 0], np.float32)), "velodyne/000002.bin", "points", "within"),
    ("undecodable image", lambda r: _write(r / "training/image_2/000002.png", b"\x89PNG\r\n\x1a\nnot really"), "image_2/000002.png", "image", "decodable"),
    ("truncated png", lambda r: _write(r / "training/image_2/000002.png", (r / "training/image_2/000002.png").read_bytes()[:400_000]), "image_2/000002.png", "image", "truncated"),
    ("png without IEND", lambda r: _write(r / "training/image_2/000002.png", (r / "training/image_2/000002.png").read_bytes()[:-12]), "image_2/000002.png", "image", "IEND"),
    ("empty image", lambda r: _write(r / "training/image_2/000002.png", b""), "image_2/000002.png", "image", "empty"),
    ("image size vs calib", lambda r: _resize_image(r, (640, 480)), "image_2/000002.png", "image size", "principal point|640x480"),
    ("principal point outside", lambda r: _edit_text(r, "calib/000002.txt", lambda t: t.replace(P2_0002, P2_0002.replace("6.095593000000e+02", "2.0e+03"))), "image_2/000002.png", "image size", "2000.0"),
    ("calib P2 short", lambda r: _edit_text(r, "calib/000002.txt", lambda t: t.replace("P2: 7.215377000000e+02", "P2:")), "calib/000002.txt", "P2", "12 values|got 11"),
    ("calib R0 missing", lambda r: _edit_text(r, "calib/000002.txt", lambda t: "\n".join(l for l in t.splitlines() if not l.startswith("R0_rect"))), "calib/000002.txt", "R0_rect", "missing"),
    ("calib Tr text", lambda r: _edit_text(r, "calib/000002.txt", lambda t: t.replace("Tr_velo_to_cam: 7.533745000000e-03", "Tr_velo_to_cam: seven")), "calib/000002.txt", "Tr_velo_to_cam", "numeric"),
    ("calib P2 nan", lambda r: _edit_text(r, "calib/000002.txt", lambda t: t.replace("P2: 7.215377000000e+02", "P2: nan")), "calib/000002.txt", "P2", "finite"),
    ("calib R0 not rotation", lambda r: _edit_text(r, "calib/000002.txt", lambda t: t.replace("R0_rect: 9.999239000000e-01", "R0_rect: 1.999239000000e+00")), "calib/000002.txt", "R0_rect", "rotation"),
    ("label field count", _replace_line("label_2/000002.txt", 2, "Car 0.00 0 -1.67 657.39 190.13 700.07 223.39 1.41 1.58 4.36"), "label_2/000002.txt", "line 2", "15|got 11"),
    ("label non-numeric", _first_line_field(8, "tall"), "label_2/000002.txt", "line 1 height", "a number|'tall'"),
    ("label unknown class", _first_line_field(0, "Bus"), "label_2/000002.txt", "line 1 type", "'Bus'"),
    ("label zero size", _first_line_field(9, "0"), "label_2/000002.txt", "line 1 dimensions", "positive"),
    ("label behind camera", _first_line_field(13, "-8.55"), "label_2/000002.txt", "line 1 z", "in front of the camera"),
    ("label occlusion", _first_line_field(2, "7"), "label_2/000002.txt", "line 1 occluded", "0, 1, 2 or 3"),
    ("duplicate id by case", lambda r: shutil.copy(r / "training/image_2/000002.png", r / "training/image_2/000002.PNG"), "image_2/000002.PNG", "frame id", "000002.png and 000002.PNG"),
    ("duplicate id by format", lambda r: shutil.copy(r / "training/image_2/000002.png", r / "training/image_2/000002.jpg"), "image_2/000002.jpg", "frame id", "both name frame 000002"),
    ("duplicate id by number", lambda r: shutil.copy(r / "training/calib/000002.txt", r / "training/calib/2.txt"), "calib/2.txt", "frame id", "both name frame 000002"),
    ("image in the wrong format", lambda r: (r / "training/image_2/000002.png").rename(r / "training/image_2/000002.jpg"), "image_2/000002.png", "image_2", "found 000002.jpg"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("corrupt", "file_end", "field", "words"),
    [c[1:] for c in KITTI_CASES],
    ids=[c[0] for c in KITTI_CASES],
)
def test_kitti_corruption_is_reported(
    kitti_copy: Path, corrupt, file_end: str, field: str, words: str
) -> None:
    assert "R0_rect: 9.999239000000e-01" in (kitti_copy / "training/calib/000002.txt").read_text()
    corrupt(kitti_copy)
    report = check_dataset(kitti_copy)
    p = _find(report, "000002", file_end, field, words)
    assert not Path(p["file"]).is_absolute()  # relative to the dataset root
    # "2.txt" is also a frame of its own (with only a calib file): that one is bad too.
    bad = ["000002", "2"] if file_end == "calib/2.txt" else ["000002"]
    assert report.frames_bad == bad, format_report(report)
    assert report.frames_ok == [f for f in KITTI_IDS if f != "000002"]
    # the per-frame entry point (what prepare calls) reports the same
    assert p in check_frame(open_dataset(kitti_copy), "000002")


def test_truncation_caught_even_with_pil_flag_set(kitti_copy: Path, monkeypatch) -> None:
    from PIL import ImageFile

    assert ImageFile.LOAD_TRUNCATED_IMAGES is False  # PIL's default; nothing in pfactory changes it
    p = kitti_copy / "training/image_2/000003.png"
    p.write_bytes(p.read_bytes()[:300_000])
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    report = check_dataset(kitti_copy)
    _find(report, "000003", "image_2/000003.png", "image", "truncated")
    _assert_only_frame_bad(report, "000003", KITTI_IDS)


def test_every_problem_of_a_frame_is_reported(kitti_copy: Path) -> None:
    """Several problems in one frame, and in two parts of one file: all of them, not the first."""
    lines = (kitti_copy / "training/label_2/000001.txt").read_text().splitlines()
    lines[0] = lines[0].replace("Truck", "Lorry")
    lines[1] = lines[1].replace(" 1.67 ", " -1.67 ")  # negative height
    lines[2] = lines[2] + " 0.5"  # 16 fields
    (kitti_copy / "training/label_2/000001.txt").write_text("\n".join(lines) + "\n")
    _edit_text(kitti_copy, "calib/000001.txt", lambda t: t.replace("P2: 7.215377000000e+02", "P2:"))
    _edit_text(
        kitti_copy,
        "calib/000001.txt",
        lambda t: t.replace("Tr_velo_to_cam: 7.533745000000e-03", "Tr_velo_to_cam:"),
    )
    pts = _points(kitti_copy, "000001")
    pts[0, 0] = np.nan
    _set_points(kitti_copy, "000001", pts)
    report = check_dataset(kitti_copy)
    fields = sorted((Path(p["file"]).parent.name, p["field"]) for p in report.problems)
    assert fields == [
        ("calib", "P2"),
        ("calib", "Tr_velo_to_cam"),
        ("label_2", "line 1 type"),
        ("label_2", "line 2 dimensions"),
        ("label_2", "line 3"),
        ("velodyne", "points"),
    ], format_report(report)
    _assert_only_frame_bad(report, "000001", KITTI_IDS)


def test_problems_in_many_frames(kitti_copy: Path) -> None:
    (kitti_copy / "training/velodyne/000000.bin").write_bytes(b"")
    (kitti_copy / "training/image_2/000004.png").write_bytes(b"junk")
    report = check_dataset(kitti_copy)
    assert report.frames_bad == ["000000", "000004"]
    assert report.frames_ok == ["000001", "000002", "000003", "000005"]
    text = format_report(report)
    assert "frame 000000:" in text and "velodyne/000000.bin: points: expected" in text
    d = json.loads(report.to_json())
    assert d["ok"] is False and d["n_problems"] == 2
    assert {p["frame_id"] for p in d["problems"]} == {"000000", "000004"}
    assert set(d["problems"][0]) == {"frame_id", "file", "field", "reason"}


def test_inspect_frame_returns_frame_and_decoded_images(kitti_copy: Path) -> None:
    ds = open_dataset(kitti_copy)
    fc = inspect_frame(ds, "000003", keep_images=True)
    assert fc.ok and fc.frame is not None and fc.frame.frame_id == "000003"
    img = fc.images["image_2"]
    assert img.shape == (375, 1242, 3) and img.dtype == np.uint8
    np.testing.assert_array_equal(img, fc.frame.cameras[0].load_image())
    assert check_frame(ds, "000003") == []
    (kitti_copy / "training/label_2/000003.txt").write_text("Car 1 2 3\n")
    bad = inspect_frame(ds, "000003", keep_images=True)
    assert not bad.ok and bad.frame is None  # prepare must not get a frame that failed
    assert [p["field"] for p in bad.problems] == ["line 1"]


def test_min_points_is_a_parameter(kitti_copy: Path) -> None:
    _set_points(kitti_copy, "000005", _points(kitti_copy, "000005")[:40])
    assert not check_dataset(kitti_copy).ok
    assert check_dataset(kitti_copy, min_points=10).ok


def test_not_a_dataset(tmp_path: Path) -> None:
    report = check_dataset(tmp_path)
    assert not report.ok and report.layout == "unknown" and report.n_frames == 0
    assert report.problems[0]["field"] == "layout"
    report = check_dataset(tmp_path / "nope")
    assert not report.ok and "existing directory" in report.problems[0]["reason"]


def test_progress_is_called_per_frame(kitti_copy: Path) -> None:
    calls = []
    check_dataset(kitti_copy, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 6) for i in range(1, 7)]


def test_check_is_fast(kitti_copy: Path) -> None:
    """36 real frames (6 x 6 copies: ~120k points, a 1242x375 PNG each) well within budget.

    Measured: ~0.012 s/frame on 2 threads; 200 frames ~2.5 s. The bound is 10x that.
    """
    tr = kitti_copy / "training"
    for k in range(1, 6):
        for fid in KITTI_IDS:
            new = f"{int(fid) + 10 * k:06d}"
            for part, ext in (("velodyne", "bin"), ("image_2", "png"), ("calib", "txt"), ("label_2", "txt")):
                shutil.copy(tr / part / f"{fid}.{ext}", tr / part / f"{new}.{ext}")
    t0 = time.perf_counter()
    report = check_dataset(kitti_copy)
    dt = time.perf_counter() - t0
    print(f"check of 36 frames: {dt:.2f} s")
    assert report.ok and report.n_frames == 36
    assert dt < 36 * 0.12


# ---------------------------------------------------------------------------------------------
# nuScenes (the table set of conftest.py; the mono3d sample's lidar is the real 40-point stub,
# so these checks run with min_points=10 -- the default flags the stub, see the first test)


def test_clean_nuscenes_tables(nuscenes_tables) -> None:
    report = check_dataset(nuscenes_tables.root, min_points=10)
    assert report.ok, format_report(report)
    assert report.layout == "nuscenes" and report.n_frames == 2
    # the default threshold flags the real 40-point stub, and only that
    report = check_dataset(nuscenes_tables.root)
    p = _find(report, nuscenes_tables.mono3d_token, "__1533201470948018.pcd.bin", "points", "got 40")
    assert p["file"].startswith("samples/LIDAR_TOP/")
    _assert_only_frame_bad(
        report, nuscenes_tables.mono3d_token, [nuscenes_tables.mono3d_token, nuscenes_tables.demo_token]
    )


def _sd(fx, token_part: str) -> tuple[list[dict], dict]:
    rows = fx.load("sample_data")
    return rows, next(r for r in rows if r["token"] == token_part)


def _nus_edit(table: str, fn: Callable[[list[dict]], None]) -> Callable:
    def edit(fx) -> None:
        rows = fx.load(table)
        fn(rows)
        fx.save(table, rows)

    return edit


def _by_token(rows: list[dict], token: str) -> dict:
    return next(r for r in rows if r["token"] == token)


def _truncate_jpeg(fx) -> None:
    # CAM_BACK_LEFT: the one demo image the mono3d sample does not borrow as a stand-in
    p = fx.root / json_filename(fx, "sd-demo00-CAM_BACK_LEFT")
    p.write_bytes(p.read_bytes()[:60_000])


def json_filename(fx, sd_token: str) -> str:
    return _by_token(fx.load("sample_data"), sd_token)["filename"]


def _nan_lidar(fx) -> None:
    p = fx.root / json_filename(fx, "sd-demo00-LIDAR_TOP")
    pts = np.fromfile(p, dtype=np.float32).reshape(-1, 5).copy()
    pts[100, 1] = np.nan
    p.write_bytes(pts.tobytes())


# Every case corrupts the demo sample; (name, corruption, file suffix, field, words).
NUS_CASES = [
    ("duplicate sample token", _nus_edit("sample", lambda rows: rows.append(dict(_by_token(rows, "demo0000000000000000000000000000")))), "v1.0-mini/sample.json", "demo0000000000000000000000000000.token", "unique tokens|2 records"),
    ("duplicate sample_data token", _nus_edit("sample_data", lambda rows: rows.append(dict(_by_token(rows, "sd-demo00-CAM_BACK")))), "sample_data.json", "sd-demo00-CAM_BACK.token", "unique tokens"),
    ("two records for one channel", _nus_edit("sample_data", lambda rows: rows.append({**_by_token(rows, "sd-demo00-CAM_BACK"), "token": "sd-extra"})), "sample_data.json", "CAM_BACK", "one key-frame CAM_BACK record"),
    ("duplicate calibrated_sensor", _nus_edit("calibrated_sensor", lambda rows: rows.append(dict(_by_token(rows, "cs-0724-CAM_FRONT")))), "calibrated_sensor.json", "cs-0724-CAM_FRONT.token", "unique tokens"),
    ("path escapes root", _nus_edit("sample_data", lambda rows: _by_token(rows, "sd-demo00-CAM_FRONT").update(filename="../../etc/passwd")), "sample_data.json", "sd-demo00-CAM_FRONT.filename", "inside the dataset root|'../../etc/passwd'"),
    ("absolute path", _nus_edit("sample_data", lambda rows: _by_token(rows, "sd-demo00-CAM_FRONT").update(filename="/etc/passwd")), "sample_data.json", "sd-demo00-CAM_FRONT.filename", "inside the dataset root"),
    ("missing image file", lambda fx: (fx.root / json_filename(fx, "sd-demo00-CAM_BACK_LEFT")).unlink(), "__CAM_BACK_LEFT__1532402927647423.jpg", "CAM_BACK_LEFT", "missing"),
    ("missing lidar file", lambda fx: (fx.root / json_filename(fx, "sd-demo00-LIDAR_TOP")).unlink(), "__LIDAR_TOP__1532402927647951.pcd.bin", "LIDAR_TOP", "missing"),
    ("missing channel record", _nus_edit("sample_data", lambda rows: rows.remove(_by_token(rows, "sd-demo00-CAM_FRONT_LEFT"))), "sample_data.json", "CAM_FRONT_LEFT", "key-frame CAM_FRONT_LEFT record"),
    ("truncated jpeg", _truncate_jpeg, "__CAM_BACK_LEFT__1532402927647423.jpg", "image", "truncated"),
    ("nan lidar", _nan_lidar, "__LIDAR_TOP__1532402927647951.pcd.bin", "points", "NaN/Inf|1 of 34688"),
    ("size vs sample_data", _nus_edit("sample_data", lambda rows: _by_token(rows, "sd-demo00-CAM_BACK").update(width=1280, height=720)), "__CAM_BACK__1532402927637525.jpg", "CAM_BACK size", "1280x720|got 1600x900"),
    ("principal point outside", _nus_edit("calibrated_sensor", lambda rows: _by_token(rows, "cs-0724-CAM_BACK")["camera_intrinsic"][0].__setitem__(2, 2400.0)), "__CAM_BACK__1532402927637525.jpg", "image size", "2400.0"),
    ("bad intrinsics", _nus_edit("calibrated_sensor", lambda rows: _by_token(rows, "cs-0724-CAM_BACK").update(camera_intrinsic=[[1, 0], [0, 1]])), "calibrated_sensor.json", "cs-0724-CAM_BACK.camera_intrinsic", "3x3"),
    ("zero quaternion", _nus_edit("calibrated_sensor", lambda rows: _by_token(rows, "cs-0724-LIDAR_TOP").update(rotation=[0, 0, 0, 0])), "calibrated_sensor.json", "cs-0724-LIDAR_TOP.rotation/translation", "non-zero"),
    ("unknown ego pose", _nus_edit("sample_data", lambda rows: _by_token(rows, "sd-demo00-CAM_BACK").update(ego_pose_token="nope")), "sample_data.json", "sd-demo00-CAM_BACK.ego_pose_token", "ego_pose record"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("corrupt", "file_end", "field", "words"), [c[1:] for c in NUS_CASES], ids=[c[0] for c in NUS_CASES]
)
def test_nuscenes_corruption_is_reported(
    nuscenes_tables, corrupt, file_end: str, field: str, words: str
) -> None:
    fx = nuscenes_tables
    corrupt(fx)
    report = check_dataset(fx.root, min_points=10)
    _find(report, fx.demo_token, file_end, field, words)
    _assert_only_frame_bad(report, fx.demo_token, [fx.mono3d_token, fx.demo_token])


# Annotation problems live in the mono3d sample (the one with annotations).
NUS_ANN_CASES = [
    ("non-positive size", _nus_edit("sample_annotation", lambda rows: _by_token(rows, "ann-04").update(size=[1.9, 0.0, 1.5])), "sample_annotation.json", "ann-04.size", "positive"),
    ("unknown category", _nus_edit("instance", lambda rows: _by_token(rows, "inst-07").update(category_token="cat-unicorn")), "instance.json", "inst-07.category_token", "category record"),
    ("unknown instance", _nus_edit("sample_annotation", lambda rows: _by_token(rows, "ann-02").update(instance_token="nope")), "sample_annotation.json", "ann-02.instance_token", "instance record"),
    ("malformed token", _nus_edit("sample_annotation", lambda rows: _by_token(rows, "ann-03").update(instance_token=["inst-03"])), "sample_annotation.json", "ann-03.instance_token", "instance record"),
    ("duplicate annotation", _nus_edit("sample_annotation", lambda rows: rows.append(dict(_by_token(rows, "ann-09")))), "sample_annotation.json", "ann-09.token", "unique tokens"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("corrupt", "file_end", "field", "words"),
    [c[1:] for c in NUS_ANN_CASES],
    ids=[c[0] for c in NUS_ANN_CASES],
)
def test_nuscenes_annotation_corruption(
    nuscenes_tables, corrupt, file_end: str, field: str, words: str
) -> None:
    fx = nuscenes_tables
    corrupt(fx)
    report = check_dataset(fx.root, min_points=10)
    _find(report, fx.mono3d_token, file_end, field, words)
    _assert_only_frame_bad(report, fx.mono3d_token, [fx.mono3d_token, fx.demo_token])


def test_nuscenes_orphan_duplicate_is_a_dataset_problem(nuscenes_tables) -> None:
    fx = nuscenes_tables
    _nus_edit(
        "category",
        lambda rows: rows.extend([{"token": "cat-x", "name": "x"}, {"token": "cat-x", "name": "y"}]),
    )(fx)
    report = check_dataset(fx.root, min_points=10)
    _find(report, None, "category.json", "cat-x.token", "unique tokens|2 records")
    assert report.frames_ok == [fx.mono3d_token, fx.demo_token] and not report.ok
    assert "dataset:" in format_report(report)


def test_nuscenes_malformed_table(nuscenes_tables) -> None:
    _nus_edit("sample_annotation", lambda rows: _by_token(rows, "ann-03").update(sample_token=[1]))(
        nuscenes_tables
    )
    report = check_dataset(nuscenes_tables.root)
    assert not report.ok and report.n_frames == 0
    _find(report, None, ".", "tables", "TypeError")


def test_nuscenes_missing_table(nuscenes_tables) -> None:
    nuscenes_tables.table_path("ego_pose").unlink()
    report = check_dataset(nuscenes_tables.root)
    assert not report.ok and report.n_frames == 0
    _find(report, None, "ego_pose.json", "ego_pose", "missing")


def test_nuscenes_inspect_keeps_six_images(nuscenes_tables) -> None:
    ds = open_dataset(nuscenes_tables.root)
    fc = inspect_frame(ds, nuscenes_tables.demo_token, keep_images=True)
    assert fc.ok and len(fc.frame.cameras) == 6
    assert sorted(fc.images) == sorted(c.name for c in fc.frame.cameras)
    assert all(im.shape == (900, 1600, 3) for im in fc.images.values())
