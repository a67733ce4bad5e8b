"""3D detection KPIs with nuScenes semantics, vectorised with NumPy.

In:  ground-truth and predicted boxes per frame (`FrameDetections`: boxes `[N, 7]` as
     `(x, y, z, l, w, h, yaw)` in the lidar frame, class names, scores for predictions) and a
     `KpiParams` (classes, distance thresholds, range buckets, ...).
Out: `DetectionKpis`: `.metrics` is the JSON-ready summary
     `{"mAP", "NDS", "tp_errors", "classes": {name: {"ap": {"0.5": ..}, "ate", "ase", "aoe", ..}},
     "errors": {name: TIDE-style breakdown}, "by_range": {"0-20": {...same...}, ...}, "params",
     "latency"?}`, plus PR curves per class and distance threshold, per-frame TP/FP/FN counts and the
     error label of every box (`errors`, see `pfactory.metrics.errors`).

The numbers are those of nuscenes-devkit 1.2.0 (`nuscenes/eval/detection/algo.py`: `accumulate`,
`calc_ap`, `calc_tp`; `DetectionMetrics.nd_score`), reproduced detail for detail:
- predictions of a class are processed in descending score; ties go to the prediction that
  comes *later* in the input (the devkit sorts `(score, index)` tuples ascending and reverses);
- each prediction takes the nearest not-yet-taken ground truth of its class in its frame (BEV
  centre distance, first ground truth wins a distance tie) and is a TP iff that distance is
  strictly below the threshold;
- precision/confidence are `np.interp`-olated at 101 recall points (`right=0`); a class with no
  ground truth, or with no match at all, gets the devkit's "no predictions" curves (AP 0, errors 1);
- AP, TP errors and the NDS-style composite exactly as `calc_ap` / `calc_tp` / `nd_score`.
The greedy matching is sequential only within a frame, so all frames advance together one
prediction rank at a time (`matching.greedy_match`); tests/metrics/test_devkit_agreement.py checks every
number against the devkit itself. docs/KPIS.md has the definitions.

Run: `factory kpi --gt LABEL_DIR --pred RESULT_DIR` (KITTI files, `pfactory.metrics.kpi_cli`),
or `evaluate_detections(gt_frames, pred_frames, KpiParams())` from Python (`evaluate_flat` from flat arrays).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pfactory.metrics.errors import LABELS, Breakdown, error_breakdown
from pfactory.metrics.matching import (
    N_RECALL_POINTS,
    FlatBoxes,
    ap_from_precision,
    flatten_frames,
    greedy_match,
)

TP_METRICS = ("ate", "ase", "aoe")  # translation, scale, orientation errors (nuScenes trans/scale/orient_err)


@dataclass(frozen=True)
class KpiParams:
    """How detections are scored. Defaults are the nuScenes detection challenge's."""

    classes: tuple[str, ...] = ("Car", "Pedestrian", "Cyclist")
    """Classes evaluated, in report order. Boxes of any other class are ignored (GT and predictions)."""
    dist_ths_m: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    """BEV centre-distance thresholds (metres) for a match; AP is averaged over them."""
    dist_th_tp_m: float = 2.0
    """Threshold whose matches give the TP errors (ATE/ASE/AOE) and the per-frame counts."""
    min_recall: float = 0.1
    """Recall below (and at) this is ignored by AP and the TP errors."""
    min_precision: float = 0.1
    """Precision below this counts as zero; AP is normalised by `1 - min_precision`."""
    mean_ap_weight: float = 5.0
    """Weight of mAP in NDS* = (w*mAP + sum of the 3 TP scores) / (w + 3)."""
    range_buckets_m: tuple[tuple[float, float], ...] = ((0.0, 20.0), (20.0, 40.0), (40.0, math.inf))
    """BEV range buckets `[lo, hi)` from the sensor; each is evaluated on GT and predictions inside it."""
    class_range_m: Mapping[str, float] | None = None
    """Optional max BEV range per class (nuScenes `class_range`): boxes at `>=` it are dropped first."""
    half_turn_classes: tuple[str, ...] = ()
    """Classes whose orientation is only defined up to 180 degrees (nuScenes: barrier): AOE period pi."""
    frame_score_threshold: float = 0.3
    """Per-frame TP/FP/FN counts and the error breakdown use the predictions scoring at least this
    (matches at `dist_th_tp_m`)."""
    error_bg_dist_m: float = 4.0
    """Error breakdown: d_bg, beyond which a detection is background (d_fg is `dist_th_tp_m`)."""

    def __post_init__(self) -> None:
        # Tuples from lists (params.yaml gives lists), so the dataclass stays hashable/frozen.
        object.__setattr__(self, "classes", tuple(self.classes))
        object.__setattr__(self, "dist_ths_m", tuple(float(t) for t in self.dist_ths_m))
        object.__setattr__(
            self, "range_buckets_m", tuple((float(lo), float(hi)) for lo, hi in self.range_buckets_m)
        )
        object.__setattr__(self, "half_turn_classes", tuple(self.half_turn_classes))
        if not self.classes or len(set(self.classes)) != len(self.classes):
            raise ValueError(f"KpiParams.classes must be non-empty and unique, got {self.classes}")
        if not self.dist_ths_m or any(not (t > 0 and math.isfinite(t)) for t in self.dist_ths_m):
            raise ValueError(f"KpiParams.dist_ths_m must be positive finite metres, got {self.dist_ths_m}")
        if len(set(self.dist_ths_m)) != len(self.dist_ths_m):
            raise ValueError(f"KpiParams.dist_ths_m has duplicates: {self.dist_ths_m}")
        if float(self.dist_th_tp_m) not in self.dist_ths_m:
            raise ValueError(f"KpiParams.dist_th_tp_m={self.dist_th_tp_m} must be one of dist_ths_m")
        if not 0 <= self.min_precision < 1:
            raise ValueError(f"KpiParams.min_precision must be in [0, 1), got {self.min_precision}")
        if not 0 <= self.min_recall <= 1:
            raise ValueError(f"KpiParams.min_recall must be in [0, 1], got {self.min_recall}")
        if not self.mean_ap_weight >= 0:
            raise ValueError(f"KpiParams.mean_ap_weight must be >= 0, got {self.mean_ap_weight}")
        for lo, hi in self.range_buckets_m:
            if not (0 <= lo < hi):
                raise ValueError(f"KpiParams.range_buckets_m: bucket ({lo}, {hi}) needs 0 <= lo < hi")
        if not math.isfinite(self.frame_score_threshold):
            raise ValueError(f"KpiParams.frame_score_threshold must be finite, got {self.frame_score_threshold}")
        if not (math.isfinite(self.error_bg_dist_m) and self.error_bg_dist_m >= self.dist_th_tp_m):
            raise ValueError(
                f"KpiParams.error_bg_dist_m must be finite and >= dist_th_tp_m ({self.dist_th_tp_m}), "
                f"got {self.error_bg_dist_m}"
            )
        if self.class_range_m is not None:
            unknown = set(self.class_range_m) - set(self.classes)
            if unknown:
                raise ValueError(f"KpiParams.class_range_m names classes not in classes: {sorted(unknown)}")


def kpi_params_from_json(d: Mapping[str, Any]) -> KpiParams:
    """`KpiParams` back from its JSON form (`metrics["params"]`: lists, `null` for an open bucket end);
    keys a KPI document does not have keep their defaults."""
    kw = {k: v for k, v in d.items() if k in KpiParams.__dataclass_fields__}
    if "range_buckets_m" in kw:
        kw["range_buckets_m"] = [(lo, math.inf if hi is None else hi) for lo, hi in kw["range_buckets_m"]]
    return KpiParams(**kw)


@dataclass
class FrameDetections:
    """Boxes of one frame: ground truth (`scores=None`) or predictions (with scores)."""

    frame_id: str
    boxes: np.ndarray  # [N, 7] float64: x, y, z, l, w, h, yaw (lidar frame, metres / radians)
    names: np.ndarray  # [N] class names (str)
    scores: np.ndarray | None = None  # [N] float64, finite and >= 0; None for ground truth

    def __post_init__(self) -> None:
        where = f"FrameDetections(frame_id={self.frame_id!r})"
        self.boxes = np.asarray(self.boxes, dtype=np.float64)
        if self.boxes.size == 0:
            self.boxes = self.boxes.reshape(0, 7)
        if self.boxes.ndim != 2 or self.boxes.shape[1] != 7:
            raise ValueError(f"{where}: boxes must be [N, 7] (x, y, z, l, w, h, yaw), got {self.boxes.shape}")
        n = len(self.boxes)
        self.names = np.asarray(self.names, dtype=str).reshape(-1)
        if len(self.names) != n:
            raise ValueError(f"{where}: {len(self.names)} names for {n} boxes")
        if not np.isfinite(self.boxes).all():
            raise ValueError(f"{where}: boxes must be finite")
        # The devkit's scale IoU asserts every size is > 0; a zero size would divide by zero.
        if not (self.boxes[:, 3:6] > 0).all():
            bad = int(np.flatnonzero((self.boxes[:, 3:6] <= 0).any(1))[0])
            raise ValueError(f"{where}: box {bad} has a size <= 0: l, w, h = {self.boxes[bad, 3:6].tolist()}")
        if self.scores is not None:
            self.scores = np.asarray(self.scores, dtype=np.float64).reshape(-1)
            if len(self.scores) != n:
                raise ValueError(f"{where}: {len(self.scores)} scores for {n} boxes")
            # Score 0 marks "beyond max recall" in the devkit's confidence curve, and negative
            # scores break its curves; NaN has no order.
            if not (np.isfinite(self.scores).all() and (self.scores >= 0).all()):
                raise ValueError(f"{where}: scores must be finite and >= 0")

    @classmethod
    def checked(
        cls, frame_id: str, boxes: np.ndarray, names: np.ndarray, scores: np.ndarray | None
    ) -> FrameDetections:
        """A frame from arrays the caller has already checked as `__post_init__` does (boxes float64
        `[N, 7]`, finite, sizes > 0; names `[N]` str; scores `[N]` finite >= 0 or None): no second check,
        ~25 us a frame saved (`factory kpi` builds thousands from one validated table)."""
        frame = cls.__new__(cls)
        frame.frame_id, frame.boxes, frame.names, frame.scores = frame_id, boxes, names, scores
        return frame


@dataclass(frozen=True)
class MetricCurves:
    """One class at one distance threshold: the devkit's `DetectionMetricData` (101 points each)."""

    recall: np.ndarray  # [101] 0, 0.01, ..., 1
    precision: np.ndarray  # [101]
    confidence: np.ndarray  # [101] descending; 0 past the max recall reached
    trans_err: np.ndarray  # [101] cumulative-mean ATE at each operating point (m)
    scale_err: np.ndarray  # [101] cumulative-mean ASE (1 - IoU)
    orient_err: np.ndarray  # [101] cumulative-mean AOE (rad)

    @classmethod
    def no_predictions(cls) -> MetricCurves:
        """The devkit's curves for a class without ground truth or without any match."""
        ones = np.ones(N_RECALL_POINTS)
        zeros = np.zeros(N_RECALL_POINTS)
        return cls(np.linspace(0, 1, N_RECALL_POINTS), zeros, zeros.copy(), ones, ones.copy(), ones.copy())

    @property
    def max_recall_ind(self) -> int:
        """Index of the max recall reached: last point with confidence != 0 (0 if none)."""
        nz = np.flatnonzero(self.confidence)
        return int(nz[-1]) if len(nz) else 0


@dataclass
class DetectionKpis:
    """Everything `evaluate_detections` computes."""

    metrics: dict[str, Any]
    """JSON-ready summary (see module docstring / docs/KPIS.md)."""
    curves: dict[str, dict[float, MetricCurves]]
    """Overall curves: class -> distance threshold -> curves."""
    per_frame: list[dict[str, Any]]
    """One row per frame: `{"frame_id", "tp", "fp", "fn", "classes": {name: {"tp", "fp", "fn"}}}`."""
    errors: ErrorLabels | None = None
    """Per-box labels of the overall error breakdown (`metrics["errors"]` holds the counts)."""

    def pr_curves(self) -> dict[str, dict[str, dict[str, list[float]]]]:
        """PR curves for plotting: `{class: {"2.0": {"recall": [101], "precision": [101], "confidence": [101]}}}`."""
        return {
            name: {
                _th_key(th): {
                    "recall": c.recall.tolist(),
                    "precision": c.precision.tolist(),
                    "confidence": c.confidence.tolist(),
                }
                for th, c in by_th.items()
            }
            for name, by_th in self.curves.items()
        }

    def to_dict(self, per_frame: bool = True, pr_curves: bool = True) -> dict[str, Any]:
        """The summary plus, optionally, `"per_frame"` rows and `"pr_curves"`."""
        out = dict(self.metrics)
        if per_frame:
            out["per_frame"] = self.per_frame
        if pr_curves:
            out["pr_curves"] = self.pr_curves()
        return out


@dataclass
class ErrorLabels:
    """The overall error breakdown box by box, addressed by frame id and box index in its frame."""

    frame_ids: list[str]
    """Frame index -> id (GT frames first, then prediction-only frames)."""
    pred_frame: np.ndarray  # [D] frame index of each labelled detection (score >= frame_score_threshold)
    pred_box: np.ndarray  # [D] index of the detection in its prediction FrameDetections
    pred_class: np.ndarray  # [D] class index (KpiParams.classes)
    pred_score: np.ndarray  # [D] float64
    label: np.ndarray  # [D] int8 index into errors.LABELS
    heading_flip: np.ndarray  # [D] bool
    target_frame_box: np.ndarray  # [D] index of the GT the label refers to in its frame's GT, -1 if none
    gt_frame: np.ndarray  # [G] frame index of each GT box of the evaluated classes
    gt_box: np.ndarray  # [G] index of the GT in its ground-truth FrameDetections
    gt_missed: np.ndarray  # [G] bool

    @classmethod
    def of(
        cls, b: Breakdown, gt: FlatBoxes, pred: FlatBoxes, frame_ids: list[str], classes: Sequence[str]
    ) -> ErrorLabels:
        tb = np.where(b.target >= 0, gt.box[np.maximum(b.target, 0)] if len(gt.box) else -1, -1)
        return cls(
            list(frame_ids), pred.frame[b.pred_rows], pred.box[b.pred_rows], pred.cls[b.pred_rows],
            pred.score[b.pred_rows], b.label, b.heading_flip, tb, gt.frame, gt.box, b.gt_missed,
        )  # fmt: skip

    def frame(self, frame_id: str) -> dict[str, Any]:
        """`{"pred": {box index: label}, "target": {box index: GT box index the label refers to},
        "heading_flip": [box index], "missed": [GT box index]}` of a frame (boxes indexed in their frame)."""
        f = self.frame_ids.index(frame_id) if frame_id in self.frame_ids else -1
        on = self.pred_frame == f
        missed = (self.gt_frame == f) & self.gt_missed
        return {
            "pred": {int(i): LABELS[int(c)] for i, c in zip(self.pred_box[on], self.label[on])},
            "target": {
                int(i): int(t) for i, t in zip(self.pred_box[on], self.target_frame_box[on]) if t >= 0
            },
            "heading_flip": sorted(int(i) for i in self.pred_box[on & self.heading_flip]),
            "missed": sorted(int(i) for i in self.gt_box[missed]),
        }

    def frame_counts(self) -> list[dict[str, int]]:
        """Per frame index: `{label: n, ..., "missed": n, "heading_flip": n}`."""
        F = len(self.frame_ids)
        table = np.zeros((F, len(LABELS)), dtype=np.int64)
        np.add.at(table, (self.pred_frame, self.label), 1)
        missed = np.bincount(self.gt_frame[self.gt_missed], minlength=F)
        flips = np.bincount(self.pred_frame[self.heading_flip], minlength=F)
        return [
            {**{lbl: int(table[f, i]) for i, lbl in enumerate(LABELS)}, "missed": int(missed[f]),
             "heading_flip": int(flips[f])}
            for f in range(F)
        ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


def evaluate_detections(
    gt_frames: Sequence[FrameDetections],
    pred_frames: Sequence[FrameDetections],
    params: KpiParams | None = None,
    latency: Mapping[str, Any] | None = None,
) -> DetectionKpis:
    """Detection KPIs of `pred_frames` against `gt_frames` (matched by `frame_id`).

    A GT frame without a prediction frame has no predictions; a prediction frame without a GT
    frame has no ground truth (all its predictions are false positives, as in the devkit).
    The order of `pred_frames` (then of boxes inside a frame) breaks score ties, as the order of
    the devkit's `EvalBoxes` does. `latency`, if given, is copied into `metrics["latency"]`.
    """
    params = params or KpiParams()
    gt = flatten_frames(gt_frames, params.classes, is_pred=False)
    pred = flatten_frames(pred_frames, params.classes, is_pred=True, frame_index=gt.frame_index)
    return evaluate_flat(gt, pred, params, latency)


def evaluate_flat(
    gt: FlatBoxes, pred: FlatBoxes, params: KpiParams, latency: Mapping[str, Any] | None = None
) -> DetectionKpis:
    """`evaluate_detections` of frames already flattened (`matching.flatten_frames`: ground truth first,
    then the predictions with `frame_index=gt.frame_index`; or columns built the same way, as the evaluate
    stage reads them back from its files). The order of `pred`'s rows breaks score ties."""
    frame_ids = list(pred.frame_index)  # GT frames first, then prediction-only frames

    if params.class_range_m is not None:
        gt, pred = gt.subset(_within_class_range(gt, params)), pred.subset(_within_class_range(pred, params))

    overall = _evaluate_split(gt, pred, params)
    metrics: dict[str, Any] = _summary(overall, params)
    breakdown = error_breakdown(gt, pred, params, overall.tp_match)
    metrics["errors"] = breakdown.summary
    metrics["by_range"] = {}
    for lo, hi in params.range_buckets_m:
        # nuScenes filters boxes by range *before* accumulate (filter_eval_boxes); a bucket does
        # the same on both sides, so a prediction across the border from its GT is an FP in its
        # bucket and that GT a miss in the other.
        in_gt = (gt.range_m >= lo) & (gt.range_m < hi)
        in_pred = (pred.range_m >= lo) & (pred.range_m < hi)
        g, p = gt.subset(in_gt), pred.subset(in_pred)
        split = _evaluate_split(g, p, params)
        block = _summary(split, params)
        block["errors"] = error_breakdown(g, p, params, split.tp_match).summary
        metrics["by_range"][_bucket_key(lo, hi)] = block
    metrics["params"] = _params_dict(params)
    if latency is not None:
        metrics["latency"] = dict(latency)

    per_frame = _per_frame_counts(gt, pred, overall, params, frame_ids)
    curves = {name: overall.curves[name] for name in params.classes}
    labels = ErrorLabels.of(breakdown, gt, pred, frame_ids, params.classes)
    return DetectionKpis(metrics=metrics, curves=curves, per_frame=per_frame, errors=labels)


def _within_class_range(flat: FlatBoxes, params: KpiParams) -> np.ndarray:
    assert params.class_range_m is not None
    limit = np.array([params.class_range_m.get(c, math.inf) for c in params.classes])  # [C]
    return flat.range_m < limit[flat.cls]  # devkit: keep ego_dist < max_dist


# ---------------------------------------------------------------------------------------------
# Matching and curves
# ---------------------------------------------------------------------------------------------


@dataclass
class _ClassResult:
    curves: dict[float, MetricCurves]
    ap: dict[float, float]
    tp_err: dict[str, float]
    num_gt: int
    num_pred: int
    pred_rows: np.ndarray  # [P] indices of this class's predictions into the split's flat arrays
    is_tp: np.ndarray  # [P] bool, TP at dist_th_tp (prediction order as pred_rows)


@dataclass
class _SplitResult:
    classes: dict[str, _ClassResult]
    tp_match: np.ndarray  # [P] per prediction of the split, the GT row it matches at d <= d_fg, or -1

    @property
    def curves(self) -> dict[str, dict[float, MetricCurves]]:
        return {name: r.curves for name, r in self.classes.items()}


def _evaluate_split(gt: FlatBoxes, pred: FlatBoxes, params: KpiParams) -> _SplitResult:
    out = {}
    ths = params.dist_ths_m
    t_tp = ths.index(float(params.dist_th_tp_m))
    # One more threshold for the error breakdown, which matches at d <= d_fg (the devkit: d < th): it
    # shares the distance blocks of the AP thresholds instead of a second matching pass.
    match_ths = (*ths, float(np.nextafter(params.dist_th_tp_m, np.inf)))
    tp_match = np.full(len(pred.frame), -1, dtype=np.int64)  # [P] GT row matched at d <= d_fg, or -1
    for c, name in enumerate(params.classes):
        g_rows = np.flatnonzero(gt.cls == c)  # [G]
        p_rows = np.flatnonzero(pred.cls == c)  # [P], input order = the devkit's list order
        g_boxes, p_boxes = gt.boxes[g_rows], pred.boxes[p_rows]
        p_score = pred.score[p_rows]
        order, matched = greedy_match(
            gt.frame[g_rows], g_boxes[:, :2], pred.frame[p_rows], p_boxes[:, :2], p_score, match_ths
        )
        hit = matched[-1] >= 0
        tp_match[p_rows[hit]] = g_rows[matched[-1][hit]]
        period = math.pi if name in params.half_turn_classes else 2 * math.pi
        score_sorted, boxes_sorted = p_score[order], p_boxes[order]  # [P], [P, 7] in processing order
        curves: dict[float, MetricCurves] = {}
        for t, th in enumerate(ths):
            m_sorted = matched[t, order]  # [P] matched GT index (or -1) in processing order
            curves[th] = _accumulate(
                m_sorted, score_sorted, boxes_sorted, g_boxes, len(g_rows), period, with_errors=(t == t_tp)
            )
        ap = {th: calc_ap(curves[th], params.min_recall, params.min_precision) for th in ths}
        tp_curves = curves[ths[t_tp]]
        tp_err = {
            "ate": calc_tp(tp_curves, params.min_recall, tp_curves.trans_err),
            "ase": calc_tp(tp_curves, params.min_recall, tp_curves.scale_err),
            "aoe": calc_tp(tp_curves, params.min_recall, tp_curves.orient_err),
        }
        out[name] = _ClassResult(curves, ap, tp_err, len(g_rows), len(p_rows), p_rows, matched[t_tp] >= 0)
    return _SplitResult(out, tp_match)


def _accumulate(
    matched: np.ndarray,  # [P] matched GT index or -1, in processing order
    score: np.ndarray,  # [P] in processing order
    pred_boxes: np.ndarray,  # [P, 7] in processing order
    gt_boxes: np.ndarray,  # [G, 7]
    npos: int,
    period: float,
    with_errors: bool,
) -> MetricCurves:
    """The devkit's `accumulate` after matching (same operations, same order)."""
    is_tp = matched >= 0
    if npos == 0 or not is_tp.any():
        return MetricCurves.no_predictions()
    tp = np.cumsum(is_tp).astype(float)
    fp = np.cumsum(~is_tp).astype(float)
    prec = tp / (fp + tp)
    rec = tp / float(npos)
    rec_interp = np.linspace(0, 1, N_RECALL_POINTS)
    prec = np.interp(rec_interp, rec, prec, right=0)
    conf = np.interp(rec_interp, rec, score, right=0)

    if not with_errors:
        nan = np.full(N_RECALL_POINTS, np.nan)
        return MetricCurves(rec_interp, prec, conf, nan, nan, nan)
    pb, gb = pred_boxes[is_tp], gt_boxes[matched[is_tp]]  # [K, 7] matched pairs in order
    d = pb[:, :2] - gb[:, :2]
    trans = np.sqrt(d[:, 0] * d[:, 0] + d[:, 1] * d[:, 1])
    # Scale IoU of the boxes aligned on centre and heading: sizes in the devkit's (w, l, h) order.
    g_wlh, p_wlh = gb[:, [4, 3, 5]], pb[:, [4, 3, 5]]
    inter = np.prod(np.minimum(g_wlh, p_wlh), axis=1)
    iou = inter / (np.prod(g_wlh, axis=1) + np.prod(p_wlh, axis=1) - inter)
    # angle_diff(yaw_gt, yaw_pred, period), then abs.
    diff = (gb[:, 6] - pb[:, 6] + period / 2) % period - period / 2
    diff = np.where(diff > np.pi, diff - 2 * np.pi, diff)
    match_conf = score[is_tp]
    errs = [_interp_err(e, conf, match_conf) for e in (trans, 1 - iou, np.abs(diff))]
    return MetricCurves(rec_interp, prec, conf, *errs)


def _interp_err(err: np.ndarray, conf: np.ndarray, match_conf: np.ndarray) -> np.ndarray:
    """Cumulative mean of a TP error, resampled at the curve's confidences (devkit `cummean` + interp)."""
    sums = np.nancumsum(err.astype(float))
    counts = np.cumsum(~np.isnan(err))
    tmp = np.divide(sums, counts, out=np.zeros_like(sums), where=counts != 0)
    return np.interp(conf[::-1], match_conf[::-1], tmp[::-1])[::-1]


def calc_ap(curves: MetricCurves, min_recall: float, min_precision: float) -> float:
    """Normalised area of precision above `min_precision` for recall above `min_recall` (devkit calc_ap)."""
    return ap_from_precision(curves.precision, min_recall, min_precision)


def calc_tp(curves: MetricCurves, min_recall: float, err: np.ndarray) -> float:
    """Mean TP error from just above `min_recall` to the max recall reached; 1.0 if none (devkit calc_tp)."""
    first = round(100 * min_recall) + 1
    last = curves.max_recall_ind
    if last < first:
        return 1.0
    return float(np.mean(err[first : last + 1]))


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------


def _summary(split: _SplitResult, params: KpiParams) -> dict[str, Any]:
    classes: dict[str, Any] = {}
    for name in params.classes:
        r = split.classes[name]
        classes[name] = {
            "ap": {_th_key(th): r.ap[th] for th in params.dist_ths_m},
            "mean_ap": float(np.mean(list(r.ap.values()))),
            **{m: r.tp_err[m] for m in TP_METRICS},
            "num_gt": r.num_gt,
            "num_pred": r.num_pred,
        }
    # DetectionMetrics: mAP = mean over classes of the mean over thresholds; a TP error is the
    # class mean, its score max(0, 1 - error); NDS = (w mAP + sum of scores) / (w + #scores).
    m_ap = float(np.mean([classes[n]["mean_ap"] for n in params.classes]))
    tp_errors = {m: float(np.nanmean([classes[n][m] for n in params.classes])) for m in TP_METRICS}
    tp_scores = {m: max(0.0, 1.0 - e) for m, e in tp_errors.items()}
    w = params.mean_ap_weight
    nds = float((w * m_ap + sum(tp_scores.values())) / (w + len(tp_scores)))
    return {"mAP": m_ap, "NDS": nds, "tp_errors": tp_errors, "classes": classes}


def _per_frame_counts(
    gt: FlatBoxes, pred: FlatBoxes, overall: _SplitResult, params: KpiParams, frame_ids: list[str]
) -> list[dict[str, Any]]:
    """TP/FP/FN per frame and class, at `dist_th_tp_m`, for predictions scoring >= frame_score_threshold.

    Greedy matching goes by descending score, so the matches of the predictions above a score
    threshold are exactly those of the full matching: no second matching pass is needed.
    """
    F, C = len(frame_ids), len(params.classes)
    tp, fp, n_gt = (np.zeros((F, C), dtype=np.int64) for _ in range(3))
    np.add.at(n_gt, (gt.frame, gt.cls), 1)
    for c, name in enumerate(params.classes):
        r = overall.classes[name]
        kept = pred.score[r.pred_rows] >= params.frame_score_threshold  # [P]
        frames = pred.frame[r.pred_rows]
        tp[:, c] = np.bincount(frames[kept & r.is_tp], minlength=F)
        fp[:, c] = np.bincount(frames[kept & ~r.is_tp], minlength=F)
    fn = n_gt - tp
    rows = []
    for f, fid in enumerate(frame_ids):
        rows.append(
            {
                "frame_id": fid,
                "tp": int(tp[f].sum()),
                "fp": int(fp[f].sum()),
                "fn": int(fn[f].sum()),
                "classes": {
                    name: {"tp": int(tp[f, c]), "fp": int(fp[f, c]), "fn": int(fn[f, c])}
                    for c, name in enumerate(params.classes)
                },
            }
        )
    return rows


def _th_key(th: float) -> str:
    return str(float(th))  # 0.5 -> "0.5", 2 -> "2.0"


def _bucket_key(lo: float, hi: float) -> str:
    return f"{lo:g}+" if math.isinf(hi) else f"{lo:g}-{hi:g}"  # "0-20", "20-40", "40+"


def _params_dict(params: KpiParams) -> dict[str, Any]:
    d = asdict(params)
    d["range_buckets_m"] = [[lo, None if math.isinf(hi) else hi] for lo, hi in params.range_buckets_m]
    d["class_range_m"] = dict(params.class_range_m) if params.class_range_m is not None else None
    for k in ("classes", "dist_ths_m", "half_turn_classes"):
        d[k] = list(d[k])
    return d
