"""nuScenes layout: reader (JSON tables + `samples/`) and a writer for multi-camera datasets.

Layout: `root/samples/LIDAR_TOP/*.pcd.bin` float32 `[N, 5]` `(x, y, z, intensity 0..255, ring)`,
`root/samples/CAM_*/*.jpg`, and tables in `root/<version>/` (`sample.json`, `sample_data.json`,
`calibrated_sensor.json`, `ego_pose.json`, `sensor.json`, `sample_annotation.json`,
`instance.json`, `category.json`, ...). One `Frame` per sample (frame id = sample token).

Frames: annotations are global-frame boxes (size `w, l, h`, rotation quaternion `w, x, y, z`);
they are moved into the lidar frame through the lidar's ego pose and calibrated sensor. Each
camera gets `T_cam_from_lidar = inv(T_ego_from_cam) @ inv(T_global_from_ego_cam) @
T_global_from_ego_lidar @ T_ego_from_lidar`, exact for the two timestamps.
The Frame stays in the sensor's own frame: nuScenes mounts LIDAR_TOP x right, y forward;
prepare rotates onto the ego axes (`prepare.reference_frame: ego_axes`). A yaw-only box drops
the tilt of that frame against the global z the annotations stand on (~1 deg).
Tokens used by more than one record are kept in `duplicates`; a sample touching one is refused.
The reader needs only `TABLES`; `NuScenesWriter` also writes the tables the devkit's own `NuScenes`
class loads (`DEVKIT_TABLES`: attribute, visibility, log, scene, map and a map mask PNG).
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

import numpy as np

from pfactory.sensors.checks import (
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
    problem,
    rel_path,
)
from pfactory.sensors.errors import DatasetError
from pfactory.sensors.frame import Boxes3D, CameraView, Frame
from pfactory.sensors.geometry import (
    invert_transform,
    make_transform,
    matrix_to_quaternion,
    quaternion_to_matrix,
    yaw_from_matrix,
)
from pfactory.sensors.io import image_size, read_points
from pfactory.sensors.reader import DatasetReader, RemoteListing, RemoteStore
from pfactory.storage.fsutil import atomic_write_bytes, atomic_write_json

TABLES = (
    "sample",
    "sample_data",
    "calibrated_sensor",
    "ego_pose",
    "sensor",
    "sample_annotation",
    "instance",
    "category",
)
# Every table nuscenes-devkit 1.2.0's `NuScenes.__init__` loads (`table_names`), in its order.
DEVKIT_TABLES = (
    "category",
    "attribute",
    "visibility",
    "instance",
    "sensor",
    "calibrated_sensor",
    "ego_pose",
    "log",
    "scene",
    "sample",
    "sample_data",
    "sample_annotation",
    "map",
)
# nuScenes' attributes (v1.0 attribute.json: names and descriptions) and visibility levels (tokens "1".."4":
# the fraction of the annotation visible in all camera images, binned).
NUSCENES_ATTRIBUTES = {
    "vehicle.moving": "Vehicle is moving.",
    "vehicle.stopped": "Vehicle, with a driver/rider in/on it, is currently stationary but has an intent to move.",
    "vehicle.parked": "Vehicle is stationary (usually for longer duration) with no immediate intent to move.",
    "cycle.with_rider": "There is a rider on the bicycle or motorcycle.",
    "cycle.without_rider": "There is NO rider on the bicycle or motorcycle.",
    "pedestrian.sitting_lying_down": "The human is sitting or lying down.",
    "pedestrian.standing": "The human is standing.",
    "pedestrian.moving": "The human is moving.",
}
NUSCENES_VISIBILITY = (  # (token, level, lower bound of the visible fraction)
    ("1", "v0-40", 0.0),
    ("2", "v40-60", 0.4),
    ("3", "v60-80", 0.6),
    ("4", "v80-100", 0.8),
)


def visibility_token(fraction: float) -> str:
    """nuScenes visibility token ("1".."4") of a visible fraction in [0, 1] (bins 0-40-60-80-100 %)."""
    return [tok for tok, _, lo in NUSCENES_VISIBILITY if fraction >= lo][-1]


CAMERA_CHANNELS = (
    "CAM_FRONT",
    "CAM_FRONT_RIGHT",
    "CAM_BACK_RIGHT",
    "CAM_BACK",
    "CAM_BACK_LEFT",
    "CAM_FRONT_LEFT",
)
LIDAR_CHANNEL = "LIDAR_TOP"


def find_nuscenes_version(root: Path) -> str | None:
    """Name of the table folder (`v1.0-*`) under `root` if it is a nuScenes layout, else None."""
    if not (root / "samples").is_dir():
        return None
    versions = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("v1.0-"))
    return versions[0] if versions else None


def _transform(rec: dict, path: Path, what: str) -> np.ndarray:
    try:
        q = np.asarray(rec["rotation"], dtype=np.float64)
        t = np.asarray(rec["translation"], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as e:
        raise DatasetError(
            path, f"{what}.rotation/translation", f"a quaternion [4] and translation [3] ({e})"
        ) from e
    if q.shape != (4,) or t.shape != (3,) or not np.all(np.isfinite(q)) or np.linalg.norm(q) < 1e-9:
        raise DatasetError(
            path, f"{what}.rotation/translation", "a non-zero finite quaternion [4] and translation [3]"
        )
    return make_transform(quaternion_to_matrix(q), t)


class NuScenesDataset(DatasetReader):
    """Reader for a nuScenes-layout dataset root with tables in `root/<version>/`."""

    layout = "nuscenes"
    title = "nuScenes"
    describe = "a nuScenes layout (samples/ and a v1.0-* table folder)"
    intensity_range = (0.0, 255.0)
    results_writer = "pfactory.evaluate.nusc_submission:NuscResults"

    def __init__(self, root: str | Path, version: str):
        self.root = Path(root)
        self.version = version
        # Channels with a key-frame record in any sample, built at the first check.
        self._check_channels: set[str] | None = None
        self.table_dir = self.root / version
        self.tables: dict[str, dict[str, dict]] = {}
        # Tokens that occur in more than one record, per table: token -> record count. A
        # token->record dict would silently keep one of them; instead the first is kept for
        # lookups and every sample that touches a duplicated token is refused by `read`.
        self.duplicates: dict[str, dict[str, int]] = {}
        rows_of: dict[str, list[dict]] = {}
        for name in TABLES:
            path = self.table_dir / f"{name}.json"
            if not path.is_file():
                raise DatasetError(path, name, f"the nuScenes table {name}.json (missing)")
            try:
                rows = json.loads(path.read_text(encoding="utf-8-sig"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DatasetError(path, name, f"a JSON list of records ({e})") from e
            if not isinstance(rows, list) or not all(
                isinstance(r, dict) and isinstance(r.get("token"), str) for r in rows
            ):
                raise DatasetError(path, name, "a JSON list of records, each with a string 'token'")
            table: dict[str, dict] = {}
            counts: dict[str, int] = {}
            for r in rows:
                counts[r["token"]] = counts.get(r["token"], 0) + 1
                table.setdefault(r["token"], r)
            self.tables[name] = table
            self.duplicates[name] = {t: n for t, n in counts.items() if n > 1}
            rows_of[name] = rows
        # Index once: sample -> its key-frame sample_data by channel; sample -> annotations.
        # Built from every record (not the de-duplicated tables) so duplicates stay visible.
        self._sensor_of_cs = {
            t: self.tables["sensor"].get(cs.get("sensor_token"), {})
            for t, cs in self.tables["calibrated_sensor"].items()
        }
        self._data_by_sample: dict[str, dict[str, dict]] = {}
        # sample token -> channels with more than one key-frame record (which one is meant?)
        self.duplicate_channels: dict[str, list[str]] = {}
        for sd in rows_of["sample_data"]:
            if not sd.get("is_key_frame", True):
                continue
            channel = self._sensor_of_cs.get(sd.get("calibrated_sensor_token"), {}).get("channel")
            if channel is None:
                continue
            by_channel = self._data_by_sample.setdefault(sd.get("sample_token"), {})
            if channel in by_channel:
                self.duplicate_channels.setdefault(sd.get("sample_token"), []).append(channel)
                continue
            by_channel[channel] = sd
        self._anns_by_sample: dict[str, list[dict]] = {}
        for ann in rows_of["sample_annotation"]:
            self._anns_by_sample.setdefault(ann.get("sample_token"), []).append(ann)

    def frame_ids(self) -> list[str]:
        """Sample tokens, ordered by timestamp then token."""
        samples = self.tables["sample"].values()
        return [s["token"] for s in sorted(samples, key=lambda s: (s.get("timestamp", 0), s["token"]))]

    def sample_data(self, frame_id: str) -> dict[str, dict]:
        """Key-frame sample_data records of one sample by channel (first record per channel)."""
        return dict(self._data_by_sample.get(frame_id, {}))

    def annotations(self, frame_id: str) -> list[dict]:
        """Every sample_annotation record of one sample, duplicates included."""
        return list(self._anns_by_sample.get(frame_id, []))

    def duplicate_errors(self, frame_id: str) -> list[DatasetError]:
        """One error per duplicated token (or doubled key-frame channel) that this sample uses.

        Checked: the sample itself, its key-frame sample_data and their calibrated_sensor,
        sensor and ego_pose records, its annotations and their instance and category.
        """
        errs: list[DatasetError] = []

        def check(table: str, token: object) -> None:
            n = self.duplicates[table].get(token) if isinstance(token, str) else None
            if n:
                errs.append(
                    DatasetError(
                        self.table_dir / f"{table}.json",
                        f"{token}.token",
                        f"unique tokens, {token!r} is used by {n} records",
                        frame_id,
                    )
                )

        check("sample", frame_id)
        for channel in self.duplicate_channels.get(frame_id, []):
            errs.append(
                DatasetError(
                    self.table_dir / "sample_data.json",
                    channel,
                    f"one key-frame {channel} record for sample {frame_id}, found several",
                    frame_id,
                )
            )
        for sd in self._data_by_sample.get(frame_id, {}).values():
            check("sample_data", sd.get("token"))
            check("calibrated_sensor", sd.get("calibrated_sensor_token"))
            check("ego_pose", sd.get("ego_pose_token"))
            cs = self.record("calibrated_sensor", sd.get("calibrated_sensor_token")) or {}
            check("sensor", cs.get("sensor_token"))
        seen: set[str] = set()
        for ann in self._anns_by_sample.get(frame_id, []):
            if ann["token"] in seen:
                continue  # one error per duplicated annotation token, not one per copy
            seen.add(ann["token"])
            check("sample_annotation", ann["token"])
            check("instance", ann.get("instance_token"))
            inst = self.record("instance", ann.get("instance_token")) or {}
            check("category", inst.get("category_token"))
        return errs

    def record(self, table: str, token: object) -> dict | None:
        """The record of `table` with `token`; None if absent or the token is not a string."""
        return self.tables[table].get(token) if isinstance(token, str) else None

    def resolve(self, filename: str, field: str) -> Path:
        """A table's relative file path under the root; DatasetError if it escapes the root.

        The test is lexical (`..` and absolute paths are refused) and does not follow
        symlinks: a dataset whose files are symlinks into a cache (DVC's `cache.type:
        symlink`, a shared mirror) is legitimate, a table naming `../x` is not.
        """
        table_path = self.table_dir / "sample_data.json"
        if not isinstance(filename, str) or not filename or "\x00" in filename:
            raise DatasetError(table_path, field, f"a relative file path, got {filename!r}")
        rel = PurePosixPath(filename.replace("\\", "/"))
        norm = PurePosixPath(posixpath.normpath(rel.as_posix()))
        if rel.is_absolute() or PureWindowsPath(filename).is_absolute() or norm.parts[:1] == ("..",):
            raise DatasetError(
                table_path, field, f"a path inside the dataset root {self.root}, got {filename!r}"
            )
        return self.root / norm

    @classmethod
    def detect(cls, root: Path) -> NuScenesDataset | None:
        version = find_nuscenes_version(root)
        return None if version is None else cls(root, version)

    def frame_files(self, frame_id: str) -> list[tuple[str, Path]]:
        """`(the table's filename, path)` of each key-frame sample_data file of the sample that exists
        (a filename escaping the root is left out: the frame's checks refuse it)."""
        named = []
        for sd in self.sample_data(frame_id).values():
            try:
                named.append((str(sd.get("filename")), self.resolve(sd.get("filename"), "filename")))
            except DatasetError:
                continue
        return [(name, p) for name, p in named if p.is_file()]

    def shared_files(self) -> list[tuple[str, Path]]:
        """The JSON tables, `(<version>/<name>.json, path)`: every sample depends on them."""
        return [(f"{self.version}/{p.name}", p) for p in Path(self.table_dir).glob("*.json")]

    def reference_transform(self, frame_id: str) -> np.ndarray:
        """The rotation of the sample's LIDAR_TOP calibrated_sensor record (`T_ego_from_lidar`'s rotation
        block, origin kept at the sensor); the identity when the record is missing (such a frame is refused
        by the reader already)."""
        T = np.eye(4)
        sd = self.sample_data(frame_id).get(LIDAR_CHANNEL)
        cs = self.tables["calibrated_sensor"].get(sd.get("calibrated_sensor_token")) if sd else None
        if cs is None:
            return T
        T[:3, :3] = quaternion_to_matrix(np.asarray(cs["rotation"], dtype=np.float64))
        return T

    def replicate(self, out: Path, n: int, samples: list[str] | None = None) -> Path:
        """`n` samples under `out`, sample i cloning every record of `samples[i % len(samples)]` (default:
        all) under new tokens; `out/samples` is a symlink to this dataset's (the sensor files are shared)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "samples").exists():
            os.symlink(Path(self.root).resolve() / "samples", out / "samples")
        base = samples or self.frame_ids()
        t = self.tables
        rows: dict[str, list[dict]] = {
            "sensor": list(t["sensor"].values()),
            "category": list(t["category"].values()),
            "calibrated_sensor": list(t["calibrated_sensor"].values()),
        }
        for name in ("sample", "sample_data", "ego_pose", "sample_annotation", "instance"):
            rows[name] = []
        for i in range(n):
            src_tok = base[i % len(base)]
            tag = f"-r{i:06d}"
            s = dict(t["sample"][src_tok])
            s["token"] = src_tok + tag
            s["timestamp"] = int(s.get("timestamp", 0)) + i  # distinct, ordered by i
            rows["sample"].append(s)
            for sd in self.sample_data(src_tok).values():
                ep = dict(t["ego_pose"][sd["ego_pose_token"]])
                ep["token"] = ep["token"] + tag
                rows["ego_pose"].append(ep)
                rec = dict(sd, token=sd["token"] + tag, sample_token=s["token"], ego_pose_token=ep["token"])
                rows["sample_data"].append(rec)
            for ann in self.annotations(src_tok):
                inst = dict(t["instance"][ann["instance_token"]])
                inst["token"] = inst["token"] + tag
                rows["instance"].append(inst)
                rows["sample_annotation"].append(
                    dict(ann, token=ann["token"] + tag, sample_token=s["token"], instance_token=inst["token"])
                )
        table_dir = out / self.version
        table_dir.mkdir(parents=True, exist_ok=True)
        for name, recs in rows.items():
            (table_dir / f"{name}.json").write_text(json.dumps(recs))
        return out

    @classmethod
    def list_remote(cls, store: RemoteStore, scratch: Path) -> RemoteListing | None:
        """nuScenes on object storage: `samples/` and a `v1.0-*` folder at the root. The driver reads a
        local copy of the tables (in `scratch`, with an empty samples/); every unit downloads the tables
        once per worker process (`shared`) and the files its samples' sample_data records name."""
        top = store.top()
        versions = sorted(n for n in top if n.startswith("v1.0-") and store.is_dir(n))
        if "samples" not in top or not versions:
            return None
        version = versions[0]
        tables = [f"{version}/{n}" for n in store.names(version) if n.endswith(".json")]
        (scratch / "samples").mkdir(parents=True, exist_ok=True)
        (scratch / version).mkdir(parents=True, exist_ok=True)
        store.download(tables, scratch)
        reader = cls(scratch, version)

        def unit_files(ids: list[str]) -> list[str]:
            names: set[str] = set()
            for fid in ids:
                for sd in reader.sample_data(fid).values():
                    try:
                        path = reader.resolve(sd.get("filename"), "filename")
                    except DatasetError:  # refused by the frame's checks, as locally
                        continue
                    names.add(path.relative_to(reader.root).as_posix())
            return sorted(names)

        return RemoteListing(reader.check_ids(), ["samples", version], unit_files, tables, reader, scratch)

    def dataset_problems(self) -> list[Problem]:
        _nuscenes_channels(self)  # built once here, before check_dataset's threads need it
        return _orphan_duplicates(self)

    def inspect(self, frame_id: str, min_points: int, keep_images: bool, decode: bool = True) -> FrameCheck:
        return _inspect_nuscenes(self, frame_id, min_points, keep_images, decode)

    def _pose(self, sd: dict) -> tuple[np.ndarray, np.ndarray]:
        """`(T_ego_from_sensor, T_global_from_ego)` of one sample_data record."""
        cs = self.tables["calibrated_sensor"].get(sd.get("calibrated_sensor_token"))
        ep = self.tables["ego_pose"].get(sd.get("ego_pose_token"))
        path = self.table_dir / "sample_data.json"
        if cs is None or ep is None:
            raise DatasetError(
                path, f"{sd['token']}.calibrated_sensor_token/ego_pose_token", "tokens of existing records"
            )
        return (
            _transform(cs, self.table_dir / "calibrated_sensor.json", cs["token"]),
            _transform(ep, self.table_dir / "ego_pose.json", ep["token"]),
        )

    def _read(self, frame_id: str, with_labels: bool) -> Frame:
        if frame_id not in self.tables["sample"]:
            raise DatasetError(self.table_dir / "sample.json", "token", f"a sample with token {frame_id!r}")
        dups = self.duplicate_errors(frame_id)
        if dups:
            raise dups[0]
        data = self._data_by_sample.get(frame_id, {})
        lidar_sd = data.get(LIDAR_CHANNEL)
        if lidar_sd is None:
            raise DatasetError(
                self.table_dir / "sample_data.json",
                LIDAR_CHANNEL,
                f"a key-frame lidar record for sample {frame_id}",
            )
        lidar_path = self.resolve(lidar_sd.get("filename"), f"{lidar_sd['token']}.filename")
        if not lidar_path.is_file():
            raise DatasetError(
                lidar_path, "points", f"the lidar file of sample {frame_id} ({absent(lidar_path)})"
            )
        raw = read_points(lidar_path, dims=5)
        points = np.concatenate([raw[:, :3], raw[:, 3:4] / 255.0], axis=1).astype(np.float32)  # [N, 4]
        T_ego_from_lidar, T_global_from_ego_l = self._pose(lidar_sd)
        T_global_from_lidar = T_global_from_ego_l @ T_ego_from_lidar
        cameras = []
        for channel in sorted(c for c in data if c.startswith("CAM")):
            sd = data[channel]
            path = self.resolve(sd.get("filename"), f"{sd['token']}.filename")
            if not path.is_file():
                raise DatasetError(
                    path, channel, f"the {channel} image of sample {frame_id} ({absent(path)})"
                )
            T_ego_from_cam, T_global_from_ego_c = self._pose(sd)
            cs = self.tables["calibrated_sensor"][sd["calibrated_sensor_token"]]
            K = np.asarray(cs.get("camera_intrinsic") or [], dtype=np.float64)
            if K.shape != (3, 3) or not np.all(np.isfinite(K)) or abs(np.linalg.det(K)) < 1e-9:
                raise DatasetError(
                    self.table_dir / "calibrated_sensor.json",
                    f"{cs['token']}.camera_intrinsic",
                    "an invertible 3x3 matrix",
                )
            if check_focal(float(K[0, 0]), float(K[1, 1])):
                raise DatasetError(
                    self.table_dir / "calibrated_sensor.json",
                    f"{cs['token']}.camera_intrinsic",
                    check_focal(float(K[0, 0]), float(K[1, 1])),
                )
            T_cam_from_lidar = invert_transform(T_global_from_ego_c @ T_ego_from_cam) @ T_global_from_lidar
            size = image_size(path)
            if "width" in sd and "height" in sd and (sd["width"], sd["height"]) != size:
                raise DatasetError(
                    path,
                    f"{channel} size",
                    f"{sd['width']}x{sd['height']} as in sample_data.json, got {size[0]}x{size[1]}",
                )
            cameras.append(CameraView(channel, path, K, T_cam_from_lidar, size))
        boxes = (
            self._boxes(frame_id, invert_transform(T_global_from_lidar)) if with_labels else Boxes3D.empty()
        )
        return Frame(frame_id, points, cameras, boxes, lidar_path=lidar_path, source="nuscenes")

    def _boxes(self, frame_id: str, T_lidar_from_global: np.ndarray) -> Boxes3D:
        anns = sorted(self._anns_by_sample.get(frame_id, []), key=lambda a: a["token"])
        path = self.table_dir / "sample_annotation.json"
        if len(anns) > MAX_OBJECTS:
            raise DatasetError(
                path,
                "sample_token",
                f"at most {MAX_OBJECTS} annotations of sample {frame_id}, got {len(anns)}",
            )
        boxes, names, npts = [], [], []
        for a in anns:
            T = T_lidar_from_global @ _transform(a, path, a["token"])
            size = np.asarray(a.get("size", []), dtype=np.float64)
            if size.shape != (3,) or not np.all(size > 0) or not np.all(size <= MAX_BOX_SIZE_M):
                raise DatasetError(
                    path,
                    f"{a['token']}.size",
                    f"three positive numbers (w, l, h) of at most {MAX_BOX_SIZE_M:g} m, got {a.get('size')}",
                )
            if float(np.linalg.norm(T[:3, 3])) > MAX_BOX_RANGE_M:
                raise DatasetError(
                    path,
                    f"{a['token']}.translation",
                    f"a box within {MAX_BOX_RANGE_M:g} m of the lidar, got one {np.linalg.norm(T[:3, 3]):.4g} m away",
                )
            inst = self.tables["instance"].get(a.get("instance_token"), {})
            cat = self.tables["category"].get(inst.get("category_token"))
            if cat is None:
                raise DatasetError(path, f"{a['token']}.instance_token", "an instance with a known category")
            w, l, h = size
            boxes.append([*T[:3, 3], l, w, h, yaw_from_matrix(T[:3, :3])])
            names.append(cat["name"])
            npts.append(a.get("num_lidar_pts", -1))
        # nuScenes has no KITTI difficulty; -1 marks "not defined" for every box.
        return Boxes3D(np.array(boxes).reshape(-1, 7), names, np.full(len(names), -1, dtype=np.int8))


@dataclass
class NuScenesWriter:
    """Writes frames in the nuScenes layout (used by the multi-camera synthetic generator).

    Ego frame = lidar frame shifted by `T_ego_from_lidar`; the ego pose is the identity (the
    global frame is the ego frame of each sample). Files are written atomically as frames are
    added; the tables are written by `close()`: every table of `DEVKIT_TABLES`, so that
    nuscenes-devkit's `NuScenes(version, dataroot)` opens the dataset.

    What the devkit tables hold here: each sample is its own scene (`scene-<frame id>`: the frames
    are independent, nothing links one to the next, so `prev`/`next` are empty everywhere and every
    instance has one annotation); one log (`location`); the attribute table is nuScenes' 8
    attributes, an annotation carries the ones given to `add_frame` (none when unknown); the
    visibility table is nuScenes' 4 levels, an annotation's level comes from the visible fraction
    given to `add_frame` (`visibility_token`; "1" when none is given). The map table holds one
    record for the log with an all-background mask `maps/<token>.png`: the global frame is each
    sample's own ego frame, so there is no shared map to draw (the devkit's `NuScenes` needs the
    table and opens the file only when a map is rendered).
    """

    root: Path
    version: str = "v1.0-synth"
    T_ego_from_lidar: np.ndarray = field(default_factory=lambda: make_transform(np.eye(3), [0.94, 0.0, 1.84]))
    location: str = "synthetic"
    _rows: dict[str, list[dict]] = field(default_factory=lambda: {t: [] for t in DEVKIT_TABLES})
    _sensors: dict[str, str] = field(default_factory=dict)
    _categories: dict[str, str] = field(default_factory=dict)

    def _token(self, *parts: object) -> str:
        import hashlib

        return hashlib.md5("/".join(map(str, parts)).encode()).hexdigest()

    def _sensor(self, channel: str) -> str:
        if channel not in self._sensors:
            tok = self._token("sensor", channel)
            modality = "lidar" if channel.startswith("LIDAR") else "camera"
            self._rows["sensor"].append({"token": tok, "channel": channel, "modality": modality})
            self._sensors[channel] = tok
        return self._sensors[channel]

    def _category(self, name: str) -> str:
        if name not in self._categories:
            tok = self._token("category", name)
            self._rows["category"].append({"token": tok, "name": name, "description": ""})
            self._categories[name] = tok
        return self._categories[name]

    def _attribute(self, name: str) -> str:
        if name not in NUSCENES_ATTRIBUTES:
            raise ValueError(
                f"attribute {name!r} is not a nuScenes attribute ({sorted(NUSCENES_ATTRIBUTES)})"
            )
        return self._token("attribute", name)

    def _calibrated(self, key: str, channel: str, T_ego_from_sensor: np.ndarray, K: np.ndarray | None) -> str:
        tok = self._token("cs", key, channel)
        self._rows["calibrated_sensor"].append(
            {
                "token": tok,
                "sensor_token": self._sensor(channel),
                "translation": T_ego_from_sensor[:3, 3].tolist(),
                "rotation": matrix_to_quaternion(T_ego_from_sensor[:3, :3]).tolist(),
                "camera_intrinsic": [] if K is None else np.asarray(K).tolist(),
            }
        )
        return tok

    def add_frame(
        self,
        frame_id: str,
        timestamp_us: int,
        points: np.ndarray,
        cameras: list[tuple[str, bytes, np.ndarray, np.ndarray, tuple[int, int]]],
        boxes: np.ndarray,
        category_names: list[str],
        num_lidar_pts: list[int] | None = None,
        visibility: list[float] | None = None,
        attributes: list[list[str]] | None = None,
    ) -> None:
        """Add one sample (and its scene).

        `points [N, 4]` lidar frame (intensity in [0, 1], written as 0..255 with ring 0);
        `cameras`: `(channel, jpeg_bytes, K [3, 3], T_cam_from_lidar [4, 4], (width, height))`;
        `boxes [M, 7]` lidar frame with nuScenes `category_names [M]`; optional per box:
        `num_lidar_pts [M]`, `visibility [M]` (visible fraction in [0, 1] over all cameras) and
        `attributes [M]` (nuScenes attribute names, at most one per box as in nuScenes).
        """
        sample_tok, ego_tok = self._sample_records(frame_id, timestamp_us)
        pts = np.asarray(points, dtype=np.float32).reshape(-1, 4)
        raw = np.concatenate([pts[:, :3], pts[:, 3:4] * 255.0, np.zeros((len(pts), 1), np.float32)], 1)
        name = f"samples/{LIDAR_CHANNEL}/{frame_id}__{LIDAR_CHANNEL}__{timestamp_us}.pcd.bin"
        atomic_write_bytes(self.root / name, raw.astype(np.float32).tobytes())
        self._sample_data(
            frame_id,
            sample_tok,
            ego_tok,
            LIDAR_CHANNEL,
            name,
            self.T_ego_from_lidar,
            None,
            timestamp_us,
            "pcd",
            None,
        )
        for channel, jpeg, K, T_cam_from_lidar, size in cameras:
            name = f"samples/{channel}/{frame_id}__{channel}__{timestamp_us}.jpg"
            atomic_write_bytes(self.root / name, jpeg)
            T_ego_from_cam = self.T_ego_from_lidar @ invert_transform(np.asarray(T_cam_from_lidar))
            self._sample_data(
                frame_id, sample_tok, ego_tok, channel, name, T_ego_from_cam, K, timestamp_us, "jpg", size
            )
        self._annotations(frame_id, sample_tok, boxes, category_names, num_lidar_pts, visibility, attributes)

    def _sample_records(self, frame_id: str, timestamp_us: int) -> tuple[str, str]:
        """The ego_pose (the identity), sample and scene records of one frame; returns the
        `(sample token, ego_pose token)` its sample_data records point to."""
        sample_tok = self._token("sample", frame_id)
        ego_tok = self._token("ego", frame_id)
        scene_tok = self._token("scene", frame_id)
        self._rows["ego_pose"].append(
            {
                "token": ego_tok,
                "timestamp": timestamp_us,
                "rotation": [1.0, 0, 0, 0],
                "translation": [0.0, 0, 0],
            }
        )
        self._rows["sample"].append(
            {"token": sample_tok, "timestamp": timestamp_us, "scene_token": scene_tok, "prev": "", "next": ""}
        )
        self._rows["scene"].append(
            {
                "token": scene_tok,
                "log_token": self._token("log", self.location),
                "nbr_samples": 1,
                "first_sample_token": sample_tok,
                "last_sample_token": sample_tok,
                "name": f"scene-{frame_id}",
                "description": f"synthetic frame {frame_id}",
            }
        )
        return sample_tok, ego_tok

    def _annotations(
        self,
        frame_id: str,
        sample_tok: str,
        boxes: np.ndarray,
        category_names: list[str],
        num_lidar_pts: list[int] | None,
        visibility: list[float] | None,
        attributes: list[list[str]] | None,
    ) -> None:
        """One instance and one sample_annotation record per box of `boxes [M, 7]` (lidar frame,
        moved to the global frame); the optional per-box lists as in `add_frame`. Raises
        ValueError for a box with more than one attribute (the boxes before it are recorded)."""
        T_global_from_lidar = self.T_ego_from_lidar  # ego pose is the identity
        for i, (b, cat) in enumerate(zip(np.asarray(boxes).reshape(-1, 7), category_names)):
            x, y, z, l, w, h, yaw = b
            T = T_global_from_lidar @ make_transform(
                np.array([[np.cos(yaw), -np.sin(yaw), 0], [np.sin(yaw), np.cos(yaw), 0], [0, 0, 1]]),
                [x, y, z],
            )
            inst = self._token("instance", frame_id, i)
            ann = self._token("ann", frame_id, i)
            attrs = list(attributes[i]) if attributes is not None else []
            if len(attrs) > 1:
                raise ValueError(
                    f"box {i} of {frame_id}: at most one attribute per box (nuScenes), got {attrs}"
                )
            self._rows["instance"].append(
                {
                    "token": inst,
                    "category_token": self._category(cat),
                    "nbr_annotations": 1,
                    "first_annotation_token": ann,
                    "last_annotation_token": ann,
                }
            )
            self._rows["sample_annotation"].append(
                {
                    "token": ann,
                    "sample_token": sample_tok,
                    "instance_token": inst,
                    "translation": T[:3, 3].tolist(),
                    "size": [float(w), float(l), float(h)],
                    "rotation": matrix_to_quaternion(T[:3, :3]).tolist(),
                    "num_lidar_pts": int(num_lidar_pts[i]) if num_lidar_pts is not None else -1,
                    "num_radar_pts": 0,
                    "attribute_tokens": [self._attribute(a) for a in attrs],
                    "visibility_token": visibility_token(float(visibility[i]))
                    if visibility is not None
                    else "1",
                    "prev": "",
                    "next": "",
                }
            )

    def _sample_data(
        self, frame_id, sample_tok, ego_tok, channel, filename, T_ego_from_sensor, K, ts, fmt, size
    ) -> None:
        rec = {
            "token": self._token("sd", frame_id, channel),
            "sample_token": sample_tok,
            "ego_pose_token": ego_tok,
            "calibrated_sensor_token": self._calibrated(frame_id, channel, T_ego_from_sensor, K),
            "filename": filename,
            "fileformat": fmt,
            "timestamp": ts,
            "is_key_frame": True,
            "prev": "",
            "next": "",
        }
        # nuScenes gives every sample_data a width and height (0 for lidar).
        rec["width"], rec["height"] = (int(size[0]), int(size[1])) if size is not None else (0, 0)
        self._rows["sample_data"].append(rec)

    def _static_tables(self) -> None:
        """attribute, visibility, log and map records (one log, one map; see the class docstring)."""
        self._rows["attribute"] = [
            {"token": self._token("attribute", n), "name": n, "description": d}
            for n, d in NUSCENES_ATTRIBUTES.items()
        ]
        self._rows["visibility"] = [
            {
                "token": tok,
                "level": level,
                "description": f"visibility of whole object is between {level[1:].replace('-', ' and ')}%",
            }
            for tok, level, _ in NUSCENES_VISIBILITY
        ]
        log_tok = self._token("log", self.location)
        self._rows["log"] = [
            {
                "token": log_tok,
                "logfile": f"{self.location}-{self.version}",
                "vehicle": "synthetic",
                "date_captured": "2018-08-01",
                "location": self.location,
            }
        ]
        map_tok = self._token("map", self.location)
        filename = f"maps/{map_tok}.png"
        self._rows["map"] = [
            {"token": map_tok, "log_tokens": [log_tok], "category": "semantic_prior", "filename": filename}
        ]
        atomic_write_bytes(self.root / filename, _blank_png(8, 8))

    def close(self) -> None:
        """Write every table (sorted by token for byte-identical output)."""
        self._static_tables()
        for name, rows in self._rows.items():
            atomic_write_json(
                self.root / self.version / f"{name}.json", sorted(rows, key=lambda r: r["token"])
            )


def _blank_png(width: int, height: int) -> bytes:
    """An all-background (0) 8-bit grey PNG, deterministic bytes."""
    import io

    from PIL import Image

    bio = io.BytesIO()
    Image.new("L", (width, height), 0).save(bio, format="PNG")
    return bio.getvalue()


# --- strict validation (`factory data check`, prepare's per-frame check): every problem, not the first


def _nuscenes_channels(ds: NuScenesDataset) -> set[str]:
    """Channels that have a key-frame record in any sample (what every sample should have)."""
    chans = ds._check_channels
    if chans is None:
        chans = {c for t in ds.tables["sample"] for c in ds.sample_data(t)}
        ds._check_channels = chans
    return chans


def _inspect_nuscenes(
    ds: NuScenesDataset, frame_id: str, min_points: int, keep_images: bool, decode: bool = True
) -> FrameCheck:
    """Every problem of one sample (`NuScenesDataset.inspect`): the sample record, its duplicated
    tokens, missing channels, each sample_data record and file, then each annotation; the decoded
    images are kept when `keep_images`."""
    root = ds.root
    probs = Problems(frame_id, root)
    add = probs.add
    tdir = ds.table_dir

    if frame_id not in ds.tables["sample"]:
        add(tdir / "sample.json", "token", f"a sample with token {frame_id!r}")
        return FrameCheck(frame_id, probs)
    for e in ds.duplicate_errors(frame_id):
        add(e.file, e.field, e.expected)

    data = ds.sample_data(frame_id)
    for channel in sorted(_nuscenes_channels(ds) - set(data)):
        add(
            tdir / "sample_data.json",
            channel,
            f"a key-frame {channel} record for sample {frame_id} (other samples have one)",
        )
    if LIDAR_CHANNEL not in data and LIDAR_CHANNEL not in _nuscenes_channels(ds):
        add(tdir / "sample_data.json", LIDAR_CHANNEL, f"a key-frame lidar record for sample {frame_id}")

    images: dict[str, np.ndarray] = {}
    for channel, sd in sorted(data.items()):
        rgb = _check_sample_data(ds, probs, frame_id, channel, sd, min_points, keep_images, decode)
        if rgb is not None:
            images[channel] = rgb
    _check_annotations(ds, probs, frame_id)
    return finish_check(ds, frame_id, probs, images)


def _check_poses(ds: NuScenesDataset, probs: Problems, sd: dict) -> dict | None:
    """The calibrated sensor and the ego pose of one sample_data record must exist and be valid
    transforms; returns the calibrated_sensor record (None when missing)."""
    add, tdir, tok = probs.add, ds.table_dir, sd.get("token")
    cs = ds.record("calibrated_sensor", sd.get("calibrated_sensor_token"))
    ep = ds.record("ego_pose", sd.get("ego_pose_token"))
    if cs is None:
        add(
            tdir / "sample_data.json",
            f"{tok}.calibrated_sensor_token",
            "the token of a calibrated_sensor record",
        )
    if ep is None:
        add(tdir / "sample_data.json", f"{tok}.ego_pose_token", "the token of an ego_pose record")
    for rec, table in ((cs, "calibrated_sensor"), (ep, "ego_pose")):
        if rec is not None:
            try:
                _transform(rec, tdir / f"{table}.json", rec["token"])
            except DatasetError as e:
                add(e.file, e.field, e.expected)
    return cs


def _check_sample_data(
    ds: NuScenesDataset,
    probs: Problems,
    frame_id: str,
    channel: str,
    sd: dict,
    min_points: int,
    keep_images: bool,
    decode: bool,
) -> np.ndarray | None:
    """One sample_data record of `channel`: its poses, its file, and the file's content (the
    lidar points; a camera's image, intrinsics and size; radar files are not read). Returns the
    decoded image when there is one to keep, else None."""
    add, tok = probs.add, sd.get("token")
    cs = _check_poses(ds, probs, sd)
    try:
        path = ds.resolve(sd.get("filename"), f"{tok}.filename")
    except DatasetError as e:
        add(e.file, e.field, e.expected)
        return None
    if not path.is_file():
        add(
            path,
            channel,
            f"the {channel} file of sample {frame_id} named by sample_data {tok} ({absent(path)})",
        )
        return None
    if channel == LIDAR_CHANNEL:
        for f, r in check_points_file(path, 5, ds.intensity_range, min_points):
            add(path, f, r)
        return None
    if not channel.startswith("CAM"):
        return None  # radar channels are not read
    K = _check_intrinsic(ds, probs, cs) if cs is not None else None
    rgb, size, err = decode_image_checked(path.read_bytes(), keep_images, decode, image_format_of(path))
    if err:
        add(path, "image", err)
        return None
    if "width" in sd and "height" in sd and (sd["width"], sd["height"]) != size:
        add(
            path,
            f"{channel} size",
            f"{sd['width']}x{sd['height']} as in sample_data.json ({tok}), got {size[0]}x{size[1]}",
        )
    if K is not None:
        why = check_principal_point(K, size)
        if why:
            add(path, "image size", f"{why} (camera_intrinsic of calibrated_sensor {cs['token']})")
    return rgb


def _check_intrinsic(ds: NuScenesDataset, probs: Problems, cs: dict) -> np.ndarray | None:
    """A camera's calibrated_sensor `camera_intrinsic`: returns `K [3, 3]`, or None (with a problem
    added) when it is not a finite matrix with positive, plausible focal lengths."""
    try:
        K = np.asarray(cs.get("camera_intrinsic") or [], dtype=np.float64)
    except (TypeError, ValueError):
        K = np.zeros(0)
    if K.shape != (3, 3) or not np.all(np.isfinite(K)) or not (K[0, 0] > 0 and K[1, 1] > 0):
        probs.add(
            ds.table_dir / "calibrated_sensor.json",
            f"{cs['token']}.camera_intrinsic",
            "a finite 3x3 intrinsic matrix with positive focal lengths, "
            f"got {repr(cs.get('camera_intrinsic'))[:200]}",
        )
        return None
    if check_focal(float(K[0, 0]), float(K[1, 1])):
        probs.add(
            ds.table_dir / "calibrated_sensor.json",
            f"{cs['token']}.camera_intrinsic",
            check_focal(float(K[0, 0]), float(K[1, 1])),
        )
        return None
    return K


def _check_annotations(ds: NuScenesDataset, probs: Problems, frame_id: str) -> None:
    """Each annotation of the sample (once per token): its size, its pose, its instance and the
    instance's category."""
    add, tdir = probs.add, ds.table_dir
    seen: set[str] = set()
    for ann in ds.annotations(frame_id):
        tok = ann["token"]
        if tok in seen:
            continue
        seen.add(tok)
        apath = tdir / "sample_annotation.json"
        try:
            size = np.asarray(ann.get("size", []), dtype=np.float64)
        except (TypeError, ValueError):
            size = np.zeros(0)
        if (
            size.shape != (3,)
            or not np.all(np.isfinite(size))
            or not np.all(size > 0)
            or np.any(size > MAX_BOX_SIZE_M)
        ):
            add(
                apath,
                f"{tok}.size",
                f"three positive numbers (w, l, h) of at most {MAX_BOX_SIZE_M:g} m, got {ann.get('size')!r}",
            )
        try:
            _transform(ann, apath, tok)
        except DatasetError as e:
            add(e.file, e.field, e.expected)
        inst = ds.record("instance", ann.get("instance_token"))
        if inst is None:
            add(apath, f"{tok}.instance_token", "the token of an instance record")
        elif ds.record("category", inst.get("category_token")) is None:
            add(
                tdir / "instance.json",
                f"{inst['token']}.category_token",
                "the token of a category record (the annotation's class)",
            )


def _orphan_duplicates(ds: NuScenesDataset) -> list[Problem]:
    """Duplicated tokens in records no sample uses (those that are used fail their frames)."""
    used: set[tuple[str, str]] = set()
    for fid in ds.tables["sample"]:
        for e in ds.duplicate_errors(fid):
            used.add((Path(e.file).stem, e.field.rsplit(".token", 1)[0]))
    out = []
    for table, dups in ds.duplicates.items():
        for tok, n in dups.items():
            if (table, tok) not in used:
                out.append(
                    problem(
                        None,
                        rel_path(ds.table_dir / f"{table}.json", ds.root),
                        f"{tok}.token",
                        f"unique tokens, {tok!r} is used by {n} records",
                    )
                )
    return out
