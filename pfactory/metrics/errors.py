"""A TIDE-style error breakdown for 3D detection: what kind of error each detection is, per class and range.

In:  the flattened ground truth and predictions of one split (`matching.FlatBoxes`, as
     `detection.evaluate_detections` builds them) and the `KpiParams` (`frame_score_threshold`,
     `dist_th_tp_m` = d_fg, `error_bg_dist_m` = d_bg, `min_recall`, `min_precision`).
Out: `Breakdown`: one label per detection scoring >= `frame_score_threshold`, the ground truth it refers to,
     heading flips, missed ground truths, and `Breakdown.summary` (the JSON block of docs/KPIS.md):
     `{class: {"tp", "duplicate", "classification", "localization", "both", "background", "missed",
     "heading_flip", "num_det", "num_gt", "ap", "dap": {"duplicate", ..., "missed"}}}`.

Labels (d = BEV centre distance, d_fg = 2 m, d_bg = 4 m); each detection gets the first that applies:
  tp              same class, d <= d_fg to a GT of its class not matched yet (the nearest one; greedy
                  per frame by descending score, ties as the devkit: the later detection first);
  duplicate       same class, d <= d_fg to a GT of its class already matched;
  classification  d <= d_fg to a GT of another class;
  localization    same class, d_fg < d <= d_bg to a GT of its class (the nearest unmatched one, if any;
                  when every such GT is matched this is TIDE's box error on a used GT);
  both            d_fg < d <= d_bg to a GT of another class only;
  background      farther than d_bg from every GT.
GT of the class not matched as tp are `missed`; `heading_flip` counts the tp whose smallest yaw
difference exceeds pi/2 (period pi for `half_turn_classes`: never).

`dap` is TIDE's oracle (Bolya et al., ECCV 2020): the AP at d_fg of the same detections after fixing
every error of one type, minus their AP as they are (`ap`). Fixes, as TIDE's: duplicate, both and
background detections are removed; a localization error becomes a tp of its GT and a classification
error a tp of its GT's class, if that GT is not matched (the highest-scoring fix claims it), else it is
removed; missed GT are removed from the ground-truth count. Fixing one class's classification errors
raises the AP of the class they move to, so `dap` is per class of the AP that changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pfactory.metrics.matching import FlatBoxes, ap_of_list, greedy_match


class KpiParams(Protocol):
    """The fields of `detection.KpiParams` the breakdown reads (a protocol: detection imports this module)."""

    classes: tuple[str, ...]
    dist_th_tp_m: float
    error_bg_dist_m: float
    frame_score_threshold: float
    half_turn_classes: tuple[str, ...]
    min_recall: float
    min_precision: float

LABELS = ("tp", "duplicate", "classification", "localization", "both", "background")
ERROR_TYPES = LABELS[1:]
DAP_KEYS = (*ERROR_TYPES, "missed")
TP, DUPLICATE, CLASSIFICATION, LOCALIZATION, BOTH, BACKGROUND = range(len(LABELS))


@dataclass
class Breakdown:
    """The error breakdown of one split (module docstring)."""

    pred_rows: (
        np.ndarray
    )  # [D] rows of the split's prediction FlatBoxes that were labelled (score >= threshold)
    label: np.ndarray  # [D] int8 index into LABELS
    target: np.ndarray  # [D] int64 GT row the label refers to (matched / nearest GT), -1 for background
    heading_flip: np.ndarray  # [D] bool, only ever True for tp
    gt_missed: np.ndarray  # [G] bool per row of the split's GT FlatBoxes
    summary: dict[str, dict[str, Any]]  # the JSON block, per class


def error_breakdown(
    gt: FlatBoxes, pred: FlatBoxes, params: KpiParams, tp_match: np.ndarray | None = None
) -> Breakdown:
    """Label every prediction scoring >= `params.frame_score_threshold` (module docstring).

    `tp_match [P]`: the GT row each prediction of `pred` takes in the devkit's greedy matching of all
    predictions at d <= d_fg (or -1), when the caller has it (`detection._evaluate_split` does). The
    matching goes by descending score, so the predictions above the threshold take the same ground truth
    as in a matching of those alone."""
    classes = params.classes
    d_fg, d_bg = float(params.dist_th_tp_m), float(params.error_bg_dist_m)
    rows = np.flatnonzero(pred.score >= params.frame_score_threshold)  # [D]
    p_frame, p_cls = pred.frame[rows], pred.cls[rows]  # [D]
    p_boxes, p_score = pred.boxes[rows], pred.score[rows]  # [D, 7], [D]
    D, G = len(rows), len(gt.frame)
    label = np.full(D, -1, dtype=np.int8)
    target = np.full(D, -1, dtype=np.int64)
    gt_matched = np.zeros(G, dtype=bool)

    # tp: the devkit's greedy matching per class at d <= d_fg (its test is d < th; nextafter makes it <=).
    if tp_match is None:
        match_th = float(np.nextafter(d_fg, np.inf))
        tp_match = np.full(len(pred.frame), -1, dtype=np.int64)
        for c in range(len(classes)):
            g, q = np.flatnonzero(gt.cls == c), np.flatnonzero(pred.cls == c)
            _, m = greedy_match(
                gt.frame[g], gt.boxes[g, :2], pred.frame[q], pred.boxes[q, :2], pred.score[q], [match_th]
            )
            tp_match[q[m[0] >= 0]] = g[m[0][m[0] >= 0]]
    hit = tp_match[rows] >= 0
    label[hit] = TP
    target[hit] = tp_match[rows][hit]
    gt_matched[target[hit]] = True

    _label_the_rest(gt, gt_matched, p_frame, p_cls, p_boxes, label, target, d_fg, d_bg)

    # Heading flips among tp: the devkit's angle_diff (period 2 pi, or pi for half-turn classes).
    half_turn = [i for i, c in enumerate(classes) if c in params.half_turn_classes]
    # A compare per half-turn class, not np.isin: its np.unique imports numpy.ma (~25 ms of a `factory kpi`).
    half = np.zeros(len(p_cls), dtype=bool)
    for c in half_turn:
        half |= p_cls == c
    period = np.where(half, math.pi, 2 * math.pi)  # [D]
    is_tp = label == TP
    diff = np.zeros(D)
    if is_tp.any():
        t = target[is_tp]
        pe = period[is_tp]
        dy = (gt.boxes[t, 6] - p_boxes[is_tp, 6] + pe / 2) % pe - pe / 2
        diff[is_tp] = np.abs(np.where(dy > math.pi, dy - 2 * math.pi, dy))
    heading_flip = is_tp & (diff > math.pi / 2)

    summary = _summary(gt, gt_matched, rows, p_cls, p_score, label, target, heading_flip, params)
    return Breakdown(rows, label, target, heading_flip, ~gt_matched, summary)


def _label_the_rest(
    gt: FlatBoxes,
    gt_matched: np.ndarray,  # [G] bool
    p_frame: np.ndarray,  # [D]
    p_cls: np.ndarray,  # [D]
    p_boxes: np.ndarray,  # [D, 7]
    label: np.ndarray,  # [D] int8, -1 where not tp (filled here)
    target: np.ndarray,  # [D] int64 (filled here)
    d_fg: float,
    d_bg: float,
) -> None:
    """Every non-tp detection against every GT of its frame at once: one row per (detection, GT) pair,
    kept when d <= d_bg (every rule is about the GT within d_bg; the rest are background).

    Pairs are laid out detection by detection, each detection's GT in input order, so a segment
    reduction gives the nearest GT and the first index among equals is the first GT in input order."""
    rest = np.flatnonzero(label < 0)  # [R]
    R = len(rest)
    if R == 0:
        return
    n_frames = int(max(gt.frame.max(initial=-1), p_frame.max(initial=-1))) + 1
    g_order = np.argsort(gt.frame, kind="stable")  # GT grouped by frame, input order inside
    g_count = np.bincount(gt.frame, minlength=n_frames)  # [F]
    g_start = np.cumsum(g_count) - g_count
    k = g_count[p_frame[rest]]  # [R] GT in each detection's frame
    Q = int(k.sum())
    pair_det = np.repeat(np.arange(R), k)  # [Q] detection (0..R-1) of each pair
    pair_gt = g_order[np.repeat(g_start[p_frame[rest]] - (np.cumsum(k) - k), k) + np.arange(Q)]  # [Q]
    # The devkit's centre_distance arithmetic, as greedy_match.
    dx = gt.boxes[pair_gt, 0] - p_boxes[rest[pair_det], 0]
    dy = gt.boxes[pair_gt, 1] - p_boxes[rest[pair_det], 1]
    d = np.sqrt(dx * dx + dy * dy)  # [Q]
    near = d <= d_bg  # ~2 % of the pairs on the default run: everything below works on those
    pair_det, pair_gt, d = pair_det[near], pair_gt[near], d[near]
    label[rest] = BACKGROUND
    if len(d) == 0:
        return
    n = len(d)
    starts = np.flatnonzero(np.r_[True, pair_det[1:] != pair_det[:-1]])  # first pair of each detection
    has = pair_det[starts]  # [H] detections (0..R-1) with a GT within d_bg
    same = gt.cls[pair_gt] == p_cls[rest[pair_det]]  # [n]

    def seg_min(v: np.ndarray) -> np.ndarray:  # [n] -> [R], inf where no pair
        out = np.full(R, np.inf)
        out[has] = np.minimum.reduceat(v, starts)
        return out

    def first_gt(cond: np.ndarray) -> np.ndarray:  # [n] bool -> [R] GT row of the first true pair, or -1
        first = np.minimum.reduceat(np.where(cond, np.arange(n), n), starts)
        out = np.full(R, -1, dtype=np.int64)
        out[has] = np.where(first < n, pair_gt[np.minimum(first, n - 1)], -1)
        return out

    d_same = np.where(same, d, np.inf)
    d_other = np.where(same, np.inf, d)
    d_free = np.where(same & ~gt_matched[pair_gt], d, np.inf)  # same class, not matched
    min_same, min_other, min_free = seg_min(d_same), seg_min(d_other), seg_min(d_free)
    nearest_same = first_gt(same & (d_same == min_same[pair_det]))
    nearest_other = first_gt(~same & (d_other == min_other[pair_det]))
    nearest_free = first_gt(same & (d_free == min_free[pair_det]))

    # Lowest priority first; each later rule overwrites: the first rule of the list wins.
    lab = np.full(R, BACKGROUND, dtype=np.int8)
    tgt = np.full(R, -1, dtype=np.int64)
    for code, hit, to in (
        (BOTH, min_other <= d_bg, nearest_other),
        (LOCALIZATION, min_same <= d_bg, np.where(nearest_free >= 0, nearest_free, nearest_same)),
        (CLASSIFICATION, min_other <= d_fg, nearest_other),
        (DUPLICATE, min_same <= d_fg, nearest_same),
    ):
        lab[hit] = code
        tgt[hit] = to[hit]
    label[rest] = lab
    target[rest] = tgt


def _winners(candidates: np.ndarray, tgt: np.ndarray, gt_matched: np.ndarray) -> np.ndarray:
    """[D] bool: among the `candidates` (in processing order) whose GT is not matched, the first to
    claim each GT; the other candidates are removed by the fix."""
    fixable = candidates & (tgt >= 0)
    fixable[fixable] = ~gt_matched[tgt[fixable]]
    idx = np.flatnonzero(fixable)
    _, first = np.unique(tgt[idx], return_index=True)
    out = np.zeros(len(fixable), dtype=bool)
    out[idx[first]] = True
    return out


def _summary(
    gt: FlatBoxes,
    gt_matched: np.ndarray,
    rows: np.ndarray,
    p_cls: np.ndarray,
    p_score: np.ndarray,
    label: np.ndarray,
    target: np.ndarray,
    heading_flip: np.ndarray,
    params: KpiParams,
) -> dict[str, dict[str, Any]]:
    C = len(params.classes)
    n_gt = np.bincount(gt.cls, minlength=C)  # [C]
    missed = np.bincount(gt.cls[~gt_matched], minlength=C)  # [C]
    counts = np.zeros((C, len(LABELS)), dtype=np.int64)
    np.add.at(counts, (p_cls, label), 1)
    flips = np.bincount(p_cls[heading_flip], minlength=C)

    # Processing order: score descending, ties to the later prediction (the devkit's rule).
    o = np.lexsort((rows, p_score))[::-1]
    lab, cls_o, tgt = label[o], p_cls[o], target[o]
    is_tp = lab == TP

    def aps(keep: np.ndarray, tp: np.ndarray, cls_of: np.ndarray, npos: np.ndarray) -> np.ndarray:
        return np.array(
            [
                ap_of_list(tp[keep & (cls_of == c)], int(npos[c]), params.min_recall, params.min_precision)
                for c in range(C)
            ]
        )

    everything = np.ones(len(o), dtype=bool)
    base = aps(everything, is_tp, cls_o, n_gt)
    fixed: dict[str, np.ndarray] = {}
    for code, name in ((DUPLICATE, "duplicate"), (BOTH, "both"), (BACKGROUND, "background")):
        fixed[name] = aps(lab != code, is_tp, cls_o, n_gt)
    loc = lab == LOCALIZATION
    win = _winners(loc, tgt, gt_matched)
    fixed["localization"] = aps(~loc | win, is_tp | win, cls_o, n_gt)
    cls_err = lab == CLASSIFICATION
    win = _winners(cls_err, tgt, gt_matched)
    moved = cls_o.copy()
    moved[win] = gt.cls[tgt[win]]  # the fixed detection becomes one of its GT's class
    fixed["classification"] = aps(~cls_err | win, is_tp | win, moved, n_gt)
    fixed["missed"] = aps(everything, is_tp, cls_o, n_gt - missed)

    out: dict[str, dict[str, Any]] = {}
    for c, name in enumerate(params.classes):
        block: dict[str, Any] = {lbl: int(counts[c, i]) for i, lbl in enumerate(LABELS)}
        block["missed"] = int(missed[c])
        block["heading_flip"] = int(flips[c])
        block["num_det"] = int(counts[c].sum())
        block["num_gt"] = int(n_gt[c])
        block["ap"] = float(base[c])
        block["dap"] = {k: float(fixed[k][c] - base[c]) for k in DAP_KEYS}
        out[name] = block
    return out
