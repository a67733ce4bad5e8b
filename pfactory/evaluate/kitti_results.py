"""The evaluate stage's KITTI benchmark output: result files the KITTI evaluator accepts, and KITTI's metric.

In:  the raw dataset the prepared data came from (the one its manifest names, or `--raw`; KITTI layout:
     `label_2/`, `calib/`, `image_2/`; `KittiResults` is the writer `KittiDataset.results_writer` names), the
     evaluated frame ids and the optimized model's detections (`FrameDetections` in the prepared reference
     frame: x forward, y left, z up, box centre; for KITTI it is the lidar frame).
Out: `<eval>/kitti_results/<frame_id>.txt`, one per evaluated frame (empty: no detections), 16 columns:
         type  -1  -1  alpha  x1 y1 x2 y2  h w l  x y z  ry  score
     in the frame's own rectified camera frame (`KittiCalib.T_rect_from_lidar`, the exact inverse of how the
     reader converts labels), `alpha = ry - atan2(x, z)` wrapped to [-pi, pi) (the benchmark's observation
     angle), the 2D box = the box's 8 corners (the part in front of the camera: edges cut at 0.1 m projective
     depth) projected with the frame's P2 and clipped to [0, W-1] x [0, H-1] (the synthetic labels' and
     OpenPCDet's convention); truncation / occlusion are -1 (unused for results). Numbers in full precision
     (`repr`), so re-scoring reads the very doubles scored here.
     `<eval>/kitti_frames.txt`: the evaluated frame ids, one a line (KITTI's ImageSets/val.txt).
     Both are DVC outputs of the evaluate stage (cached, restored, checked out to the project's
     `artifacts/eval/`); for data that is not KITTI's they are written empty (`write_no_results`).
     `kitti_blocks(...)` of the KITTI metric, scored from those files against the dataset's own label_2.
Detections outside the camera's view: a box entirely behind the camera (no corner at >= 0.1 m depth) or
whose projection misses the image is not written. KITTI labels only objects in the camera image, and the
benchmark ignores a detection whose 2D box is under 25 px tall (40 for easy), so such a detection could
only be an unmatched box clipped to a sliver at the image border; leaving it out is what a KITTI
submission does. Their count is in `kitti_info.results.outside_view`.
Re-scoring: `factory kpi --gt RAW/training/label_2 --pred EVAL/kitti_results --frames EVAL/kitti_frames.txt
--metrics kitti` gives the same numbers (tests/tasks/test_evaluate.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.metrics.detection import FrameDetections

RESULTS_DIR = "kitti_results"
FRAMES_FILE = "kitti_frames.txt"
NEAR_M = 0.1  # projective depth (m) where box edges are cut before projecting
# The 12 edges of a box by corner index (`box_corners_rect`: 0-3 bottom, 4-7 top, same order).
_EDGES = np.array(
    [[0, 1], [1, 2], [2, 3], [3, 0], [4, 5], [5, 6], [6, 7], [7, 4], [0, 4], [1, 5], [2, 6], [3, 7]]
)


def kitti_split(raw: Path | None) -> Path | None:
    """The KITTI split directory (with label_2/ and calib/) of a raw dataset, or None when it is not one."""
    if raw is None:
        return None
    from pfactory.sensors.kitti import find_kitti_split

    split = find_kitti_split(Path(raw))
    if split is None or not (split / "label_2").is_dir():
        return None
    return split


def box_corners_rect(hwl: np.ndarray, loc: np.ndarray, ry: np.ndarray) -> np.ndarray:
    """[N, 8, 3] corners of KITTI boxes (`hwl [N, 3]`, bottom-centre `loc [N, 3]`, `ry [N]`) in the
    rectified camera frame: 0-3 the bottom (y = loc.y), 4-7 the top (y = loc.y - h), length along
    (cos ry, 0, -sin ry)."""
    h, w, l = hwl[:, 0], hwl[:, 1], hwl[:, 2]
    sx = np.array([1, 1, -1, -1, 1, 1, -1, -1]) / 2
    sz = np.array([1, -1, -1, 1, 1, -1, -1, 1]) / 2
    x = l[:, None] * sx  # [N, 8] along the length
    z = w[:, None] * sz  # [N, 8] across
    y = -h[:, None] * np.array([0, 0, 0, 0, 1, 1, 1, 1])
    c, s = np.cos(ry)[:, None], np.sin(ry)[:, None]
    return np.stack([c * x + s * z + loc[:, :1], y + loc[:, 1:2], -s * x + c * z + loc[:, 2:3]], -1)


def image_boxes(corners: np.ndarray, P: np.ndarray, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """(`[N, 4]` x1 y1 x2 y2 clipped to the image, `[N]` visible) of boxes' corners `[N, 8, 3]` (rect frame)
    projected with `P [3, 4]`; the part in front of the camera only (module docstring)."""
    n = len(corners)
    if n == 0:
        return np.zeros((0, 4)), np.zeros(0, bool)
    hom = np.concatenate([corners, np.ones((n, 8, 1))], -1) @ P.T  # [N, 8, 3] (u w, v w, w)
    a, b = hom[:, _EDGES[:, 0]], hom[:, _EDGES[:, 1]]  # [N, 12, 3] edge ends
    wa, wb = a[..., 2], b[..., 2]
    cut = (wa - NEAR_M) * (wb - NEAR_M) < 0  # [N, 12] the edge crosses the near plane
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(cut, (NEAR_M - wa) / (wb - wa), 0.0)
    cuts = a + t[..., None] * (b - a)
    pts = np.concatenate([hom, cuts], 1)  # [N, 20, 3]
    ok = np.concatenate([hom[..., 2] >= NEAR_M, cut], 1)  # [N, 20]
    w = np.where(ok, pts[..., 2], 1.0)
    u, v = pts[..., 0] / w, pts[..., 1] / w
    x1 = np.where(ok, u, np.inf).min(1)
    x2 = np.where(ok, u, -np.inf).max(1)
    y1 = np.where(ok, v, np.inf).min(1)
    y2 = np.where(ok, v, -np.inf).max(1)
    boxes = np.stack([x1, y1, x2, y2], 1)
    visible = ok.any(1) & (x2 >= 0) & (x1 <= width - 1) & (y2 >= 0) & (y1 <= height - 1)
    boxes = np.where(visible[:, None], boxes, 0.0)
    boxes = np.clip(boxes, 0, [width - 1, height - 1, width - 1, height - 1])
    visible &= (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    return boxes, visible


def _num(v: float) -> str:
    return repr(float(v))


def result_lines(frame: FrameDetections, calib: Any, width: int, height: int) -> tuple[str, int]:
    """(the frame's result file text, detections left out as outside the camera's view) for detections in
    the KITTI lidar frame, with the frame's `KittiCalib`."""
    from pfactory.sensors.kitti import lidar_boxes_to_objects

    if len(frame.boxes) == 0:
        return "", 0
    objs = lidar_boxes_to_objects(frame.boxes, list(frame.names), calib.T_rect_from_lidar)
    hwl = np.array([o.dimensions_hwl for o in objs])
    loc = np.array([o.location for o in objs])
    ry = np.array([o.rotation_y for o in objs])
    boxes, visible = image_boxes(box_corners_rect(hwl, loc, ry), calib.P["P2"], width, height)
    lines = []
    for i, o in enumerate(objs):
        if not visible[i]:
            continue
        alpha = (o.rotation_y - math.atan2(o.location[0], o.location[2]) + math.pi) % (2 * math.pi) - math.pi
        cols = [o.type, "-1", "-1", _num(alpha), *map(_num, boxes[i]), *map(_num, o.dimensions_hwl)]
        cols += [*map(_num, o.location), _num(o.rotation_y), _num(frame.scores[i])]
        lines.append(" ".join(cols))
    return "".join(line + "\n" for line in lines), int((~visible).sum())


def write_kitti_results(out: Path, split: Path, preds: list[FrameDetections]) -> dict[str, Any]:
    """`out/kitti_results/<id>.txt` and `out/kitti_frames.txt` for `preds` (module docstring), with each
    frame's calibration and image size from the KITTI split `split`; returns counts for `kitti_info`.
    Raises `DatasetError` when a frame's calib / image / label file is missing or malformed."""
    from pfactory.sensors.errors import DatasetError
    from pfactory.sensors.io import image_size
    from pfactory.sensors.kitti import KITTI_PARTS, parse_calib

    folder = out / RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    written = dropped = 0
    for f in preds:
        label = split / "label_2" / f"{f.frame_id}.txt"
        if not label.is_file():
            raise DatasetError(
                label, "label_2", f"the label file of evaluated frame {f.frame_id} (KITTI metric)"
            )
        calib = parse_calib(split / "calib" / f"{f.frame_id}{KITTI_PARTS['calib']}")
        w, h = image_size(split / "image_2" / f"{f.frame_id}{KITTI_PARTS['image_2']}")
        text, n_out = result_lines(f, calib, w, h)
        (folder / f"{f.frame_id}.txt").write_text(text)  # inside the stage's temporary build dir
        written += len(f.boxes) - n_out
        dropped += n_out
    (out / FRAMES_FILE).write_text("".join(f"{f.frame_id}\n" for f in preds))
    return {"folder": RESULTS_DIR, "frames_file": FRAMES_FILE, "written": written, "outside_view": dropped}


def write_no_results(out: Path) -> None:
    """An empty `out/kitti_results/` and `out/kitti_frames.txt`: the evaluation was not KITTI's (both are the
    evaluate stage's DVC outputs, so they exist for every dataset)."""
    (out / RESULTS_DIR).mkdir(parents=True, exist_ok=True)
    (out / FRAMES_FILE).write_text("")


def kitti_evaluation(out: Path, split: Path | None, preds: list[FrameDetections]) -> dict[str, Any]:
    """The kpis.json KITTI entries of an evaluation built in `out`: `kitti`, `kitti_R11`, `kitti_loose`,
    `kitti_loose_R11`, `kitti_info` and `kitti_results` (the folder, relative to the eval directory), scored
    against the label_2 of the KITTI split `split`; {} when `split` is None or holds no label_2."""
    if split is None or not (Path(split) / "label_2").is_dir():
        return {}
    from pfactory.metrics.kitti_eval import evaluate_kitti_files

    split = Path(split)
    stats = write_kitti_results(out, split, preds)
    ids = [f.frame_id for f in preds]
    gt_files = {i: split / "label_2" / f"{i}.txt" for i in ids}
    pred_files = {i: out / RESULTS_DIR / f"{i}.txt" for i in ids}
    blocks = evaluate_kitti_files(gt_files, pred_files)
    blocks["kitti_info"]["results"] = stats
    blocks["kitti_info"]["labels"] = (
        "label_2 of the raw dataset the data was prepared from, the evaluated frames"
    )
    blocks["kitti_results"] = RESULTS_DIR
    return blocks


class KittiResults:
    """The KITTI benchmark's result-file writer (`KittiDataset.results_writer`; the
    `pfactory.sensors.reader.ResultWriter` contract): result files + KITTI's official metric."""

    def __init__(self, dataset: Any, prepared: Path, split: str):
        self.split = Path(dataset.root)  # the KITTI split directory (label_2/, calib/, image_2/)

    def write(self, out: Path, preds: list[FrameDetections]) -> dict[str, Any]:
        """`kitti_evaluation(out, split, preds)`: the files under `out` and kpis.json's KITTI entries."""
        return kitti_evaluation(out, self.split, preds)
