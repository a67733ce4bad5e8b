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

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pfactory.sensors.checks import (
    IMAGE_SUFFIXES,
    MAX_ABS_ANGLE,
    MAX_BOX_RANGE_M,
    MAX_BOX_SIZE_M,
    MAX_OBJECTS,
    FrameCheck,
    Problem,
    Problems,
    absent,
    check_focal,
    check_points_file,
    check_principal_point,
    decode_image_checked,
    finish_check,
    image_format_of,
    orthonormal,
    rel_path,
)
from pfactory.sensors.errors import DatasetError
from pfactory.sensors.frame import Boxes3D, CameraView, Frame
from pfactory.sensors.io import image_size, read_points
from pfactory.sensors.reader import DatasetReader, RemoteListing, RemoteStore
from pfactory.storage.fsutil import atomic_write_bytes, atomic_write_text

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
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(path, "calib", f"a readable UTF-8 text file ({e})") from e
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
    why = check_focal(float(out["P2"][0, 0]), float(out["P2"][1, 1]))
    if why:
        raise DatasetError(path, "P2", why)
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
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(path, "label", f"a readable UTF-8 text file ({e})") from e
    return parse_label_lines(text, path, with_score)


LABEL_FIELDS = (
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
        for name, tok in zip(LABEL_FIELDS, parts[1:]):
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


def find_kitti_split(root: Path) -> Path | None:
    """The directory holding the KITTI parts (`root/training` or `root`), or None."""
    for cand in (root / "training", root):
        if all((cand / part).is_dir() for part in ("velodyne", "calib")) and (cand / "image_2").is_dir():
            return cand
    return None


class KittiDataset(DatasetReader):
    """Reader for one KITTI object split directory (with velodyne/, image_2/, calib/, label_2/)."""

    layout = "kitti"
    title = "KITTI"
    describe = "a KITTI object layout (training/velodyne, image_2, calib, label_2)"
    intensity_range = (0.0, 1.0)  # reflectance
    results_writer = "pfactory.evaluate.kitti_results:KittiResults"

    def __init__(self, split_dir: str | Path):
        self.root = Path(split_dir)
        # Files per part and frame key, built at the first check (`_kitti_index`), so that
        # prepare checking frame by frame does not rescan a directory per frame. A dataset
        # whose files change afterwards needs a fresh `open_dataset`.
        self._check_index: dict[str, dict[str, list[Path]]] | None = None

    @classmethod
    def detect(cls, root: Path) -> KittiDataset | None:
        split = find_kitti_split(root)
        return None if split is None else cls(split)

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

    def frame_files(self, frame_id: str) -> list[tuple[str, Path]]:
        """`(part/<id><ext>, path)` of each part file of the frame that exists."""
        named = [
            (f"{part}/{frame_id}{ext}", self.part_path(part, frame_id)) for part, ext in KITTI_PARTS.items()
        ]
        return [(name, p) for name, p in named if p.is_file()]

    def replicate(self, out: Path, n: int, samples: list[str] | None = None) -> Path:
        """`n` frames `000000..n-1` under `out/training`, frame i a symlink per part to the files of frame
        `samples[i % len(samples)]` (default: every frame)."""
        ids = samples or self.frame_ids()
        root = Path(out) / "training"
        for part, ext in KITTI_PARTS.items():
            (root / part).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                target = self.part_path(part, ids[i % len(ids)]).resolve()
                link = root / part / f"{i:06d}{ext}"
                if not link.is_symlink():
                    os.symlink(target, link)
        return Path(out)

    @classmethod
    def list_remote(cls, store: RemoteStore, scratch: Path) -> RemoteListing | None:
        """KITTI on object storage: the names in each part folder (`training/` or the root); each unit
        downloads every file of each part that names one of its frames, so duplicate names are caught as
        locally. No shared files."""
        for cand in ("training", ""):
            pre = f"{cand}/" if cand else ""
            if all(store.is_dir(f"{pre}{p}") for p in ("velodyne", "calib", "image_2")):
                break
        else:
            return None
        names = {p: store.names(f"{pre}{p}") for p in KITTI_PARTS}
        index = kitti_names_index(names)

        def unit_files(ids: list[str]) -> list[str]:
            out: set[str] = set()
            for fid in ids:
                key = _kitti_key(fid)
                for part, by_key in index.items():
                    out.update(f"{pre}{part}/{n}" for n in by_key.get(key, []))
            return sorted(out)

        dirs = [f"{pre}{p}" for p in KITTI_PARTS if store.is_dir(f"{pre}{p}")]
        return RemoteListing(kitti_ids_from_names(names), dirs, unit_files)

    def _read(self, frame_id: str, with_labels: bool) -> Frame:
        paths = {part: self.part_path(part, frame_id) for part in KITTI_PARTS}
        for part, p in paths.items():
            if part == "label_2" and not with_labels:
                continue
            if not p.is_file():
                raise DatasetError(p, part, f"the {part} file of frame {frame_id} ({absent(p)})")
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

    def check_ids(self) -> list[str]:
        return kitti_frame_ids(self)

    def dataset_problems(self) -> list[Problem]:
        _kitti_index(self)  # built once here, before check_dataset's threads need it
        return []

    def inspect(self, frame_id: str, min_points: int, keep_images: bool, decode: bool = True) -> FrameCheck:
        return _inspect_kitti(self, frame_id, min_points, keep_images, decode)


def labels_to_boxes(objs: list[KittiObject], calib: KittiCalib, path: Path | str = "<label>") -> Boxes3D:
    """KITTI objects -> `Boxes3D` in the lidar frame; DontCare rows become 2D ignore regions."""
    real = [o for o in objs if o.type != "DontCare"]
    if len(objs) > MAX_OBJECTS:
        raise DatasetError(path, "label", f"at most {MAX_OBJECTS} objects in a frame, got {len(objs)}")
    for i, o in enumerate(objs):
        if o.type == "DontCare":
            continue
        if o.type not in KITTI_CLASSES:
            raise DatasetError(
                path, f"line {i + 1} type", f"one of {', '.join(KITTI_CLASSES)}, got {o.type!r}"
            )
        if np.any(o.dimensions_hwl <= 0) or np.any(o.dimensions_hwl > MAX_BOX_SIZE_M):
            raise DatasetError(
                path,
                f"line {i + 1} dimensions",
                f"positive h, w, l of at most {MAX_BOX_SIZE_M:g} m, got {o.dimensions_hwl.tolist()}",
            )
        if np.any(np.abs(o.location) > MAX_BOX_RANGE_M):
            raise DatasetError(
                path,
                f"line {i + 1} location",
                f"a location within {MAX_BOX_RANGE_M:g} m of the camera, got {o.location.tolist()}",
            )
        if abs(o.rotation_y) > MAX_ABS_ANGLE:
            raise DatasetError(
                path, f"line {i + 1} rotation_y", f"an angle in [-pi, pi] (radians), got {o.rotation_y:g}"
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


# --- strict validation (`factory data check`, prepare's per-frame check): every problem, not the first


def _kitti_key(stem: str) -> str:
    """What a KITTI file stem means as a frame: the number for numeric stems, else the stem."""
    s = stem.lower()
    return str(int(s)) if s.isdigit() else s


def kitti_names_index(names: dict[str, list[str]]) -> dict[str, dict[str, list[str]]]:
    """part -> frame key -> the file names in that part that name that frame, from the file names of each
    part folder (a directory listing, or an object-store listing: `pfactory.storage.objects`)."""
    idx: dict[str, dict[str, list[str]]] = {}
    for part, ext in KITTI_PARTS.items():
        suffixes = IMAGE_SUFFIXES if part == "image_2" else (ext,)
        by_key: dict[str, list[str]] = {}
        for n in sorted(names.get(part, [])):
            p = Path(n)
            if p.suffix.lower() in suffixes:
                by_key.setdefault(_kitti_key(p.stem), []).append(n)
        idx[part] = by_key
    return idx


def kitti_ids_from_names(names: dict[str, list[str]]) -> list[str]:
    """Frame ids of a KITTI split from the file names of its part folders: the ids the reader sees (names
    with the part's extension) plus the stems of files it would not read (`000001.PNG`)."""
    ids = {
        n[: -len(ext)] for part, ext in KITTI_PARTS.items() for n in names.get(part, []) if n.endswith(ext)
    }
    for by_key in kitti_names_index(names).values():
        for files in by_key.values():
            ids.update(Path(n).stem for n in files)
    return sorted(ids)


def _kitti_file_names(ds: KittiDataset) -> dict[str, list[str]]:
    return {
        part: [p.name for p in (ds.root / part).iterdir() if p.is_file()] if (ds.root / part).is_dir() else []
        for part in KITTI_PARTS
    }


def _kitti_index(ds: KittiDataset) -> dict[str, dict[str, list[Path]]]:
    """part -> frame key -> every file in that part that names that frame."""
    idx = ds._check_index
    if idx is None:
        idx = {
            part: {k: [ds.root / part / n for n in files] for k, files in by_key.items()}
            for part, by_key in kitti_names_index(_kitti_file_names(ds)).items()
        }
        ds._check_index = idx
    return idx


def kitti_frame_ids(ds: KittiDataset) -> list[str]:
    """Every frame id the reader sees, plus stems of files it would not read (`000001.PNG`)."""
    return sorted(set(ds.frame_ids()) | set(kitti_ids_from_names(_kitti_file_names(ds))))


def calib_problems(text: str) -> tuple[list[tuple[str, str]], dict[str, np.ndarray]]:
    """Collecting version of `parse_calib`: every malformed/missing matrix, and the good ones."""
    out: list[tuple[str, str]] = []
    mats: dict[str, np.ndarray] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, sep, rest = line.partition(":")
        key = key.strip()
        if not sep:
            out.append((f"line {lineno}", f"'KEY: v1 v2 ...', got {line[:40]!r}"))
            continue
        try:
            vals = np.array([float(v) for v in rest.split()], dtype=np.float64)
        except ValueError as e:
            out.append((key, f"numeric values ({e})"))
            continue
        if key in mats:
            out.append((key, "one line per matrix, found it twice"))
        mats[key] = vals
    good: dict[str, np.ndarray] = {}
    for key, shape in CALIB_SHAPES.items():
        n = shape[0] * shape[1]
        v = mats.get(key)
        if v is None:
            if not any(f == key for f, _ in out):  # non-numeric lines were already reported
                out.append((key, f"a {shape[0]}x{shape[1]} matrix (missing)"))
        elif v.size != n:
            out.append((key, f"{n} values for a {shape[0]}x{shape[1]} matrix, got {v.size}"))
        elif not np.all(np.isfinite(v)):
            out.append((key, f"finite values, got {int((~np.isfinite(v)).sum())} NaN/Inf"))
        else:
            good[key] = v.reshape(shape)
    if "P2" in good:
        K = good["P2"][:, :3]
        if not (K[0, 0] > 0 and K[1, 1] > 0):
            out.append(("P2", f"intrinsics with positive focal lengths, got fx={K[0, 0]:g}, fy={K[1, 1]:g}"))
            del good["P2"]
        elif check_focal(float(K[0, 0]), float(K[1, 1])):
            out.append(("P2", check_focal(float(K[0, 0]), float(K[1, 1]))))
            del good["P2"]
        elif abs(np.linalg.det(K)) <= 1e-9:
            out.append(("P2", "an invertible left 3x3 block (camera intrinsics)"))
            del good["P2"]
        elif not np.allclose(K[2], [0, 0, 1], atol=1e-6):
            out.append(("P2", f"a last row [0, 0, 1, t] (pinhole camera), got {K[2].tolist()}"))
            del good["P2"]
    if "R0_rect" in good and not orthonormal(good["R0_rect"]):
        out.append(("R0_rect", "a rotation matrix (orthonormal, det +1)"))
    if "Tr_velo_to_cam" in good and not orthonormal(good["Tr_velo_to_cam"][:, :3]):
        out.append(("Tr_velo_to_cam", "a rigid transform [R | t] with R orthonormal, det +1"))
    return out, good


def label_problems(text: str) -> list[tuple[str, str]]:
    """Every problem of every line of a KITTI label file (15 fields per line)."""
    out: list[tuple[str, str]] = []
    n_objects = sum(1 for line in text.splitlines() if line.strip())
    if n_objects > MAX_OBJECTS:
        return [("label", f"at most {MAX_OBJECTS} objects in a frame, got {n_objects} lines")]
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 15:
            out.append((f"line {lineno}", f"15 space-separated fields, got {len(parts)}"))
            continue  # the columns are shifted: per-field checks would only add noise
        cls = parts[0]
        if cls not in KITTI_CLASSES:
            out.append((f"line {lineno} type", f"one of {', '.join(KITTI_CLASSES)}, got {cls!r}"))
        vals: dict[str, float] = {}
        for name, tok in zip(LABEL_FIELDS, parts[1:]):
            try:
                v = float(tok)
            except ValueError:
                out.append((f"line {lineno} {name}", f"a number, got {tok!r}"))
                continue
            if not np.isfinite(v):
                out.append((f"line {lineno} {name}", f"a finite number, got {tok!r}"))
                continue
            vals[name] = v
        if cls == "DontCare":
            continue  # DontCare rows carry -1 / -1000 sentinels: only the 2D box matters
        hwl = [vals.get(k) for k in ("height", "width", "length")]
        if all(v is not None for v in hwl) and (min(hwl) <= 0 or max(hwl) > MAX_BOX_SIZE_M):
            out.append(
                (f"line {lineno} dimensions", f"positive h, w, l of at most {MAX_BOX_SIZE_M:g} m, got {hwl}")
            )
        loc = [vals.get(k) for k in ("x", "y", "z")]
        if any(v is not None and abs(v) > MAX_BOX_RANGE_M for v in loc):
            out.append(
                (
                    f"line {lineno} location",
                    f"a location within {MAX_BOX_RANGE_M:g} m of the camera, got {loc}",
                )
            )
        if "rotation_y" in vals and abs(vals["rotation_y"]) > MAX_ABS_ANGLE:
            out.append(
                (f"line {lineno} rotation_y", f"an angle in [-pi, pi] (radians), got {vals['rotation_y']:g}")
            )
        if "z" in vals and vals["z"] <= 0:
            out.append(
                (
                    f"line {lineno} z",
                    f"a location in front of the camera (z > 0 m), got z = {vals['z']:g}",
                )
            )
        if "truncated" in vals and not 0 <= vals["truncated"] <= 1:
            out.append((f"line {lineno} truncated", f"a fraction in [0, 1], got {vals['truncated']:g}"))
        if "occluded" in vals and vals["occluded"] not in (0, 1, 2, 3):
            out.append((f"line {lineno} occluded", f"0, 1, 2 or 3, got {vals['occluded']:g}"))
    return out


def _inspect_kitti(
    ds: KittiDataset, frame_id: str, min_points: int, keep_images: bool, decode: bool = True
) -> FrameCheck:
    root = ds.root
    probs = Problems(frame_id, root)
    add = probs.add

    idx = _kitti_index(ds)
    key = _kitti_key(frame_id)
    present: dict[str, Path] = {}
    for part in KITTI_PARTS:
        want = ds.part_path(part, frame_id)
        files = idx[part].get(key, [])
        others = [p for p in files if p.name != want.name]
        if want.is_file():
            present[part] = want
            for p in others:
                add(
                    p,
                    "frame id",
                    f"one file per frame in {part}/: {want.name} and {p.name} both name frame {frame_id}",
                )
        elif others:
            names = ", ".join(p.name for p in others)
            add(
                want,
                part,
                f"the {part} file of frame {frame_id} (missing; found {names}, which the KITTI layout does not read)",
            )
        else:
            add(want, part, f"the {part} file of frame {frame_id} ({absent(want)})")

    # Calibration first: the image check needs P2.
    calib_ok: dict[str, np.ndarray] = {}
    if "calib" in present:
        try:
            text = present["calib"].read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as e:
            add(present["calib"], "calib", f"a readable UTF-8 text file ({e})")
        else:
            found, calib_ok = calib_problems(text)
            for f, r in found:
                add(present["calib"], f, r)

    if "velodyne" in present:
        for f, r in check_points_file(present["velodyne"], 4, ds.intensity_range, min_points):
            add(present["velodyne"], f, r)

    images: dict[str, np.ndarray] = {}
    if "image_2" in present:
        rgb, size, err = decode_image_checked(
            present["image_2"].read_bytes(), keep_images, decode, image_format_of(present["image_2"])
        )
        if err:
            add(present["image_2"], "image", err)
        else:
            if rgb is not None:
                images["image_2"] = rgb
            if "P2" in calib_ok:
                why = check_principal_point(calib_ok["P2"][:, :3], size)
                if why:
                    add(
                        present["image_2"],
                        "image size",
                        f"{why} (P2 of {rel_path(present.get('calib', ''), root)})",
                    )

    if "label_2" in present:
        try:
            text = present["label_2"].read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as e:
            add(present["label_2"], "label", f"a readable UTF-8 text file ({e})")
        else:
            for f, r in label_problems(text):
                add(present["label_2"], f, r)

    return finish_check(ds, frame_id, probs, images)
