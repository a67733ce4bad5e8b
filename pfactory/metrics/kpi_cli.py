"""`factory kpi`: detection KPIs from KITTI-format ground-truth and result files.

In:  `gt_dir` with KITTI `label_2` files `<frame_id>.txt` (15 columns: type trunc occ alpha
     x1 y1 x2 y2 h w l x y z ry, rectified camera frame, location = bottom centre) and `pred_dir`
     with result files of the same frame ids (the same 15 columns + a 16th, the score).
Out: the KPI dict of `pfactory.metrics.detection.evaluate_detections` (summary + `per_frame` +
     `pr_curves` + `inputs`), returned and, with `out`, written as JSON.

No calibration is needed: boxes go from the camera frame (x right, y down, z forward) to a
lidar-like frame (x forward, y left, z up) by the fixed rotation
    x_l = z_c,  y_l = -x_c,  z_l = -y_c + h/2 (box centre),  (l, w, h) kept,  yaw_l = -ry - pi/2,
a rigid transform, so BEV distances, sizes and yaw differences (all the KPIs use) are unchanged;
ranges are measured from the camera origin instead of the lidar's (KITTI: ~0.27 m apart).

A missing result file means no predictions for that frame; a result file without a GT file is
an error naming it. Every file problem is a `DatasetError` naming the file, line and field.

Run: `factory kpi --gt LABEL_DIR --pred RESULT_DIR [--out kpis.json]`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.metrics.detection import FrameDetections, KpiParams, evaluate_detections
from pfactory.sensors.errors import DatasetError
from pfactory.sensors.kitti import KittiObject, parse_label_file
from pfactory.sensors.kitti_labels import read_label_table
from pfactory.storage.fsutil import atomic_write_json

# KITTI type -> evaluated class. Other types (Van, Truck, Person_sitting, Tram, Misc, DontCare)
# are ignored on both sides.
DEFAULT_KITTI_CLASS_MAP: dict[str, str] = {"Car": "Car", "Pedestrian": "Pedestrian", "Cyclist": "Cyclist"}


def run_kpi(
    gt_dir: Path,
    pred_dir: Path,
    out: Path | None = None,
    *,
    class_map: Mapping[str, str] | None = None,
    latency: Mapping[str, Any] | None = None,
    params: KpiParams | None = None,
    metrics: str = "auto",
    frames: Path | None = None,
    **param_overrides: Any,
) -> dict[str, Any]:
    """KPIs of the KITTI result files in `pred_dir` against the labels in `gt_dir`.

    `class_map` maps KITTI types to evaluated classes (default `DEFAULT_KITTI_CLASS_MAP`);
    `params` (or keyword overrides of `KpiParams` fields, e.g. `frame_score_threshold=0.5`) set the
    evaluation; by default the classes are the class map's targets. `metrics`: "nuscenes" (the
    nuScenes-definition KPIs), "kitti" (KITTI's official metric: the `kitti*` blocks of
    `pfactory.metrics.kitti_eval`), "all", or "auto" (nuScenes, plus KITTI when the labels have 2D boxes).
    `frames`: a file of frame ids, one a line (KITTI's ImageSets/val.txt): only those frames are scored
    (ground truth and results of other frames are left out).
    Raises `DatasetError`.
    """
    if metrics not in ("auto", "nuscenes", "kitti", "all"):
        raise ValueError(f"metrics: one of auto, nuscenes, kitti, all; got {metrics!r}")
    class_map = dict(DEFAULT_KITTI_CLASS_MAP if class_map is None else class_map)
    if params is None:
        targets = tuple(dict.fromkeys(class_map.values()))  # first-seen order, unique
        param_overrides.setdefault("classes", targets)
        params = KpiParams(**param_overrides)
    elif param_overrides:
        raise TypeError("pass either params or KpiParams keyword overrides, not both")

    gt_files = _label_files(Path(gt_dir), "ground-truth", required=True)
    pred_files = _label_files(Path(pred_dir), "result", required=False)
    if frames is not None:  # only the listed frames, on both sides
        gt_files = _listed_frames(Path(frames), gt_files, Path(gt_dir))
        pred_files = {k: v for k, v in pred_files.items() if k in gt_files}
    orphans = sorted(set(pred_files) - set(gt_files))
    if orphans:
        raise DatasetError(
            pred_files[orphans[0]],
            "file name",
            f"a ground-truth file {Path(gt_dir) / (orphans[0] + '.txt')} for this result file "
            f"({len(orphans)} result file(s) have none)",
            frame_id=orphans[0],
        )

    from pfactory.metrics import kitti_eval

    kitti = metrics in ("kitti", "all") or (metrics == "auto" and kitti_eval.has_2d_boxes(gt_files))
    result: dict[str, Any] = {}
    if metrics != "kitti":
        gts, preds = load_kitti_frames(gt_files, pred_files, class_map)
        kpis = evaluate_detections(gts, preds, params, latency=latency)
        result = kpis.to_dict(per_frame=True, pr_curves=True)
    if kitti:
        result.update(kitti_eval.evaluate_kitti_files(gt_files, pred_files))
    result["inputs"] = {
        "gt_dir": str(gt_dir),
        "pred_dir": str(pred_dir),
        "num_frames": len(gt_files),
        "num_result_files": len(pred_files),
        "class_map": class_map,
        "frames_file": None if frames is None else str(frames),
        "metrics": ["nuscenes"] * (metrics != "kitti") + ["kitti"] * kitti,
    }
    if out is not None:
        atomic_write_json(out, result, indent=None)  # one line: the C encoder, ~6x faster than indent=2
    return result


class _LinePathNeeded(Exception):
    """The columnar read found something only the per-file path words the way users know it."""


def load_kitti_frames(
    gt_files: Mapping[str, Path], pred_files: Mapping[str, Path], class_map: Mapping[str, str]
) -> tuple[list[FrameDetections], list[FrameDetections]]:
    """Ground-truth and result files (`{frame_id: path}`) -> `FrameDetections` in the lidar-like frame.

    The columnar path (`pfactory.sensors.kitti_labels`, all files at once) gives the same frames as
    `load_kitti_frame` file by file; on any problem (a malformed line, a negative score, a size <= 0) the
    files are read again one by one, ground truth first, so the first error is reported exactly as before
    (file, line, field). Measured on 2,000 frames: docs/KPIS.md."""
    try:
        return _columnar(gt_files, class_map, False), _columnar(pred_files, class_map, True)
    except (DatasetError, _LinePathNeeded):
        pass
    gts = [load_kitti_frame(p, fid, class_map, with_score=False) for fid, p in gt_files.items()]
    preds = [load_kitti_frame(p, fid, class_map, with_score=True) for fid, p in pred_files.items()]
    return gts, preds


def _columnar(
    files: Mapping[str, Path], class_map: Mapping[str, str], with_score: bool
) -> list[FrameDetections]:
    t = read_label_table(list(files.values()), with_score)
    keep = np.zeros(len(t.type), dtype=bool)  # [N] an evaluated type (not np.isin: it imports numpy.ma)
    for kitti_type in class_map:
        keep |= t.type == kitti_type
    kept_types = t.type[keep]
    names = np.empty(
        len(kept_types), dtype=np.result_type(*(np.array(v) for v in class_map.values()), np.str_)
    )
    for kitti_type, cls in class_map.items():  # a vectorised compare per type, as flatten_frames does
        names[kept_types == kitti_type] = cls
    v = t.values[keep]
    boxes = camera_to_lidar(v[:, 7:10], v[:, 10:13], v[:, 13])  # [M, 7]
    scores = v[:, 14] if with_score else None  # [M]
    if (scores is not None and (scores < 0).any()) or (boxes[:, 3:6] <= 0).any():
        raise _LinePathNeeded  # the per-file path names the file, line and field
    # Everything FrameDetections checks holds now (finite values: read_label_table; sizes, scores: above).
    ends = np.cumsum(np.bincount(t.file[keep], minlength=len(t.files)))  # [F] end row of each file
    starts = ends - np.bincount(t.file[keep], minlength=len(t.files))
    return [
        FrameDetections.checked(fid, boxes[a:b], names[a:b], None if scores is None else scores[a:b])
        for fid, a, b in zip(files, starts, ends)
    ]


def load_kitti_frame(
    path: Path, frame_id: str, class_map: Mapping[str, str], with_score: bool
) -> FrameDetections:
    """One KITTI label (`with_score=False`) or result file -> `FrameDetections` in the lidar-like frame."""
    objs = parse_label_file(path, with_score=with_score)
    keep = [i for i, o in enumerate(objs) if o.type in class_map]
    boxes = kitti_camera_to_lidar([objs[i] for i in keep])  # [N, 7]
    names = [class_map[objs[i].type] for i in keep]
    scores = None
    if with_score:
        scores = np.array([objs[i].score for i in keep], dtype=np.float64)  # [N]
        bad = np.flatnonzero(scores < 0)
        if len(bad):
            raise DatasetError(
                path,
                f"line {_line_of(path, keep[bad[0]])} score",
                f"a score >= 0, got {scores[bad[0]]}",
                frame_id,
            )
    small = np.flatnonzero((boxes[:, 3:6] <= 0).any(axis=1))
    if len(small):
        raise DatasetError(
            path,
            f"line {_line_of(path, keep[small[0]])} dimensions",
            f"height, width and length > 0, got {objs[keep[small[0]]].dimensions_hwl.tolist()}",
            frame_id,
        )
    return FrameDetections(frame_id, boxes, names, scores)


def kitti_camera_to_lidar(objs: list[KittiObject]) -> np.ndarray:
    """KITTI objects (rectified camera frame, bottom centre) -> boxes `[N, 7]` (x, y, z, l, w, h, yaw)
    in the lidar-like frame of the module docstring (no calibration)."""
    if not objs:
        return np.zeros((0, 7))
    hwl = np.array([o.dimensions_hwl for o in objs], dtype=np.float64)  # [N, 3]
    loc = np.array([o.location for o in objs], dtype=np.float64)  # [N, 3] camera x right, y down, z fwd
    ry = np.array([o.rotation_y for o in objs], dtype=np.float64)  # [N] about camera +y (down)
    return camera_to_lidar(hwl, loc, ry)


def camera_to_lidar(hwl: np.ndarray, loc: np.ndarray, ry: np.ndarray) -> np.ndarray:
    """`kitti_camera_to_lidar` on columns: `hwl [N, 3]`, bottom-centre `loc [N, 3]` (camera frame),
    `ry [N]` -> boxes `[N, 7]` (x, y, z, l, w, h, yaw) in the lidar-like frame."""
    h, w, l = hwl[:, 0], hwl[:, 1], hwl[:, 2]
    # Camera heading (cos ry, 0, -sin ry) becomes (-sin ry, -cos ry, 0): yaw = -ry - pi/2.
    yaw = (-ry - math.pi / 2 + math.pi) % (2 * math.pi) - math.pi  # wrapped to [-pi, pi)
    return np.stack([loc[:, 2], -loc[:, 0], -loc[:, 1] + h / 2, l, w, h, yaw], axis=1)


def format_kpi_table(metrics: Mapping[str, Any]) -> str:
    """A plain-text table of a KPI dict: per class AP at each threshold and the TP errors (and the KITTI
    table when the dict has one)."""
    from pfactory.metrics.kitti_eval import format_kitti_table

    kitti = format_kitti_table(metrics) if metrics.get("kitti") else []
    if "classes" not in metrics:
        return "\n".join(kitti)
    return "\n".join([_format_nuscenes_table(metrics), *(["", *kitti] if kitti else [])])


def _format_nuscenes_table(metrics: Mapping[str, Any]) -> str:
    classes = metrics["classes"]
    ths = list(next(iter(classes.values()))["ap"]) if classes else []
    head = (
        f"{'class':<12}"
        + "".join(f"{'AP@' + t:>9}" for t in ths)
        + f"{'ATE':>8}{'ASE':>8}{'AOE':>8}{'#GT':>8}"
    )
    lines = [head]
    for name, c in classes.items():
        aps = "".join(f"{c['ap'][t]:>9.4f}" for t in ths)
        lines.append(f"{name:<12}{aps}{c['ate']:>8.3f}{c['ase']:>8.3f}{c['aoe']:>8.3f}{c['num_gt']:>8d}")
    lines.append(f"mAP {metrics['mAP']:.4f}   NDS* {metrics['NDS']:.4f}")
    for key, r in metrics.get("by_range", {}).items():
        lines.append(f"  range {key:>6} m: mAP {r['mAP']:.4f}  NDS* {r['NDS']:.4f}")
    if metrics.get("errors"):
        lines += ["", *format_error_table(metrics["errors"], metrics.get("params", {}))]
    return "\n".join(lines)


# Column titles of the error table: label -> (count header, dAP header).
_ERROR_COLUMNS = (
    ("tp", "TP"), ("duplicate", "dup"), ("classification", "cls"), ("localization", "loc"),
    ("both", "both"), ("background", "bkg"), ("missed", "miss"), ("heading_flip", "flip"),
)  # fmt: skip


def format_error_table(errors: Mapping[str, Any], params: Mapping[str, Any]) -> list[str]:
    """Plain-text lines of the error breakdown: counts per label, then the AP gain if each were fixed."""
    thr = params.get("frame_score_threshold", params.get("score_threshold"))  # kpis.json before the rename
    d_fg, d_bg = params.get("dist_th_tp_m", 2.0), params.get("error_bg_dist_m", 4.0)
    head = f"errors (score >= {thr}, d_fg {d_fg:g} m, d_bg {d_bg:g} m)"
    lines = [head, f"{'class':<12}" + "".join(f"{h:>7}" for _, h in _ERROR_COLUMNS)]
    for name, e in errors.items():
        lines.append(f"{name:<12}" + "".join(f"{e[k]:>7d}" for k, _ in _ERROR_COLUMNS))
    lines.append(f"{'dAP (fixed)':<12}" + "".join(f"{h:>7}" for k, h in _ERROR_COLUMNS[1:7]))
    for name, e in errors.items():
        lines.append(f"{name:<12}" + "".join(f"{e['dap'][k]:>+7.3f}" for k, _ in _ERROR_COLUMNS[1:7]))
    return lines


def _label_files(folder: Path, what: str, required: bool) -> dict[str, Path]:
    """`<frame_id>.txt` files of a folder (or of its `label_2/` subfolder), sorted by frame id."""
    if not folder.is_dir():
        raise DatasetError(folder, "directory", f"an existing directory of KITTI {what} files")
    files = _txt_files(folder)
    if not files and (folder / "label_2").is_dir():
        files = _txt_files(folder / "label_2")
    if required and not files:
        raise DatasetError(folder, "directory", f"at least one KITTI {what} file <frame_id>.txt")
    return files


def _txt_files(folder: Path) -> dict[str, Path]:
    """`{stem: path}` of the `*.txt` entries of `folder` (as `Path.glob`: dot files included, any entry
    type), sorted by name. Names are sorted as strings: the order of sorting the paths (one folder), without
    `Path.__lt__`'s cost (~0.1 s for 4,000 files, measured)."""
    import os

    with os.scandir(folder) as it:
        names = sorted(e.name for e in it if e.name.endswith(".txt"))
    paths = [folder / n for n in names]
    return {p.stem: p for p in paths}


def _listed_frames(frames: Path, gt_files: dict[str, Path], gt_dir: Path) -> dict[str, Path]:
    """The ground-truth files of the frame ids listed in `frames` (one a line, blank lines skipped)."""
    try:
        ids = [line.strip() for line in frames.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(frames, "frames", f"a readable text file of frame ids, one a line ({e})") from e
    missing = [i for i in ids if i not in gt_files]
    if missing:
        raise DatasetError(
            frames, "frame id", f"a ground-truth file {gt_dir / (missing[0] + '.txt')} for each listed frame "
            f"({len(missing)} listed frame(s) have none)", frame_id=missing[0],
        )  # fmt: skip
    if not ids:
        raise DatasetError(frames, "frames", "at least one frame id")
    return {i: gt_files[i] for i in sorted(set(ids))}


def _line_of(path: Path, k: int) -> int:
    """1-based line number of the k-th object (non-blank line) of a label file (error path only)."""
    lines = [i for i, line in enumerate(path.read_text().splitlines(), 1) if line.split()]
    return lines[k]
