"""A third dataset layout for perception-factory, as an installed plugin: one folder per frame.

Layout (README.md has the full spec)::

    root/<frame_id>/lidar.npy     float32 [N, 4] x y z intensity, lidar frame (x forward, y left, z up, metres;
                                  intensity in [0, 1])
    root/<frame_id>/camera.jpg    the camera image (JPEG, RGB or grayscale, no EXIF rotation)
    root/<frame_id>/calib.json    {"intrinsics": 3x3, "lidar_to_camera": 4x4}
    root/<frame_id>/labels.json   [{"name": "Car", "box": [x, y, z, l, w, h, yaw]}, ...] in the lidar frame,
                                  z at the box centre, yaw about +z from +x

`FolderDataset` implements the factory's reader contract (`pfactory.sensors.reader.DatasetReader`) and is
registered in pyproject.toml under the entry-point group `pfactory.datasets` as `folder`: nothing in the
factory is edited or imported for it. The lidar frame is the reference frame (no reference transform), frames
are self-contained (no shared files), object storage is not supported (`list_remote` stays None) and there is
no benchmark of this layout (`results_writer` None). `pfactory_folder_dataset.convert` writes this layout
from any reader's frames.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.sensors.checks import (
    MAX_BOX_RANGE_M,
    MAX_BOX_SIZE_M,
    MAX_OBJECTS,
    FrameCheck,
    Problems,
    absent,
    check_focal,
    check_points_bytes,
    check_principal_point,
    decode_image_checked,
    finish_check,
    orthonormal,
)
from pfactory.sensors.errors import DatasetError
from pfactory.sensors.frame import Boxes3D, CameraView, Frame
from pfactory.sensors.io import image_size
from pfactory.sensors.reader import DatasetReader

__all__ = ["CAMERA", "FILES", "FolderDataset", "parse_calib", "parse_labels", "read_lidar"]
__version__ = "0.1.0"

FILES = ("lidar.npy", "camera.jpg", "calib.json", "labels.json")
CAMERA = "camera"  # the camera's name in frames and the prepared data
MAX_NPY_BYTES = 64 * 2**20  # a lidar sweep of this layout is at most 4M points


def read_lidar(path: Path) -> np.ndarray:
    """`lidar.npy` -> float32 `[N, 4]`; DatasetError naming the file unless it is such an array (no pickles)."""
    if path.stat().st_size > MAX_NPY_BYTES:
        raise DatasetError(path, "points", f"an .npy file of at most {MAX_NPY_BYTES} bytes")
    try:
        arr = np.load(io.BytesIO(path.read_bytes()), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DatasetError(path, "points", f"an .npy array (numpy.save) ({e})") from None
    if arr.dtype != np.float32 or arr.ndim != 2 or arr.shape[1] != 4:
        raise DatasetError(path, "points", f"a float32 [N, 4] array (x, y, z, intensity), got {arr.dtype} {arr.shape}")
    return np.ascontiguousarray(arr)


def _matrix(doc: dict[str, Any], key: str, shape: tuple[int, int], path: Path) -> np.ndarray:
    try:
        m = np.asarray(doc[key], dtype=np.float64)
    except (KeyError, TypeError, ValueError):
        raise DatasetError(path, key, f"a {shape[0]}x{shape[1]} matrix of numbers (list of rows)") from None
    if m.shape != shape or not np.all(np.isfinite(m)):
        raise DatasetError(path, key, f"a finite {shape[0]}x{shape[1]} matrix, got shape {list(m.shape)}")
    return m


def _read_json(path: Path, field: str, expected: str) -> Any:
    """The parsed JSON of `path`; DatasetError naming `field` and `expected` when it is not UTF-8 JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(path, field, f"{expected} ({e})") from None


def parse_calib(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """`calib.json` -> (`K [3, 3]`, `T_cam_from_lidar [4, 4]`); DatasetError naming the field on any problem."""
    doc = _read_json(path, "calib", "a JSON object")
    if not isinstance(doc, dict):
        raise DatasetError(path, "calib", "a JSON object with 'intrinsics' and 'lidar_to_camera'")
    K = _matrix(doc, "intrinsics", (3, 3), path)
    T = _matrix(doc, "lidar_to_camera", (4, 4), path)
    if not (K[2, 0] == 0 and K[2, 1] == 0 and K[2, 2] == 1 and K[1, 0] == 0):
        raise DatasetError(path, "intrinsics", "a pinhole matrix [[fx, s, cx], [0, fy, cy], [0, 0, 1]]")
    if not orthonormal(T[:3, :3]) or not np.allclose(T[3], [0, 0, 0, 1]):
        raise DatasetError(path, "lidar_to_camera", "a rigid transform: rotation block orthonormal, last row 0 0 0 1")
    return K, T


def parse_labels(path: Path) -> Boxes3D:
    """`labels.json` -> `Boxes3D` (lidar frame, difficulty -1: unknown); DatasetError naming the entry."""
    doc = _read_json(path, "labels", "a JSON list of objects")
    if not isinstance(doc, list):
        raise DatasetError(path, "labels", 'a JSON list of {"name": str, "box": [x, y, z, l, w, h, yaw]}')
    if len(doc) > MAX_OBJECTS:
        raise DatasetError(path, "labels", f"at most {MAX_OBJECTS} objects in a frame, got {len(doc)}")
    boxes, names = [], []
    for i, obj in enumerate(doc):
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or not name:
            raise DatasetError(path, f"[{i}].name", "a class name (non-empty string)")
        try:
            box = np.asarray(obj.get("box"), dtype=np.float64)
        except (TypeError, ValueError):
            box = np.zeros(0)
        if box.shape != (7,) or not np.all(np.isfinite(box)):
            raise DatasetError(path, f"[{i}].box", "7 finite numbers x, y, z, l, w, h, yaw (lidar frame, metres, rad)")
        if np.any(box[3:6] <= 0) or np.any(box[3:6] > MAX_BOX_SIZE_M):
            raise DatasetError(path, f"[{i}].box", f"positive l, w, h of at most {MAX_BOX_SIZE_M:g} m, got {box[3:6].tolist()}")
        if np.any(np.abs(box[:3]) > MAX_BOX_RANGE_M):
            raise DatasetError(path, f"[{i}].box", f"a centre within {MAX_BOX_RANGE_M:g} m of the lidar, got {box[:3].tolist()}")
        boxes.append(box)
        names.append(name)
    return Boxes3D(np.asarray(boxes).reshape(-1, 7), names, np.full(len(names), -1, dtype=np.int8))


class FolderDataset(DatasetReader):
    """Reader of the folder-per-frame layout (module docstring): frame id = the folder's name."""

    layout = "folder"
    title = "folder-per-frame"
    describe = "a folder per frame (<id>/lidar.npy, camera.jpg, calib.json, labels.json)"
    intensity_range = (0.0, 1.0)
    results_writer = None  # no benchmark of its own: the factory's KPIs only

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @classmethod
    def detect(cls, root: Path) -> FolderDataset | None:
        """A reader when some folder directly under `root` holds a `lidar.npy`."""
        return cls(root) if any((d / "lidar.npy").is_file() for d in root.iterdir() if d.is_dir()) else None

    def frame_ids(self) -> list[str]:
        """Names of the folders holding any of the layout's files, sorted."""
        return sorted(d.name for d in self.root.iterdir() if d.is_dir() and any((d / f).exists() for f in FILES))

    def frame_files(self, frame_id: str) -> list[tuple[str, Path]]:
        named = [(f"{frame_id}/{f}", self.root / frame_id / f) for f in FILES]
        return [(name, p) for name, p in named if p.is_file()]

    def _read(self, frame_id: str, with_labels: bool) -> Frame:
        folder = self.root / frame_id
        for f in FILES:
            if f == "labels.json" and not with_labels:
                continue
            if not (folder / f).is_file():
                raise DatasetError(folder / f, f.split(".")[0], f"the {f} file of frame {frame_id} ({absent(folder / f)})")
        points = read_lidar(folder / "lidar.npy")
        K, T = parse_calib(folder / "calib.json")
        cam = CameraView(CAMERA, folder / "camera.jpg", K, T, image_size(folder / "camera.jpg"))
        boxes = parse_labels(folder / "labels.json") if with_labels else Boxes3D.empty()
        return Frame(frame_id, points, [cam], boxes, lidar_path=folder / "lidar.npy", source=self.layout)

    def inspect(self, frame_id: str, min_points: int, keep_images: bool, decode: bool = True) -> FrameCheck:
        """Every problem of one frame: each file missing, the points (shape, finite, count, range,
        intensity units), the image (decodes, is a JPEG), the calibration (pinhole, rigid, plausible focal
        and principal point) and the labels; then the reader's own read."""
        folder = self.root / frame_id
        probs = Problems(frame_id, self.root)
        images: dict[str, np.ndarray] = {}
        for f in FILES:
            if not (folder / f).is_file():
                probs.add(folder / f, f.split(".")[0], f"the {f} file of frame {frame_id} ({absent(folder / f)})")
        if probs:
            return FrameCheck(frame_id, probs)
        try:
            pts = read_lidar(folder / "lidar.npy")
            for field, reason in check_points_bytes(pts.tobytes(), 4, self.intensity_range, min_points):
                probs.add(folder / "lidar.npy", field, reason)
        except DatasetError as e:
            probs.add(e.file, e.field, e.expected)
        rgb, size, err = decode_image_checked((folder / "camera.jpg").read_bytes(), keep_images, decode, "JPEG")
        if err:
            probs.add(folder / "camera.jpg", "image", err)
        elif rgb is not None:
            images[CAMERA] = rgb
        try:
            K, _ = parse_calib(folder / "calib.json")
            for why in (check_focal(K[0, 0], K[1, 1]), "" if err else check_principal_point(K, size)):
                if why:
                    probs.add(folder / "calib.json", "intrinsics", why)
        except DatasetError as e:
            probs.add(e.file, e.field, e.expected)
        try:
            parse_labels(folder / "labels.json")
        except DatasetError as e:
            probs.add(e.file, e.field, e.expected)
        return finish_check(self, frame_id, probs, images)
