"""The matching core shared by the KPIs (`detection`) and the error breakdown (`errors`).

In:  `FrameDetections` lists (ground truth or predictions). Out: `FlatBoxes`, every box of the
evaluated classes in input order as flat arrays (frame index, class index, box, score, index of
the box in its frame); `greedy_match`, the nuscenes-devkit's greedy matching of one class for all
distance thresholds at once; `interp_precision` and `ap_from_precision`, the devkit's 101-point
precision curve and its normalised area (`accumulate` / `calc_ap`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class FrameDetections(Protocol):
    """What the matching reads of a `detection.FrameDetections` (a protocol: no import of detection,
    which imports this module)."""

    frame_id: str
    boxes: np.ndarray  # [N, 7]
    names: np.ndarray  # [N]
    scores: np.ndarray | None  # [N]

# The devkit interpolates every curve at 101 recall points: 0 %, 1 %, ..., 100 %.
N_RECALL_POINTS = 101


@dataclass
class FlatBoxes:
    """All boxes of one side (GT or predictions) of the evaluated classes, in input order."""

    frame: np.ndarray  # [N] int64 index into frame_index
    cls: np.ndarray  # [N] int64 index into the evaluated classes
    boxes: np.ndarray  # [N, 7] float64
    score: np.ndarray  # [N] float64 (zeros for GT)
    box: np.ndarray  # [N] int64 index of the box in its FrameDetections (to label boxes back)
    frame_index: dict[str, int] = field(default_factory=dict)

    @property
    def range_m(self) -> np.ndarray:  # [N] BEV distance from the sensor (as the devkit's ego_dist)
        x, y = self.boxes[:, 0], self.boxes[:, 1]
        return np.sqrt(x * x + y * y)

    def subset(self, keep: np.ndarray) -> FlatBoxes:
        return FlatBoxes(
            self.frame[keep],
            self.cls[keep],
            self.boxes[keep],
            self.score[keep],
            self.box[keep],
            self.frame_index,
        )


def flatten_frames(
    frames: Sequence[FrameDetections],
    classes: Sequence[str],
    is_pred: bool,
    frame_index: dict[str, int] | None = None,
) -> FlatBoxes:
    """The boxes of `frames` whose name is one of `classes` (others dropped), frames numbered in
    `frame_index` (extended with new ids). Raises ValueError on a repeated frame id."""
    index = dict(frame_index or {})
    seen: set[str] = set()
    frame_of, boxes, names, scores = [], [], [], []
    for f in frames:
        if f.frame_id in seen:
            # The devkit would merge them into one sample (changing the tie order): refuse instead.
            raise ValueError(
                f"frame_id {f.frame_id!r} appears twice in the {'predictions' if is_pred else 'GT'}"
            )
        seen.add(f.frame_id)
        if is_pred and f.scores is None:
            raise ValueError(f"prediction frame {f.frame_id!r} has no scores")
        fi = index.setdefault(f.frame_id, len(index))
        frame_of.append(np.full(len(f.boxes), fi, dtype=np.int64))
        boxes.append(f.boxes)
        names.append(f.names)
        scores.append(f.scores if is_pred else np.zeros(len(f.boxes)))
    if not boxes:
        e, i = np.zeros(0), np.zeros(0, np.int64)
        return FlatBoxes(i, i.copy(), np.zeros((0, 7)), e, i.copy(), index)
    all_names = np.concatenate(names)  # [N] str
    cls = np.full(len(all_names), -1, dtype=np.int64)  # [N], -1 = a class we do not evaluate
    for i, c in enumerate(classes):
        cls[all_names == c] = i  # a vectorised compare per class: ~3x faster than np.unique's string sort
    counts = np.array([len(b) for b in boxes], dtype=np.int64)  # [F]
    return flat_rows(
        np.concatenate(frame_of), cls, np.concatenate(boxes), np.concatenate(scores), counts, index
    )


def flat_rows(
    frame: np.ndarray,
    cls: np.ndarray,
    boxes: np.ndarray,
    scores: np.ndarray,
    counts: np.ndarray,
    frame_index: dict[str, int],
) -> FlatBoxes:
    """`FlatBoxes` of rows that come frame after frame, `counts [F]` rows each: `frame [N]` their frame's number
    in `frame_index`, `cls [N]` their class index (-1: a class not evaluated, dropped), `boxes [N, 7]`,
    `scores [N]`; each kept row remembers its index within its frame (`FlatBoxes.box`)."""
    keep = cls >= 0
    starts = np.cumsum(counts) - counts
    box = np.arange(len(cls), dtype=np.int64) - np.repeat(starts, counts)  # [N] index in its frame
    return FlatBoxes(frame[keep], cls[keep], boxes[keep], scores[keep], box[keep], frame_index)


def greedy_match(
    gt_frame: np.ndarray,  # [G] int frame index
    gt_xy: np.ndarray,  # [G, 2]
    pred_frame: np.ndarray,  # [P] int frame index
    pred_xy: np.ndarray,  # [P, 2]
    pred_score: np.ndarray,  # [P]
    dist_ths: Sequence[float],  # [T]
) -> tuple[np.ndarray, np.ndarray]:
    """The devkit's greedy matching of one class, for all thresholds at once.

    Returns `order [P]` (the devkit's processing order: score descending, ties to the later
    prediction) and `matched [T, P]` (per prediction, the index into the GT arrays it matched
    at threshold t, or -1).

    A prediction only competes with the earlier predictions *of its own frame*, so frames are
    independent: all frames advance together one rank at a time (rank r = the r-th prediction
    of each frame in processing order), each step a vectorised nearest-untaken-GT search over
    a `[frames, max GT per frame]` distance block. Frames go in groups of similar GT counts
    (`_frame_groups`: the block is as wide as the group's largest frame), each group sorted by
    prediction count, so the frames still active at rank r are a prefix.
    """
    P, T = len(pred_score), len(dist_ths)
    # sorted((score, i)) ascending, reversed == lexsort by (score, i), reversed.
    order = np.lexsort((np.arange(P), pred_score))[::-1]  # [P]
    matched = np.full((T, P), -1, dtype=np.int64)
    if P == 0 or len(gt_frame) == 0:
        return order, matched

    # GT grouped by frame; the stable sort keeps the input order inside a frame, which decides
    # distance ties (the devkit keeps the first GT of minimal distance).
    g_sorted = np.argsort(gt_frame, kind="stable")  # [G]
    g_frames, g_start, g_count = np.unique(gt_frame[g_sorted], return_index=True, return_counts=True)
    # Predictions grouped by frame, in processing order inside each frame.
    p_grouped = order[np.argsort(pred_frame[order], kind="stable")]  # [P]
    p_frames, p_start, p_count = np.unique(pred_frame[p_grouped], return_index=True, return_counts=True)

    _, gi, pi = np.intersect1d(g_frames, p_frames, assume_unique=True, return_indices=True)
    if len(gi) == 0:
        return order, matched  # no frame has both: all predictions are false positives
    ths = np.asarray(dist_ths, dtype=np.float64)
    for sel in _frame_groups(g_count[gi], p_count[pi]):
        _match_frames(gi[sel], pi[sel], g_sorted, g_start, g_count, p_grouped, p_start, p_count,
                      gt_xy, pred_xy, ths, matched)  # fmt: skip
    return order, matched


# Cost model of one rank-loop pass over a set of frames, in units of one distance-block element: a rank
# step costs ~this many elements of fixed NumPy call overhead (measured: ~25 us a step, ~10 ns an element).
_STEP_COST = 2500


def _frame_groups(n_gt: np.ndarray, n_pred: np.ndarray) -> list[np.ndarray]:
    """Frames (`[S]` GT and prediction counts) split into groups matched separately: a group's distance
    blocks are as wide as its own largest frame, not the largest of all (a few crowded frames would widen
    every block ~10x), but each group costs its own rank steps. Candidate groups are GT counts within 2x
    of each other; adjacent ones are merged where that costs less (`_STEP_COST` model, exact DP)."""
    band = np.ceil(np.log2(n_gt)).astype(np.int64)  # [S] n_gt in (2^(b-1), 2^b]
    bands = [b for b in range(int(band.min()), int(band.max()) + 1) if (band == b).any()]
    members = [np.flatnonzero(band == b) for b in bands]
    width = [int(n_gt[m].max()) for m in members]
    preds = [int(n_pred[m].sum()) for m in members]
    steps = [int(n_pred[m].max()) for m in members]
    best = [0.0] * (len(bands) + 1)  # best[j]: cheapest split of the first j bands
    cut = [0] * (len(bands) + 1)
    for j in range(1, len(bands) + 1):
        best[j] = math.inf
        for i in range(j):  # bands i..j-1 as one group
            cost = best[i] + _STEP_COST * max(steps[i:j]) + sum(preds[i:j]) * width[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(bands)
    while j > 0:
        groups.append(np.concatenate(members[cut[j] : j]))
        j = cut[j]
    return groups[::-1]


def _match_frames(
    gi: np.ndarray,  # [S] frames (index into the GT frame groups)
    pi: np.ndarray,  # [S] the same frames (index into the prediction frame groups)
    g_sorted: np.ndarray,
    g_start: np.ndarray,
    g_count: np.ndarray,
    p_grouped: np.ndarray,
    p_start: np.ndarray,
    p_count: np.ndarray,
    gt_xy: np.ndarray,  # [G, 2]
    pred_xy: np.ndarray,  # [P, 2]
    ths: np.ndarray,  # [T]
    matched: np.ndarray,  # [T, P] filled in place
) -> None:
    """`greedy_match`'s rank loop over some frames (each frame's matching is independent of the others)."""
    T = len(ths)
    slot = np.argsort(-p_count[pi], kind="stable")  # frames with most predictions first
    gi, pi = gi[slot], pi[slot]
    n_gt, n_pred, p_first = g_count[gi], p_count[pi], p_start[pi]  # [S] each
    M = int(n_gt.max())  # GT slots per frame (S = len(slot) frames)

    col = np.arange(M)
    pad = col[None, :] >= n_gt[:, None]  # [S, M] padding slots
    gt_index = g_sorted[np.minimum(g_start[gi][:, None] + col[None, :], len(g_sorted) - 1)]  # [S, M]
    gt_index[pad] = -1
    gx = gt_xy[gt_index, 0]  # [S, M] (padding reads some GT; it is masked by `taken`)
    gy = gt_xy[gt_index, 1]
    taken = np.repeat(pad[None], T, axis=0)  # [T, S, M]; padding counts as taken
    # Frames with more than r predictions: a prefix of the slots (n_pred is descending).
    n_active = np.searchsorted(-n_pred, -np.arange(int(n_pred[0])), side="left")  # [max P per frame]
    for r, k in enumerate(n_active):
        p = p_grouped[p_first[:k] + r]  # [k] the r-th prediction of each active frame
        # Same arithmetic as the devkit's center_distance (norm of the xy difference); measured
        # bit-identical on 200k random pairs, which matters for ties and boxes on a threshold.
        dx = gx[:k] - pred_xy[p, 0][:, None]  # [k, M]
        dy = gy[:k] - pred_xy[p, 1][:, None]
        d = np.sqrt(dx * dx + dy * dy)
        # Every threshold at once (each has its own taken set): [T, k, M] blocks, one argmin.
        dm = np.where(taken[:, :k], np.inf, d)  # [T, k, M]
        j = dm.argmin(axis=2)  # [T, k] first minimum = the devkit's strict `<` scan
        d_min = np.take_along_axis(dm, j[..., None], axis=2)[..., 0]  # [T, k]
        t_hit, r_hit = np.nonzero(d_min < ths[:, None])  # the (threshold, frame) pairs that match
        j_hit = j[t_hit, r_hit]
        taken[t_hit, r_hit, j_hit] = True
        matched[t_hit, p[r_hit]] = gt_index[r_hit, j_hit]


def interp_precision(is_tp: np.ndarray, npos: int) -> np.ndarray:
    """`[101]` precision at recall 0, 0.01, ..., 1 of a detection list in processing order
    (`is_tp [P]` bool), as the devkit's `accumulate` (`np.interp(..., right=0)`). The caller
    handles `npos == 0` or no TP (the devkit's "no predictions" curves)."""
    tp = np.cumsum(is_tp).astype(float)
    fp = np.cumsum(~is_tp).astype(float)
    prec = tp / (fp + tp)
    rec = tp / float(npos)
    return np.interp(np.linspace(0, 1, N_RECALL_POINTS), rec, prec, right=0)


def ap_from_precision(precision: np.ndarray, min_recall: float, min_precision: float) -> float:
    """Normalised area of precision above `min_precision` for recall above `min_recall` (devkit calc_ap)."""
    prec = np.copy(precision)
    prec = prec[round(100 * min_recall) + 1 :]  # +1 excludes the min-recall point itself
    prec -= min_precision
    prec[prec < 0] = 0
    return float(np.mean(prec)) / (1.0 - min_precision)


def ap_of_list(is_tp: np.ndarray, npos: int, min_recall: float, min_precision: float) -> float:
    """AP of a detection list in processing order: 0 without ground truth or without any TP."""
    if npos == 0 or not is_tp.any():
        return 0.0  # the devkit's "no predictions" curves: precision 0 everywhere
    return ap_from_precision(interp_precision(is_tp, npos), min_recall, min_precision)
