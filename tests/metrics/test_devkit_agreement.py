"""Our detection KPIs against nuscenes-devkit's own algorithm functions, on the same boxes.

The devkit side (`devkit_kpis`) builds `DetectionBox`/`EvalBoxes` and calls the devkit's
`accumulate`, `calc_ap` and `calc_tp` exactly as its `DetectionEval.evaluate` does; range
filtering replays `filter_eval_boxes` (`ego_dist < max_dist`, here with a lower bound too).
benchmarks/bench_kpi.py imports `devkit_kpis` from here, so both check the same thing.

Skipped with the reason when the devkit is not importable: install it with
`pip install --no-deps -r requirements/devkit.txt`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from pfactory.metrics.detection import FrameDetections, KpiParams, evaluate_detections
from pfactory.metrics.synthetic import random_detections

# Agreement demanded (absolute). Observed: 0.0 on every case here (same float operations).
TOL = 1e-6


def _import_devkit():
    try:
        from nuscenes.eval.common.data_classes import EvalBoxes
        from nuscenes.eval.common.utils import center_distance
        from nuscenes.eval.detection.algo import accumulate, calc_ap, calc_tp
        from nuscenes.eval.detection.constants import DETECTION_NAMES
        from nuscenes.eval.detection.data_classes import DetectionBox
    except ImportError as e:  # the devkit or one of its runtime deps is missing
        return None, f"nuscenes-devkit not importable ({e}); pip install --no-deps -r requirements/devkit.txt"
    return (EvalBoxes, DetectionBox, accumulate, calc_ap, calc_tp, center_distance, DETECTION_NAMES), ""


_DEVKIT, _SKIP_REASON = _import_devkit()
needs_devkit = pytest.mark.skipif(_DEVKIT is None, reason=_SKIP_REASON)


def devkit_names(params: KpiParams) -> dict[str, str]:
    """Our class -> a devkit detection name (DetectionBox validates names). Half-turn classes
    become 'barrier', the one class the devkit scores with a pi orientation period."""
    assert _DEVKIT is not None, _SKIP_REASON
    pool = [n for n in _DEVKIT[6] if n not in ("barrier", "traffic_cone")]
    out, i = {}, 0
    for c in params.classes:
        if c in params.half_turn_classes:
            out[c] = "barrier"
        else:
            out[c], i = pool[i], i + 1
    return out


def to_eval_boxes(
    frames: Sequence[FrameDetections], params: KpiParams, bucket: tuple[float, float] | None = None
) -> Any:
    """FrameDetections -> devkit EvalBoxes (sensor at the origin: ego_translation = translation)."""
    EvalBoxes, DetectionBox = _DEVKIT[0], _DEVKIT[1]
    names = devkit_names(params)
    limit = dict(params.class_range_m or {})
    eb = EvalBoxes()
    for f in frames:
        boxes = []
        for i, (x, y, z, l, w, h, yaw) in enumerate(f.boxes.tolist()):
            name = str(f.names[i])
            if name not in names:
                continue
            box = DetectionBox(
                sample_token=f.frame_id,
                translation=(x, y, z),
                size=(w, l, h),  # nuScenes order
                rotation=(math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2)),  # (w, x, y, z) about +z
                ego_translation=(x, y, z),
                detection_name=names[name],
                detection_score=float(f.scores[i]) if f.scores is not None else -1.0,
            )
            # filter_eval_boxes keeps ego_dist < max_dist; a bucket adds its lower bound.
            if box.ego_dist >= limit.get(name, math.inf):
                continue
            if bucket is not None and not (bucket[0] <= box.ego_dist < bucket[1]):
                continue
            boxes.append(box)
        eb.add_boxes(f.frame_id, boxes)
    return eb


def devkit_kpis(gt_eb: Any, pred_eb: Any, params: KpiParams) -> dict[str, dict[str, Any]]:
    """Per class: {"ap": {th: ap}, "ate"/"ase"/"aoe": err, "md": {th: DetectionMetricData}}, as the devkit."""
    _, _, accumulate, calc_ap, calc_tp, center_distance, _ = _DEVKIT
    names = devkit_names(params)
    out = {}
    for c in params.classes:
        md = {th: accumulate(gt_eb, pred_eb, names[c], center_distance, th) for th in params.dist_ths_m}
        tp_md = md[params.dist_th_tp_m]
        out[c] = {
            "ap": {th: calc_ap(md[th], params.min_recall, params.min_precision) for th in params.dist_ths_m},
            "ate": calc_tp(tp_md, params.min_recall, "trans_err"),
            "ase": calc_tp(tp_md, params.min_recall, "scale_err"),
            "aoe": calc_tp(tp_md, params.min_recall, "orient_err"),
            "md": md,
        }
    return out


def assert_agree(
    gts: Sequence[FrameDetections], preds: Sequence[FrameDetections], params: KpiParams | None = None
) -> None:
    """Overall and per-range-bucket APs, TP errors and curves agree with the devkit to TOL."""
    params = params or KpiParams()
    kpis = evaluate_detections(gts, preds, params)
    splits = [(None, kpis.metrics)] + [
        (b, kpis.metrics["by_range"][k]) for b, k in zip(params.range_buckets_m, kpis.metrics["by_range"])
    ]
    bad = []
    for bucket, ours in splits:
        ref = devkit_kpis(to_eval_boxes(gts, params, bucket), to_eval_boxes(preds, params, bucket), params)
        for c in params.classes:
            where = f"bucket={bucket} class={c}"
            for th in params.dist_ths_m:
                a, b = ours["classes"][c]["ap"][str(th)], ref[c]["ap"][th]
                if abs(a - b) > TOL:
                    bad.append(f"{where} AP@{th}: ours {a!r} devkit {b!r}")
            for m in ("ate", "ase", "aoe"):
                a, b = ours["classes"][c][m], ref[c][m]
                if abs(a - b) > TOL:
                    bad.append(f"{where} {m}: ours {a!r} devkit {b!r}")
            if bucket is None:  # full curves too, where we keep them
                for th in params.dist_ths_m:
                    mine, theirs = kpis.curves[c][th], ref[c]["md"][th]
                    for key in ("precision", "confidence", "recall"):
                        diff = np.abs(getattr(mine, key) - getattr(theirs, key))
                        if diff.max() > TOL:
                            bad.append(f"{where} {key}@{th}: {int((diff > TOL).sum())}/101 points differ")
                tp_c, tp_ref = kpis.curves[c][params.dist_th_tp_m], ref[c]["md"][params.dist_th_tp_m]
                for key in ("trans_err", "scale_err", "orient_err"):
                    diff = np.abs(getattr(tp_c, key) - getattr(tp_ref, key))
                    if diff.max() > TOL:
                        bad.append(f"{where} {key}: {int((diff > TOL).sum())}/101 points differ")
    assert not bad, f"{len(bad)} mismatches vs nuscenes-devkit:\n" + "\n".join(bad[:20])


def _frames(fid: str, boxes: list[list[float]], names: list[str], scores: list[float] | None = None):
    return FrameDetections(fid, np.array(boxes, dtype=np.float64).reshape(-1, 7), names, scores)


def _box(
    x: float, y: float, yaw: float = 0.0, lwh: tuple[float, float, float] = (4.0, 2.0, 1.5)
) -> list[float]:
    return [x, y, 0.0, *lwh, yaw]


# ---------------------------------------------------------------------------------------------


@needs_devkit
@pytest.mark.parametrize("seed", range(6))
def test_random_scenes(seed: int) -> None:
    gts, preds = random_detections(n_frames=25, gt_per_frame=12, pred_per_frame=30, seed=seed)
    assert_agree(gts, preds)


@needs_devkit
@pytest.mark.parametrize("decimals", [0, 1, 2])
def test_score_ties(decimals: int) -> None:
    # decimals=0 rounds every score to 0 or 1: ties within frames and across frames everywhere,
    # and score-0 predictions (confidence 0 ends the devkit's max-recall range).
    gts, preds = random_detections(
        n_frames=20, gt_per_frame=10, pred_per_frame=25, seed=7, score_decimals=decimals
    )
    assert_agree(gts, preds)


@needs_devkit
def test_all_scores_equal() -> None:
    gts, preds = random_detections(n_frames=15, gt_per_frame=8, pred_per_frame=20, seed=3)
    for p in preds:
        p.scores[:] = 0.5
    assert_agree(gts, preds)


@needs_devkit
def test_duplicates_and_equidistant_gt() -> None:
    # Two identical predictions (same box, same score) on one GT; a prediction halfway between two
    # GT (distance tie: the first GT wins, which decides whether the 12.5 m prediction finds a
    # GT within 2 m); a prediction exactly on a threshold (2.0 m: no match at 2 m, a match at
    # 4 m); a prediction in a frame without GT.
    gts = [
        _frames("a", [_box(0, 0), _box(10, 0), _box(12, 0, yaw=1.0, lwh=(3, 1, 1))], ["Car"] * 3),
        _frames("b", [_box(2, 0), _box(0, 30)], ["Car", "Pedestrian"]),
        _frames("c", [_box(5, 5)], ["Cyclist"]),
    ]
    preds = [
        _frames(
            "a", [_box(0.1, 0), _box(0.1, 0), _box(11, 0), _box(12.5, 0)], ["Car"] * 4, [0.9, 0.9, 0.8, 0.6]
        ),
        _frames("b", [_box(4, 0), _box(0, 30.2)], ["Car", "Pedestrian"], [0.7, 0.9]),
        _frames("c", [_box(5, 5.3, yaw=3.0)], ["Cyclist"], [0.4]),
        _frames("d", [_box(1, 1)], ["Car"], [0.95]),
    ]
    assert_agree(gts, preds)


@needs_devkit
def test_degenerate_inputs() -> None:
    gts, preds = random_detections(n_frames=10, gt_per_frame=6, pred_per_frame=12, seed=11)
    no_preds = [FrameDetections(g.frame_id, np.zeros((0, 7)), [], np.zeros(0)) for g in gts]
    assert_agree(gts, no_preds)  # no predictions at all
    assert_agree(gts, [])  # no prediction frames at all
    no_gt = [FrameDetections(g.frame_id, np.zeros((0, 7)), []) for g in gts]
    assert_agree(no_gt, preds)  # no ground truth: every class gets "no predictions" curves
    only_cars = [
        FrameDetections(g.frame_id, g.boxes[g.names == "Car"], g.names[g.names == "Car"]) for g in gts
    ]
    assert_agree(only_cars, preds)  # classes missing from the GT
    far = [
        FrameDetections(p.frame_id, p.boxes + np.array([500.0, 0, 0, 0, 0, 0, 0]), p.names, p.scores)
        for p in preds
    ]
    assert_agree(gts, far)  # predictions but no match at all


@needs_devkit
def test_params_variants() -> None:
    gts, preds = random_detections(
        n_frames=20, gt_per_frame=10, pred_per_frame=20, seed=5, classes=("A", "B")
    )
    params = KpiParams(
        classes=("A", "B"),
        dist_ths_m=(0.25, 1.0, 3.0),
        dist_th_tp_m=1.0,
        min_recall=0.05,
        min_precision=0.0,
        range_buckets_m=((0, 30), (30, 50), (50, math.inf)),
        class_range_m={"A": 60.0},
        half_turn_classes=("B",),
    )
    assert_agree(gts, preds, params)
