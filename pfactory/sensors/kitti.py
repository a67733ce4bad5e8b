"""KITTI object layout: reader, writer and the camera-frame <-> lidar-frame label conversion.

Layout (per split, e.g. `root/training/`): `velodyne/<id>.bin` float32 `[N, 4]`
`(x, y, z, reflectance)`, `image_2/<id>.png`, `calib/<id>.txt` (P0..P3 `[3, 4]`, `R0_rect [3, 3]`,
`Tr_velo_to_cam [3, 4]`, `Tr_imu_to_velo`), `label_2/<id>.txt` (15 columns; 16 with a score in
result files): type, truncated, occluded, alpha, bbox x1 y1 x2 y2, dimensions h w l,
location x y z (bottom centre, rectified camera frame), rotation_y.

Labels are converted exactly into the lidar frame: centre `= inv(R0_rect @ Tr_velo_to_cam) @
(location - [0, h/2, 0])`, and the heading is the box's length axis `(cos ry, 0, -sin ry)`
rotated into the lidar frame. The image of camera 2 is `K = P2[:, :3]` with
`T_cam_from_lidar = [I | K^-1 P2[:, 3]] @ R0_rect @ Tr_velo_to_cam`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pfactory.fsutil import atomic_write_bytes, atomic_write_text
from pfactory.sensors.frame import Boxes3D, CameraView, DatasetError, Frame

KITTI_PARTS = {"velodyne": ".bin", "image_2": ".png", "calib": ".txt", "label_2": ".txt"}
KITTI_CLASSES = ("Car", "Van", "Truck", "Pedestrian", "Person_sitting", "Cyclist", "Tram", "Misc", "DontCare")
CALIB_SHAPES = {
    "P0": (3, 4),
    "P1": (3, 4),
    "P2": (3, 4),
    "P3": (3, 4),
    "R0_rect": (3, 3),
    "Tr_velo_to_cam": (3, 4),
}
# KITTI benchmark difficulty: (min 2D height px, max occlusion level, max truncation).
DIFFICULTY_RULES = ((40.0, 0, 0.15), (25.0, 1, 0.30), (25.0, 2, 0.50))


@dataclass
class KittiObject:
    """One line of a KITTI label (or result) file, in the rectified camera frame."""

    type: str
    truncation: float
    occlusion: int
    alpha: float
    bbox: np.ndarray  # [4] x1, y1, x2, y2 (pixels)
    dimensions_hwl: np.ndarray  # [3] height, width, length (metres)
    location: np.ndarray  # [3] bottom centre x, y, z (rectified camera frame, metres)
    rotation_y: float
    score: float | None = None

    def to_line(self) -> str:
        vals = [
            self.type,
            f"{self.truncation:.2f}",
            str(int(self.occlusion)),
            f"{self.alpha:.2f}",
            *(f"{v:.2f}" for v in self.bbox),
            *(f"{v:.2f}" for v in self.dimensions_hwl),
            *(f"{v:.2f}" for v in self.location),
            f"{self.rotation_y:.2f}",
        ]
        if self.score is not None:
            vals.append(f"{self.score:.4f}")
        return " ".join(vals)


@dataclass
class KittiCalib:
    """A KITTI calib file: projections `P0..P3 [3, 4]`, `R0_rect [3, 3]`, `Tr_velo_to_cam [3, 4]`."""

    P: dict[str, np.ndarray]
    R0_rect: np.ndarray
    Tr_velo_to_cam: np.ndarray
    extra: dict[str, np.ndarray]

    @property
    def T_rect_from_lidar(self) -> np.ndarray:
        """4x4: lidar frame -> rectified camera-0 frame."""
        R0 = np.eye(4)
        R0[:3, :3] = self.R0_rect
        Tr = np.eye(4)
        Tr[:3, :] = self.Tr_velo_to_cam
        return R0 @ Tr

    def camera(self, index: int = 2) -> tuple[np.ndarray, np.ndarray]:
        """`(K [3, 3], T_cam_from_lidar [4, 4])` of camera `index` (2 = left colour)."""
        P = self.P[f"P{index}"]
        K = P[:, :3].copy()
        T_cam_from_rect = np.eye(4)
        T_cam_from_rect[:3, 3] = np.linalg.solve(K, P[:, 3])
        return K, T_cam_from_rect @ self.T_rect_from_lidar

    @classmethod
    def from_camera(cls, K: np.ndarray, T_cam_from_lidar: np.ndarray) -> KittiCalib:
        """A calib whose camera 2 is `K` at `T_cam_from_lidar` (R0_rect = I, P2 = [K | 0])."""
        P = np.zeros((3, 4))
        P[:, :3] = K
        return cls(
            {f"P{i}": P.copy() for i in range(4)}, np.eye(3), np.asarray(T_cam_from_lidar)[:3].copy(), {}
        )

    def to_text(self) -> str:
        rows = [f"P{i}: " + " ".join(f"{v:.12e}" for v in self.P[f"P{i}"].ravel()) for i in range(4)]
        rows.append("R0_rect: " + " ".join(f"{v:.12e}" for v in self.R0_rect.ravel()))
        rows.append("Tr_velo_to_cam: " + " ".join(f"{v:.12e}" for v in self.Tr_velo_to_cam.ravel()))
        imu = self.extra.get("Tr_imu_to_velo", np.hstack([np.eye(3), np.zeros((3, 1))]))
        rows.append("Tr_imu_to_velo: " + " ".join(f"{v:.12e}" for v in np.asarray(imu).ravel()))
        return "\n".join(rows) + "\n"


def parse_calib(path: str | Path) -> KittiCalib:
    """Parse a KITTI calib file; DatasetError names the missing/malformed matrix."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(path, "calib", f"a readable text file ({e})") from e
    mats: dict[str, np.ndarray] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, sep, rest = line.partition(":")
        if not sep:
            raise DatasetError(path, f"line {lineno}", "'KEY: v1 v2 ...'")
        try:
            mats[key.strip()] = np.array([float(v) for v in rest.split()], dtype=np.float64)
        except ValueError as e:
            raise DatasetError(path, key.strip(), f"numeric values ({e})") from e
    out: dict[str, np.ndarray] = {}
    for key, shape in CALIB_SHAPES.items():
        if key not in mats:
            raise DatasetError(path, key, f"a {shape[0]}x{shape[1]} matrix (missing)")
        v = mats[key]
        if v.size != shape[0] * shape[1]:
            raise DatasetError(
                path, key, f"{shape[0] * shape[1]} values for a {shape[0]}x{shape[1]} matrix, got {v.size}"
            )
        if not np.all(np.isfinite(v)):
            raise DatasetError(path, key, "finite values")
        out[key] = v.reshape(shape)
    if abs(np.linalg.det(out["P2"][:, :3])) < 1e-9:
        raise DatasetError(path, "P2", "an invertible left 3x3 block (camera intrinsics)")
    extra = {k: v for k, v in mats.items() if k not in CALIB_SHAPES}
    return KittiCalib(
        {k: out[k] for k in ("P0", "P1", "P2", "P3")}, out["R0_rect"], out["Tr_velo_to_cam"], extra
    )


def parse_label_file(path: str | Path, with_score: bool | None = None) -> list[KittiObject]:
    """Parse a KITTI label file (15 columns) or result file (16, last = score).

    `with_score=None` accepts either per line; True/False demands 16/15 columns. Raises
    DatasetError naming the file, the line and the field.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(path, "label", f"a readable text file ({e})") from e
    return parse_label_lines(text, path, with_score)


_LABEL_FIELDS = (
    "truncated", "occluded", "alpha", "bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2",
    "height", "width", "length", "x", "y", "z", "rotation_y", "score",
)  # fmt: skip


def parse_label_lines(
    text: str, path: str | Path = "<label>", with_score: bool | None = None
) -> list[KittiObject]:
    """Parse the text of a KITTI label/result file (see `parse_label_file`)."""
    objs = []
    allowed = {None: (15, 16), False: (15,), True: (16,)}[with_score]
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise DatasetError(path, f"line {lineno}", f"{want} space-separated fields, got {len(parts)}")
        vals = []
        for name, tok in zip(_LABEL_FIELDS, parts[1:]):
            try:
                v = float(tok)
            except ValueError:
                raise DatasetError(path, f"line {lineno} {name}", f"a number, got {tok!r}") from None
            if not np.isfinite(v):
                raise DatasetError(path, f"line {lineno} {name}", f"a finite number, got {tok!r}")
            vals.append(v)
        objs.append(
            KittiObject(
                type=parts[0],
                truncation=vals[0],
                occlusion=int(vals[1]),
                alpha=vals[2],
                bbox=np.array(vals[3:7]),
                dimensions_hwl=np.array(vals[7:10]),
                location=np.array(vals[10:13]),
                rotation_y=vals[13],
                score=vals[14] if len(vals) == 15 else None,
            )
        )
    return objs


def objects_to_lidar_boxes(objs: list[KittiObject], T_rect_from_lidar: np.ndarray) -> np.ndarray:
    """Camera-frame KITTI objects -> lidar-frame boxes `[M, 7]` (x, y, z, l, w, h, yaw)."""
    # The matrix inverse, not the rigid shortcut R^T: KITTI prints R0_rect and Tr_velo_to_cam to
    # 7 digits, so R^T misses R^-1 by ~1e-7 and centres would drift by ~1e-6 m at 10 m.
    T = np.linalg.inv(T_rect_from_lidar)
    out = np.zeros((len(objs), 7))
    for i, o in enumerate(objs):
        h, w, l = o.dimensions_hwl
        centre_rect = o.location - np.array([0.0, h / 2, 0.0])  # camera y points down
        heading_rect = np.array([np.cos(o.rotation_y), 0.0, -np.sin(o.rotation_y)])
        centre = T[:3, :3] @ centre_rect + T[:3, 3]
        heading = T[:3, :3] @ heading_rect
        out[i] = [*centre, l, w, h, np.arctan2(heading[1], heading[0])]
    return out


def lidar_boxes_to_objects(
    boxes: np.ndarray, names: list[str], T_rect_from_lidar: np.ndarray, **per_box: np.ndarray
) -> list[KittiObject]:
    """Lidar-frame boxes `[M, 7]` -> KITTI objects (inverse of `objects_to_lidar_boxes`).

    `per_box` may hold arrays of length M named `truncation`, `occlusion`, `bbox` ([M, 4]),
    `score`; missing ones default to 0 / no score. `alpha` is computed from the location.
    """
    L = np.linalg.inv(T_rect_from_lidar)[:3, :3]  # rect -> lidar, as `objects_to_lidar_boxes` uses it
    objs = []
    for i, b in enumerate(np.asarray(boxes, dtype=np.float64).reshape(-1, 7)):
        x, y, z, l, w, h, yaw = b
        centre = T_rect_from_lidar[:3, :3] @ np.array([x, y, z]) + T_rect_from_lidar[:3, 3]
        # rotation_y is solved so that `objects_to_lidar_boxes` gives `yaw` back exactly: the
        # length axis (cos ry, 0, -sin ry) mapped into the lidar frame must have no component
        # across the heading n = (-sin yaw, cos yaw, 0), i.e. cos ry (n.L0) - sin ry (n.L2) = 0.
        # Rotating the heading into the rect frame and dropping its y instead would be off by
        # O(tilt^2) (~7e-5 rad for KITTI's 0.8 deg camera-lidar tilt).
        n = np.array([-np.sin(yaw), np.cos(yaw), 0.0])
        ry = float(np.arctan2(n @ L[:, 0], n @ L[:, 2]))
        v = np.cos(ry) * L[:, 0] - np.sin(ry) * L[:, 2]
        if v[0] * np.cos(yaw) + v[1] * np.sin(yaw) < 0:  # the opposite direction: flip by pi
            ry = float((ry + 2 * np.pi) % (2 * np.pi) - np.pi)
        loc = centre + np.array([0.0, h / 2, 0.0])
        alpha = ry - np.arctan2(loc[0], loc[2])
        alpha = float((alpha + np.pi) % (2 * np.pi) - np.pi)
        score = per_box.get("score")
        objs.append(
            KittiObject(
                type=names[i],
                truncation=float(per_box["truncation"][i]) if "truncation" in per_box else 0.0,
                occlusion=int(per_box["occlusion"][i]) if "occlusion" in per_box else 0,
                alpha=alpha,
                bbox=np.asarray(per_box["bbox"][i], dtype=np.float64) if "bbox" in per_box else np.zeros(4),
                dimensions_hwl=np.array([h, w, l]),
                location=loc,
                rotation_y=ry,
                score=float(score[i]) if score is not None else None,
            )
        )
    return objs


def kitti_difficulty(height_px: float, occlusion: int, truncation: float) -> int:
    """KITTI benchmark difficulty: 0 easy, 1 moderate, 2 hard, -1 none of them."""
    for level, (min_h, max_occ, max_trunc) in enumerate(DIFFICULTY_RULES):
        if height_px >= min_h and occlusion <= max_occ and truncation <= max_trunc:
            return level
    return -1


def read_points(path: str | Path, dims: int = 4) -> np.ndarray:
    """Read a float32 point file `[N, dims]`; DatasetError on empty, ragged or non-finite data."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DatasetError(path, "points", f"a readable file ({e})") from e
    if len(raw) == 0:
        raise DatasetError(path, "points", f"float32 x{dims} records, got an empty file")
    if len(raw) % (4 * dims):
        raise DatasetError(
            path, "points", f"a size that is a multiple of {4 * dims} bytes (float32 x{dims}), got {len(raw)}"
        )
    pts = np.frombuffer(raw, dtype=np.float32).reshape(-1, dims)
    if not np.all(np.isfinite(pts)):
        bad = int((~np.isfinite(pts)).any(1).sum())
        raise DatasetError(path, "points", f"finite values, {bad} of {len(pts)} points are NaN/Inf")
    return pts


def image_size(path: str | Path) -> tuple[int, int]:
    """`(width, height)` from the image header (no full decode)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.size
    except Exception as e:
        raise DatasetError(path, "image", f"a readable PNG/JPEG header ({type(e).__name__}: {e})") from e


def find_kitti_split(root: Path) -> Path | None:
    """The directory holding the KITTI parts (`root/training` or `root`), or None."""
    for cand in (root / "training", root):
        if all((cand / part).is_dir() for part in ("velodyne", "calib")) and (cand / "image_2").is_dir():
            return cand
    return None


class KittiDataset:
    """Reader for one KITTI object split directory (with velodyne/, image_2/, calib/, label_2/)."""

    layout = "kitti"

    def __init__(self, split_dir: str | Path):
        self.root = Path(split_dir)

    def frame_ids(self) -> list[str]:
        """Sorted ids of every frame that has at least one part present."""
        ids: set[str] = set()
        for part, ext in KITTI_PARTS.items():
            d = self.root / part
            if d.is_dir():
                ids.update(p.name[: -len(ext)] for p in d.iterdir() if p.name.endswith(ext))
        return sorted(ids)

    def part_path(self, part: str, frame_id: str) -> Path:
        return self.root / part / f"{frame_id}{KITTI_PARTS[part]}"

    def read(self, frame_id: str, with_labels: bool = True) -> Frame:
        """Read one frame into the lidar-frame convention; DatasetError on any problem."""
        try:
            return self._read(frame_id, with_labels)
        except DatasetError as e:
            e.frame_id = frame_id
            raise

    def _read(self, frame_id: str, with_labels: bool) -> Frame:
        paths = {part: self.part_path(part, frame_id) for part in KITTI_PARTS}
        for part, p in paths.items():
            if part == "label_2" and not with_labels:
                continue
            if not p.is_file():
                raise DatasetError(p, part, f"the {part} file of frame {frame_id} (missing)")
        calib = parse_calib(paths["calib"])
        points = read_points(paths["velodyne"])
        K, T_cam_from_lidar = calib.camera(2)
        size = image_size(paths["image_2"])
        cam = CameraView("image_2", paths["image_2"], K, T_cam_from_lidar, size)
        boxes = Boxes3D.empty()
        if with_labels:
            objs = parse_label_file(paths["label_2"], with_score=False)
            boxes = labels_to_boxes(objs, calib, paths["label_2"])
        return Frame(frame_id, points, [cam], boxes, lidar_path=paths["velodyne"], source="kitti")


def labels_to_boxes(objs: list[KittiObject], calib: KittiCalib, path: Path | str = "<label>") -> Boxes3D:
    """KITTI objects -> `Boxes3D` in the lidar frame; DontCare rows become 2D ignore regions."""
    real = [o for o in objs if o.type != "DontCare"]
    for i, o in enumerate(objs):
        if o.type == "DontCare":
            continue
        if o.type not in KITTI_CLASSES:
            raise DatasetError(
                path, f"line {i + 1} type", f"one of {', '.join(KITTI_CLASSES)}, got {o.type!r}"
            )
        if np.any(o.dimensions_hwl <= 0):
            raise DatasetError(
                path, f"line {i + 1} dimensions", f"positive h, w, l, got {o.dimensions_hwl.tolist()}"
            )
    boxes = objects_to_lidar_boxes(real, calib.T_rect_from_lidar)
    bbox = np.array([o.bbox for o in real]).reshape(-1, 4)
    trunc = np.array([o.truncation for o in real])
    occ = np.array([o.occlusion for o in real], dtype=np.int8)
    diff = np.array(
        [kitti_difficulty(b[3] - b[1], oc, t) for b, oc, t in zip(bbox, occ, trunc)], dtype=np.int8
    )
    dontcare = np.array([o.bbox for o in objs if o.type == "DontCare"]).reshape(-1, 4)
    return Boxes3D(boxes, [o.type for o in real], diff, trunc, occ, bbox, dontcare)


def write_kitti_frame(
    split_dir: str | Path,
    frame_id: str,
    points: np.ndarray,
    image_png: bytes,
    calib: KittiCalib,
    objects: list[KittiObject],
) -> None:
    """Write one frame in the KITTI object layout, each file atomically.

    `points [N, 4]` float32 lidar frame; `image_png` encoded PNG bytes; `objects` in the
    rectified camera frame (see `lidar_boxes_to_objects`).
    """
    root = Path(split_dir)
    pts = np.ascontiguousarray(points, dtype=np.float32).reshape(-1, 4)
    atomic_write_bytes(root / "velodyne" / f"{frame_id}.bin", pts.tobytes())
    atomic_write_bytes(root / "image_2" / f"{frame_id}.png", image_png)
    atomic_write_text(root / "calib" / f"{frame_id}.txt", calib.to_text())
    atomic_write_text(root / "label_2" / f"{frame_id}.txt", "".join(o.to_line() + "\n" for o in objects))
