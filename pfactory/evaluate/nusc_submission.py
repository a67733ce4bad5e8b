"""Detections -> a nuScenes detection submission (`results_nusc.json`), the file the nuScenes devkit scores.

Format (nuscenes-devkit 1.2.0, `nuscenes.eval.common.loaders.load_prediction` + `DetectionBox`):
```
{"meta": {"use_camera": bool, "use_lidar": bool, "use_radar": false, "use_map": false, "use_external": false},
 "results": {sample_token: [{"sample_token", "translation": [x, y, z] (global, box centre),
                             "size": [w, l, h], "rotation": [qw, qx, qy, qz] (global),
                             "velocity": [vx, vy], "detection_name", "detection_score", "attribute_name"}]}}
```
Every evaluated sample is a key, with `[]` when it has no detection (the devkit asserts that the
predictions cover exactly the samples of the evaluated split). `use_camera` and `use_lidar` are true:
the factory's detector takes both (camera-painted pillars).

Frames: the prepared data's reference frame (x forward, y left, z up, origin at the lidar; `prepare.
reference_frame`) goes to the global frame through the raw dataset's tables, per sample:
`T_global_from_ref = T_global_from_ego @ T_ego_from_lidar @ inv(T_ref_from_lidar)` (the LIDAR_TOP
key frame's ego pose and calibrated sensor; `T_ref_from_lidar` as prepare computed it,
`pfactory.prepare.lidar.reference_transform`). A box `(x, y, z, l, w, h, yaw)` becomes `translation =
T @ (x, y, z)`, `rotation = quaternion(R @ Rz(yaw))`, `size = (w, l, h)`.

Classes (`DETECTION_NAME`): training class -> nuScenes detection class, as in docs/KPIS.md:
Car -> car, Pedestrian -> pedestrian, Cyclist -> bicycle (nuScenes boxes a bicycle with its rider),
Truck and Van -> truck, and the 10 nuScenes detection names to themselves. Predictions of a class
outside the table are left out of the file and counted in the summary (`left_out`).

What the model does not predict, written as fixed values:
- `velocity` [0, 0] (no velocity head; the devkit's mAVE of this file is then the objects' speed);
- `attribute_name` per class (`ATTRIBUTE`): mmdetection3d's nuScenes defaults (car, truck:
  vehicle.parked; pedestrian: pedestrian.moving), except bicycle -> cycle.with_rider, because the
  class is a ridden bicycle (Cyclist); barrier and traffic cone have none ("").
- At most `MAX_BOXES_PER_SAMPLE` (500, the devkit's limit) boxes per sample: the highest scoring
  ones (ties: the earlier box); the number cut is in the summary (`capped`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.evaluate.inputs import EvaluateInputError
from pfactory.metrics.detection import FrameDetections
from pfactory.sensors.geometry import invert_transform, matrix_to_quaternion, rot_z

RESULTS_FILE = "results_nusc.json"
MAX_BOXES_PER_SAMPLE = 500
# nuScenes' detection classes (nuscenes.eval.detection.constants.DETECTION_NAMES).
NUSC_DETECTION_NAMES = (
    "car",
    "truck",
    "bus",
    "trailer",
    "construction_vehicle",
    "pedestrian",
    "motorcycle",
    "bicycle",
    "traffic_cone",
    "barrier",
)
DETECTION_NAME: dict[str, str] = {
    "Car": "car",
    "Pedestrian": "pedestrian",
    "Cyclist": "bicycle",
    "Truck": "truck",
    "Van": "truck",
    **{n: n for n in NUSC_DETECTION_NAMES},
}
ATTRIBUTE: dict[str, str] = {
    "car": "vehicle.parked",
    "truck": "vehicle.parked",
    "bus": "vehicle.moving",
    "trailer": "vehicle.parked",
    "construction_vehicle": "vehicle.parked",
    "pedestrian": "pedestrian.moving",
    "motorcycle": "cycle.without_rider",
    "bicycle": "cycle.with_rider",
    "traffic_cone": "",
    "barrier": "",
}


class NuscSubmissionError(EvaluateInputError):
    """The raw nuScenes tables cannot place the evaluated samples in the global frame (names file and field)."""


@dataclass(frozen=True)
class NuscPoses:
    """`T_global_from_ref [4, 4]` of every evaluated sample (by sample token) and the tables' location."""

    table_dir: Path
    T_global_from_ref: dict[str, np.ndarray]


def split_frame_ids(data: Path, split: str) -> list[str]:
    """Frame ids of one split of a prepared directory, in shard order (only the `frame_id` column is read)."""
    import pyarrow.parquet as pq

    from pfactory.prepare.shards import open_prepared

    ds = open_prepared(data)
    ids: list[str] = []
    for s in ds.manifest["splits"][split]["shards"]:
        ids += pq.read_table(Path(data) / s["file"], columns=["frame_id"]).column("frame_id").to_pylist()
    return ids


def load_poses(raw: Path, frame_ids: list[str], reference_frame: str) -> NuscPoses:
    """Global poses of the reference frame for `frame_ids` (sample tokens) from the nuScenes tables under `raw`.

    `reference_frame`: the prepared manifest's (`ego_axes` | `lidar`). Raises `NuscSubmissionError`
    when `raw` is not a nuScenes layout, or a sample is missing or has no usable LIDAR_TOP pose.
    """
    from pfactory.sensors.errors import DatasetError
    from pfactory.sensors.nuscenes import NuScenesDataset, find_nuscenes_version

    raw = Path(raw)
    version = find_nuscenes_version(raw) if raw.is_dir() else None
    if version is None:
        raise NuscSubmissionError(
            f"{raw}: the raw nuScenes dataset the data was prepared from (samples/ and a v1.0-* table folder), "
            "to place the detections in the global frame (the manifest's source.root / --raw)"
        )
    try:
        ds = NuScenesDataset(raw, version)
    except DatasetError as e:
        raise NuscSubmissionError(str(e)) from e
    return dataset_poses(ds, frame_ids, reference_frame)


def dataset_poses(ds: Any, frame_ids: list[str], reference_frame: str) -> NuscPoses:
    """`load_poses` of an open `NuScenesDataset`."""
    from pfactory.prepare.lidar import reference_transform
    from pfactory.sensors.errors import DatasetError
    from pfactory.sensors.nuscenes import LIDAR_CHANNEL

    poses: dict[str, np.ndarray] = {}
    for fid in frame_ids:
        sd = ds.sample_data(fid).get(LIDAR_CHANNEL) if fid in ds.tables["sample"] else None
        if sd is None:
            raise NuscSubmissionError(
                f"{ds.table_dir / 'sample.json'}: token: a sample {fid!r} with a key-frame {LIDAR_CHANNEL} record "
                "(the prepared data holds it: was it prepared from another dataset?)"
            )
        try:
            T_ego_from_lidar, T_global_from_ego = ds._pose(sd)
        except DatasetError as e:
            raise NuscSubmissionError(str(e)) from e
        T_ref_from_lidar = reference_transform(ds, fid, reference_frame)
        poses[fid] = T_global_from_ego @ T_ego_from_lidar @ invert_transform(T_ref_from_lidar)
    return NuscPoses(ds.table_dir, poses)


class NuscResults:
    """The nuScenes benchmark's result-file writer (`NuScenesDataset.results_writer`; the
    `pfactory.sensors.reader.ResultWriter` contract): `report/results_nusc.json`, kpis.json's `nusc_results`.
    The poses are looked up when it is built, before the evaluation's work (a wrong dataset fails early:
    `NuscSubmissionError`)."""

    def __init__(self, dataset: Any, prepared: Path, split: str):
        from pfactory.prepare.shards import open_prepared

        reference_frame = open_prepared(prepared).manifest.get("reference_frame", "ego_axes")
        self.poses = dataset_poses(dataset, split_frame_ids(prepared, split), reference_frame)

    def write(self, out: Path, preds: list[FrameDetections]) -> dict[str, Any]:
        """`out/report/results_nusc.json` for `preds`; returns `{"nusc_results": summary}`."""
        summary = write_submission(out / "report" / RESULTS_FILE, preds, self.poses)
        summary["file"] = f"report/{RESULTS_FILE}"
        return {"nusc_results": summary}


def submission(
    frames: list[FrameDetections], poses: NuscPoses, use_camera: bool = True, use_lidar: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(document, summary)`: the submission of `frames` (reference-frame predictions, module docstring)
    and `{"samples", "boxes", "left_out": {class: n}, "capped": n}`."""
    results: dict[str, list[dict[str, Any]]] = {}
    left_out: dict[str, int] = {}
    capped = boxes_written = 0
    for f in frames:
        if f.scores is None:
            raise ValueError(f"frame {f.frame_id!r}: predictions need scores")
        T = poses.T_global_from_ref.get(f.frame_id)
        if T is None:
            raise ValueError(
                f"frame {f.frame_id!r}: no global pose (not among the samples given to load_poses)"
            )
        keep = []
        for i, name in enumerate(f.names):
            if str(name) in DETECTION_NAME:
                keep.append(i)
            else:
                left_out[str(name)] = left_out.get(str(name), 0) + 1
        idx = np.asarray(keep, dtype=np.int64)
        if len(idx) > MAX_BOXES_PER_SAMPLE:
            order = np.argsort(-f.scores[idx], kind="stable")  # descending, ties: the earlier box
            capped += len(idx) - MAX_BOXES_PER_SAMPLE
            idx = np.sort(idx[order[:MAX_BOXES_PER_SAMPLE]])
        rows = []
        if len(idx):
            b = f.boxes[idx]
            centres = b[:, :3] @ T[:3, :3].T + T[:3, 3]
            for k, i in enumerate(idx):
                length, width, height, yaw = b[k, 3:]
                det = DETECTION_NAME[str(f.names[i])]
                q = matrix_to_quaternion(T[:3, :3] @ rot_z(float(yaw)))
                rows.append(
                    {
                        "sample_token": f.frame_id,
                        "translation": [float(v) for v in centres[k]],
                        "size": [float(width), float(length), float(height)],
                        "rotation": [float(v) for v in q],
                        "velocity": [0.0, 0.0],
                        "detection_name": det,
                        "detection_score": float(f.scores[i]),
                        "attribute_name": ATTRIBUTE[det],
                    }
                )
        results[f.frame_id] = rows
        boxes_written += len(rows)
    doc = {
        "meta": {
            "use_camera": bool(use_camera),
            "use_lidar": bool(use_lidar),
            "use_radar": False,
            "use_map": False,
            "use_external": False,
        },
        "results": results,
    }
    summary = {"samples": len(results), "boxes": boxes_written, "left_out": left_out, "capped": capped}
    return doc, summary


def write_submission(
    path: Path,
    frames: list[FrameDetections],
    poses: NuscPoses,
    use_camera: bool = True,
    use_lidar: bool = True,
) -> dict[str, Any]:
    """Write `submission(...)`'s document to `path` atomically; returns its summary plus `file`."""
    from pfactory.storage.fsutil import atomic_write_text

    doc, summary = submission(frames, poses, use_camera, use_lidar)
    if any(not math.isfinite(v) for rows in doc["results"].values() for r in rows for v in r["translation"]):
        raise ValueError("a global box centre is not finite (check the tables' poses)")
    atomic_write_text(path, json.dumps(doc, separators=(",", ":")) + "\n")
    return {"file": str(path), **summary}
