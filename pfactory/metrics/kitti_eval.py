"""KITTI's official 3D object metric: AP of 2D boxes, BEV and 3D boxes, and AOS, per class and difficulty.

In:  `KittiObjects` of the ground truth (KITTI `label_2` files, 15 columns) and of the detections (result
     files, 16 columns: the score last), frame by frame; `read_kitti_dir` reads a folder of them.
Out: `evaluate_kitti(gt, dt)` -> `KittiResult`, whose `tables()` are
     `{"R40": {"strict": T, "loose": T}, "R11": {...}}` with `T[Class][metric][difficulty]`: Class Car /
     Pedestrian / Cyclist, metric bbox / bev / 3d / aos, difficulty easy / moderate / hard, AP as a
     fraction in [0, 1] (None where the benchmark's value is undefined: AOS without alphas, a NaN).

The definition is the KITTI object devkit's `evaluate_object` as its widely used Python port computes it
(kitti-object-eval-python, the copy in OpenPCDet / MMDetection3D); names and numbers in docs/KPIS.md:
- difficulty (easy / moderate / hard): a ground-truth box is *ignored* (neither TP nor FN) when its 2D box
  is <= 40 / 25 / 25 px tall, its occlusion > 0 / 1 / 2 or its truncation > 0.15 / 0.30 / 0.50; a
  detection whose 2D box is < 40 / 25 / 25 px tall is ignored whatever its class;
- neighbouring classes: Van for Car and Person_sitting for Pedestrian are ignored ground truth (a detection
  matched to one is neither TP nor FP); other types do not count; names compare case-insensitively;
- DontCare regions (2D metric and AOS only): an unmatched detection whose 2D box lies more than the
  class's overlap inside one (intersection / detection area) is not a false positive;
- matching per frame, ground truth in file order: first the thresholds (every detection: the
  highest-scoring unassigned detection above the overlap; the TPs' scores give the 41 score thresholds
  at recall steps of 1/40), then at each threshold the detections scoring >= it (the unassigned valid
  detection of highest overlap, else the first ignored one);
- overlaps: 2D IoU of image boxes; BEV IoU of the rotated (x, z, l, w, ry) rectangles; 3D IoU = BEV
  intersection x height overlap / union volume (camera y points down: a box spans [y - h, y]);
- strict overlaps Car 0.7 / Pedestrian 0.5 / Cyclist 0.5 (all metrics); loose bev / 3d 0.5 / 0.25 / 0.25
  (bbox and aos keep the strict values, as in the port); AP R40 = mean precision at recall 1/40 ... 40/40,
  R11 = at recall 0, 0.1, ..., 1 (interpolated: the best precision at that recall or beyond); AOS = the
  same with each TP weighted by (1 + cos(alpha_gt - alpha_dt)) / 2, computed only when the first
  non-empty result frame's alpha is not -10 (the port's rule).

Our implementation, not the port's: NumPy over all frames at once. Overlaps are computed only for pairs of
boxes of one frame whose bounding circles meet; the rotated intersection is an exact convex-polygon clip in
float64 (the port clips in float32 on a GPU, so the two can differ on an IoU within ~1e-6 of a threshold;
equality with the port on random and adversarial scenes: tests/metrics/test_kitti_eval.py). The greedy
matching runs in rounds: a ground-truth box waits only for the earlier boxes of its frame that compete for
one of its candidate detections, and every round handles all frames and all 41 thresholds together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CLASSES = ("Car", "Pedestrian", "Cyclist")
DIFFICULTIES = ("easy", "moderate", "hard")
METRICS = ("bbox", "bev", "3d")
TABLE_METRICS = ("bbox", "bev", "3d", "aos")
# Difficulty rules of the benchmark, per level easy / moderate / hard.
MIN_HEIGHT_PX = (40.0, 25.0, 25.0)
MAX_OCCLUSION = (0, 1, 2)
MAX_TRUNCATION = (0.15, 0.30, 0.50)
# The type that counts as "ignored" ground truth for a class (the benchmark's neighbouring classes).
NEIGHBOUR = {"car": "van", "pedestrian": "person_sitting"}
# Minimum overlaps (bbox, bev, 3d) per class: the benchmark's strict set and the loose set beside it.
OVERLAPS: dict[str, dict[str, tuple[float, float, float]]] = {
    "strict": {"Car": (0.7, 0.7, 0.7), "Pedestrian": (0.5, 0.5, 0.5), "Cyclist": (0.5, 0.5, 0.5)},
    "loose": {"Car": (0.7, 0.5, 0.5), "Pedestrian": (0.5, 0.25, 0.25), "Cyclist": (0.5, 0.25, 0.25)},
}
N_SAMPLE_PTS = 41  # score thresholds / precision samples: recall 0, 1/40, ..., 1
NO_ALPHA = -10.0  # the alpha of a result line that has none (the port then skips AOS)


@dataclass
class KittiObjects:
    """Objects of many frames, column-wise, rows grouped by frame in `frame_ids` order.

    `counts [F]` rows per frame; per row: `name [N]` (the type as written), `truncated [N]`,
    `occluded [N]` int, `alpha [N]`, `bbox [N, 4]` (x1, y1, x2, y2 px), `hwl [N, 3]` (m),
    `location [N, 3]` (bottom centre, rectified camera frame: x right, y down, z forward, m),
    `rotation_y [N]` (rad, about camera y), `score [N]` (None for ground truth)."""

    frame_ids: list[str]
    counts: np.ndarray
    name: np.ndarray
    truncated: np.ndarray
    occluded: np.ndarray
    alpha: np.ndarray
    bbox: np.ndarray
    hwl: np.ndarray
    location: np.ndarray
    rotation_y: np.ndarray
    score: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = int(np.sum(self.counts))
        if len(self.counts) != len(self.frame_ids):
            raise ValueError(f"KittiObjects: {len(self.frame_ids)} frame ids but {len(self.counts)} counts")
        for k in ("name", "truncated", "occluded", "alpha", "bbox", "hwl", "location", "rotation_y"):
            if len(getattr(self, k)) != n:
                raise ValueError(f"KittiObjects: {n} rows by counts but {len(getattr(self, k))} in {k}")
        if self.score is not None and len(self.score) != n:
            raise ValueError(f"KittiObjects: {n} rows by counts but {len(self.score)} scores")

    @property
    def frame(self) -> np.ndarray:
        """[N] frame index of each row."""
        return np.repeat(np.arange(len(self.frame_ids)), self.counts)

    @classmethod
    def from_table(cls, frame_ids: Sequence[str], table: Any) -> KittiObjects:
        """From a `pfactory.sensors.kitti_labels.LabelTable` of the frames' files (in `frame_ids` order)."""
        v = table.values
        return cls(
            list(frame_ids), np.asarray(table.counts, dtype=np.int64), np.asarray(table.type, dtype=str),
            v[:, 0], v[:, 1].astype(np.int64), v[:, 2], v[:, 3:7], v[:, 7:10], v[:, 10:13], v[:, 13],
            v[:, 14] if v.shape[1] > 14 else None,
        )  # fmt: skip

    @classmethod
    def empty_like(cls, frame_ids: Sequence[str], with_score: bool) -> KittiObjects:
        z = np.zeros(0)
        return cls(
            list(frame_ids), np.zeros(len(frame_ids), np.int64), np.zeros(0, str), z, z.astype(np.int64),
            z, np.zeros((0, 4)), np.zeros((0, 3)), np.zeros((0, 3)), z, z if with_score else None,
        )  # fmt: skip

    def aligned(self, frame_ids: Sequence[str]) -> KittiObjects:
        """The same objects re-grouped into `frame_ids` (a frame not held here: no objects)."""
        if list(frame_ids) == self.frame_ids:
            return self
        where = {f: i for i, f in enumerate(self.frame_ids)}
        starts = np.concatenate([[0], np.cumsum(self.counts)])
        rows = [np.arange(starts[where[f]], starts[where[f] + 1]) for f in frame_ids if f in where]
        idx = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        counts = np.array([self.counts[where[f]] if f in where else 0 for f in frame_ids], np.int64)
        return KittiObjects(
            list(frame_ids), counts, self.name[idx], self.truncated[idx], self.occluded[idx],
            self.alpha[idx], self.bbox[idx], self.hwl[idx], self.location[idx], self.rotation_y[idx],
            None if self.score is None else self.score[idx],
        )  # fmt: skip


def read_kitti_dir(files: Mapping[str, Path], with_score: bool) -> KittiObjects:
    """`{frame_id: path}` of KITTI label (`with_score=False`) or result files -> `KittiObjects` in that
    order. Raises `DatasetError` naming the file, line and field (`pfactory.sensors.kitti_labels`)."""
    from pfactory.sensors.kitti_labels import read_label_table

    if not files:
        return KittiObjects.empty_like([], with_score)
    return KittiObjects.from_table(list(files), read_label_table(list(files.values()), with_score))


# --- overlaps ------------------------------------------------------------------------------------------


def _frame_pairs(dt_frame: np.ndarray, gt_frame: np.ndarray, n_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (detection row, ground-truth row) pair of the same frame (rows grouped by frame)."""
    n_gt = np.bincount(gt_frame, minlength=n_frames)  # [F]
    gt_start = np.concatenate([[0], np.cumsum(n_gt)[:-1]])
    k = n_gt[dt_frame]  # [D] pairs of each detection
    d = np.repeat(np.arange(len(dt_frame)), k)
    first = np.repeat(np.cumsum(k) - k, k)  # [P] index of the detection's first pair
    g = gt_start[dt_frame][d] + (np.arange(len(d)) - first)
    return d, g


def box2d_overlap(a: np.ndarray, b: np.ndarray, criterion: int = -1) -> np.ndarray:
    """Overlap of image boxes `a [P, 4]`, `b [P, 4]` (x1, y1, x2, y2) pair by pair: IoU
    (`criterion=-1`) or intersection / area of `a` (0). No +1 pixel; 0 unless width and height overlap."""
    iw = np.minimum(a[:, 2], b[:, 2]) - np.maximum(a[:, 0], b[:, 0])
    ih = np.minimum(a[:, 3], b[:, 3]) - np.maximum(a[:, 1], b[:, 1])
    inter = iw * ih
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    if criterion == -1:
        ua = area_a + (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) - inter
    else:
        ua = area_a
    ok = (iw > 0) & (ih > 0)
    out = np.zeros(len(a))
    np.divide(inter, ua, out=out, where=ok)
    return out


def bev_corners(
    x: np.ndarray, z: np.ndarray, length: np.ndarray, width: np.ndarray, ry: np.ndarray
) -> np.ndarray:
    """[P, 4, 2] corners (counter-clockwise in the (x, z) plane) of BEV rectangles: centre (x, z), length
    along (cos ry, -sin ry), width across it."""
    c, s = np.cos(ry), np.sin(ry)
    u = np.stack([c, -s], -1) * (length / 2)[:, None]  # [P, 2] half length axis
    v = np.stack([s, c], -1) * (width / 2)[:, None]  # [P, 2] half width axis
    ctr = np.stack([x, z], -1)
    return np.stack([ctr + u + v, ctr - u + v, ctr - u - v, ctr + u - v], 1)


def _cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a[..., 0] * b[..., 1] - a[..., 1] * b[..., 0]


def _inside(pts: np.ndarray, quad: np.ndarray) -> np.ndarray:
    """[P, 4] whether each of `pts [P, 4, 2]` lies in the rectangle `quad [P, 4, 2]` (boundary included)."""
    o = quad[:, None, 0]
    ab, ad = quad[:, None, 1] - o, quad[:, None, 3] - o  # the two edges at corner 0
    ap = pts - o
    s, t = np.sum(ab * ap, -1), np.sum(ad * ap, -1)
    # A relative tolerance of 1e-9: a corner shared by both rectangles (the same box turned by pi, say)
    # rounds to just outside each of them, and dropping it from both would lose a vertex.
    sab, sad = np.sum(ab * ab, -1), np.sum(ad * ad, -1)
    ea, ed = 1e-9 * sab, 1e-9 * sad
    return (s >= -ea) & (s <= sab + ea) & (t >= -ed) & (t <= sad + ed)


def rect_intersection_area(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[P] area of the intersection of rectangles `a [P, 4, 2]` and `b [P, 4, 2]` (corners in order).

    The intersection polygon's vertices are the corners of each inside the other and the crossings of their
    edges; ordered by angle about their centroid, its area is the shoelace sum (float64)."""
    p = len(a)
    if p == 0:
        return np.zeros(0)
    a2, b2 = np.roll(a, -1, 1), np.roll(b, -1, 1)
    da, db = (a2 - a)[:, :, None], (b2 - b)[:, None, :]  # [P, 4, 1, 2], [P, 1, 4, 2]
    denom = _cross(da, db)  # [P, 4, 4]
    w = b[:, None, :] - a[:, :, None]  # [P, 4, 4, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = _cross(w, db) / denom
        u = _cross(w, da) / denom
        cross_ok = (denom != 0) & (t > 0) & (t < 1) & (u > 0) & (u < 1)
        xpts = a[:, :, None] + np.where(cross_ok, t, 0.0)[..., None] * da  # [P, 4, 4, 2]
    pts = np.concatenate([a, b, xpts.reshape(p, 16, 2)], 1)  # [P, 24, 2]
    ok = np.concatenate([_inside(a, b), _inside(b, a), cross_ok.reshape(p, 16)], 1)  # [P, 24]
    pts = np.where(ok[..., None], pts, 0.0)
    n = ok.sum(1)
    ctr = pts.sum(1) / np.maximum(n, 1)[:, None]
    rel = pts - ctr[:, None]
    ang = np.where(ok, np.arctan2(rel[..., 1], rel[..., 0]), np.inf)
    order = np.argsort(ang, axis=1, kind="stable")
    rel = np.take_along_axis(rel, order[..., None], 1)
    ok = np.take_along_axis(ok, order, 1)
    rel = np.where(ok[..., None], rel, rel[:, :1])  # unused slots repeat the first vertex: no area
    area = 0.5 * np.abs(np.sum(_cross(rel, np.roll(rel, -1, 1)), 1))
    return np.where(n >= 3, area, 0.0)


@dataclass
class _Overlaps:
    """Sparse overlaps of (detection, ground truth) pairs of one frame: pairs with overlap > 0 per metric."""

    d: dict[str, np.ndarray] = field(default_factory=dict)
    g: dict[str, np.ndarray] = field(default_factory=dict)
    o: dict[str, np.ndarray] = field(default_factory=dict)


def _overlaps(gt: KittiObjects, dt: KittiObjects, gt_keep: np.ndarray, dt_keep: np.ndarray) -> _Overlaps:
    """2D, BEV and 3D overlaps of every pair (kept detection, kept ground truth) of the same frame."""
    F = len(gt.frame_ids)
    gi, di = np.flatnonzero(gt_keep), np.flatnonzero(dt_keep)
    d, g = _frame_pairs(dt.frame[di], gt.frame[gi], F)
    d, g = di[d], gi[g]
    out = _Overlaps()
    o2 = box2d_overlap(dt.bbox[d], gt.bbox[g])
    m = o2 > 0
    out.d["bbox"], out.g["bbox"], out.o["bbox"] = d[m], g[m], o2[m]
    # BEV: (x, z) centre, l = hwl[2], w = hwl[1]; pairs whose bounding circles meet.
    rad_d = 0.5 * np.hypot(dt.hwl[d, 2], dt.hwl[d, 1])
    rad_g = 0.5 * np.hypot(gt.hwl[g, 2], gt.hwl[g, 1])
    dist2 = (dt.location[d, 0] - gt.location[g, 0]) ** 2 + (dt.location[d, 2] - gt.location[g, 2]) ** 2
    m = dist2 < (rad_d + rad_g) ** 2
    d, g = d[m], g[m]
    ca = bev_corners(dt.location[d, 0], dt.location[d, 2], dt.hwl[d, 2], dt.hwl[d, 1], dt.rotation_y[d])
    cb = bev_corners(gt.location[g, 0], gt.location[g, 2], gt.hwl[g, 2], gt.hwl[g, 1], gt.rotation_y[g])
    inter = rect_intersection_area(ca, cb)
    area_d, area_g = dt.hwl[d, 2] * dt.hwl[d, 1], gt.hwl[g, 2] * gt.hwl[g, 1]
    bev = np.zeros(len(d))
    m = inter > 0
    bev[m] = inter[m] / (area_d[m] + area_g[m] - inter[m])
    out.d["bev"], out.g["bev"], out.o["bev"] = d[m], g[m], bev[m]
    # 3D: the BEV intersection times the overlap of [y - h, y] (camera y down).
    y_d, y_g = dt.location[d, 1], gt.location[g, 1]
    iw = np.minimum(y_d, y_g) - np.maximum(y_d - dt.hwl[d, 0], y_g - gt.hwl[g, 0])
    vol_d, vol_g = area_d * dt.hwl[d, 0], area_g * gt.hwl[g, 0]
    m &= iw > 0
    inc = iw[m] * inter[m]
    out.d["3d"], out.g["3d"], out.o["3d"] = d[m], g[m], inc / (vol_d[m] + vol_g[m] - inc)
    return out


# --- matching ------------------------------------------------------------------------------------------


def _rounds(pg: np.ndarray, pd: np.ndarray) -> np.ndarray:
    """[P] round of each pair's ground truth: 1 + the latest round of an earlier ground truth (global
    order) sharing one of its detections; ground truths of one round never compete for a detection."""
    ug, ginv = np.unique(pg, return_inverse=True)
    r = np.zeros(len(ug), np.int64)
    order = np.lexsort((pg, pd))
    same = pd[order][1:] == pd[order][:-1]
    prev, nxt = ginv[order][:-1][same], ginv[order][1:][same]  # edges earlier GT -> later GT
    while len(prev):
        new = r.copy()
        np.maximum.at(new, nxt, r[prev] + 1)
        if np.array_equal(new, r):
            break
        r = new
    return r[ginv]


def _greedy(pg: np.ndarray, pd: np.ndarray, pref: np.ndarray, eligible: np.ndarray) -> tuple[np.ndarray, ...]:
    """The benchmark's per-frame greedy assignment over candidate pairs, for T score thresholds at once.

    `pg [P]`, `pd [P]` global ids of each candidate pair's ground truth and detection; `pref [P]` sort key
    (smaller = preferred by the ground truth); `eligible [P, T]` the detection may be taken at threshold t.
    Ground truths take in id order; each takes its most preferred eligible unassigned detection.
    Returns (gt ids `[G]`, chosen pair index `[G, T]` (-1: none))."""
    T = eligible.shape[1]
    if len(pg) == 0:
        return np.zeros(0, np.int64), np.zeros((0, T), np.int64)
    rnd = _rounds(pg, pd)
    order = np.lexsort((pref, pg, rnd))
    pg, pd, rnd, el = pg[order], pd[order], rnd[order], eligible[order]
    _, dcompact = np.unique(pd, return_inverse=True)
    assigned = np.zeros((dcompact.max() + 1, T), bool)
    new_g = np.concatenate([[True], pg[1:] != pg[:-1]])
    starts_all = np.flatnonzero(new_g)
    chosen = np.full((len(starts_all), T), -1, np.int64)
    bounds = np.searchsorted(rnd[starts_all], np.arange(rnd.max() + 2))  # group range of each round
    cols = np.arange(T)
    for r in range(rnd.max() + 1):
        g0, g1 = bounds[r], bounds[r + 1]
        if g0 == g1:
            continue
        p0 = starts_all[g0]
        p1 = starts_all[g1] if g1 < len(starts_all) else len(pg)
        e = el[p0:p1] & ~assigned[dcompact[p0:p1]]  # [Pr, T]
        idx = np.where(e, np.arange(p1 - p0)[:, None], p1 - p0)
        first = np.minimum.reduceat(idx, starts_all[g0:g1] - p0, axis=0)  # [Gr, T]
        has = first < p1 - p0
        pick = np.where(has, first + p0, -1)
        chosen[g0:g1] = pick
        gi, ti = np.nonzero(has)
        assigned[dcompact[pick[gi, ti]], cols[ti]] = True
    chosen = np.where(chosen >= 0, order[np.maximum(chosen, 0)], -1)  # back to the caller's pair index
    return pg[starts_all], chosen


def score_thresholds(scores: np.ndarray, num_gt: int) -> np.ndarray:
    """The benchmark's score thresholds: TP scores at (about) recall 1/40, 2/40, ... (at most 41).

    Walks the TP scores in descending order; a score is kept when its recall is the closest to the
    next recall step (`get_thresholds` of the port, the same float arithmetic)."""
    s = np.sort(np.asarray(scores, dtype=np.float64))[::-1]
    n = len(s)
    if n == 0:
        return s
    i = np.arange(n)
    left = (i + 1) / num_gt
    right = np.where(i < n - 1, (i + 2) / num_gt, left)
    out, cur, start = [], 0.0, 0
    while start < n:
        skip = ((right[start:] - cur) < (cur - left[start:])) & (i[start:] < n - 1)
        j = start + int(np.argmin(skip))  # the first index not skipped (the last never is)
        out.append(s[j])
        cur += 1 / (N_SAMPLE_PTS - 1.0)
        start = j + 1
    return np.array(out)


@dataclass
class KittiResult:
    """Precision / AOS curves and APs of one evaluation (module docstring)."""

    classes: tuple[str, ...]
    precision: dict[tuple[str, str, str, str], np.ndarray]  # (overlaps, class, metric, difficulty) -> [41]
    aos: dict[tuple[str, str, str], np.ndarray | None]  # (overlaps, class, difficulty) -> [41] or None
    num_gt: dict[tuple[str, str], int]  # (class, difficulty) -> ground-truth boxes counted
    compute_aos: bool

    def tables(self) -> dict[str, dict[str, dict[str, dict[str, dict[str, float | None]]]]]:
        """`{"R40"|"R11": {"strict"|"loose": {Class: {metric: {difficulty: AP}}}}}` (fractions)."""
        out: dict[str, Any] = {}
        for rec, ap in (("R40", ap_r40), ("R11", ap_r11)):
            out[rec] = {}
            for ov in OVERLAPS:
                t = out[rec][ov] = {}
                for c in self.classes:
                    t[c] = {
                        m: {d: _num(ap(self.precision[ov, c, m, d])) for d in DIFFICULTIES} for m in METRICS
                    }
                    t[c]["aos"] = {
                        d: None if self.aos[ov, c, d] is None else _num(ap(self.aos[ov, c, d]))
                        for d in DIFFICULTIES
                    }
        return out


def _num(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def ap_r40(prec: np.ndarray) -> float:
    """AP at 40 recall points: mean of the interpolated precision at recall 1/40 ... 1."""
    return float(np.sum(prec[1:N_SAMPLE_PTS]) / 40)


def ap_r11(prec: np.ndarray) -> float:
    """AP at 11 recall points: mean of the interpolated precision at recall 0, 0.1, ..., 1."""
    return float(np.sum(prec[0:N_SAMPLE_PTS:4]) / 11)


def _lower(names: np.ndarray) -> np.ndarray:
    """`names` lowercased (the handful of distinct names once, not every row)."""
    uniq, inv = np.unique(names, return_inverse=True)
    return np.char.lower(uniq)[inv] if len(uniq) else names


def _gt_flags(gt: KittiObjects, cls: str, diff: int, name: np.ndarray) -> np.ndarray:
    """[G] 0 counted, 1 ignored (neighbouring class, or too hard), -1 not this class (`name`: lowercased)."""
    valid = np.where(name == cls.lower(), 1, np.where(name == NEIGHBOUR.get(cls.lower(), "\0"), 0, -1))
    height = gt.bbox[:, 3] - gt.bbox[:, 1]
    hard = (
        (gt.occluded > MAX_OCCLUSION[diff])
        | (gt.truncated > MAX_TRUNCATION[diff])
        | (height <= MIN_HEIGHT_PX[diff])
    )
    return np.where((valid == 1) & ~hard, 0, np.where((valid == 0) | ((valid == 1) & hard), 1, -1))


def _dt_flags(dt: KittiObjects, cls: str, diff: int, name: np.ndarray) -> np.ndarray:
    """[D] 0 counted, 1 ignored (2D box too small, any class), -1 another class (`name`: lowercased)."""
    height = np.abs(dt.bbox[:, 3] - dt.bbox[:, 1])
    same = name == cls.lower()
    return np.where(height < MIN_HEIGHT_PX[diff], 1, np.where(same, 0, -1))


def evaluate_kitti(gt: KittiObjects, dt: KittiObjects, classes: Sequence[str] = CLASSES) -> KittiResult:
    """KITTI AP (module docstring) of detections `dt` against ground truth `gt`; `dt` is re-grouped into
    `gt.frame_ids` (frames without detections allowed; detections of other frames are an error)."""
    classes = tuple(classes)
    unknown = [c for c in classes if c not in OVERLAPS["strict"]]
    if unknown:
        raise ValueError(f"KITTI classes: {unknown} have no benchmark overlaps; known: {list(CLASSES)}")
    extra = sorted(set(dt.frame_ids) - set(gt.frame_ids))
    if extra:
        raise ValueError(f"detections for {len(extra)} frame(s) without ground truth, e.g. {extra[0]!r}")
    if dt.score is None:
        raise ValueError("detections need scores (16-column result lines)")
    dt = dt.aligned(gt.frame_ids)
    # The port's AOS switch: the first frame with detections has a real alpha in its first line.
    first = np.flatnonzero(dt.counts)
    compute_aos = bool(len(first)) and bool(dt.alpha[int(np.sum(dt.counts[: first[0]]))] != NO_ALPHA)

    lower_gt, lower_dt = _lower(gt.name), _lower(dt.name)
    names = {c.lower() for c in classes} | {NEIGHBOUR[c.lower()] for c in classes if c.lower() in NEIGHBOUR}
    gt_keep = np.isin(lower_gt, list(names))
    dt_small = np.abs(dt.bbox[:, 3] - dt.bbox[:, 1]) < max(MIN_HEIGHT_PX)
    dt_keep = np.isin(lower_dt, [c.lower() for c in classes]) | dt_small
    ov = _overlaps(gt, dt, gt_keep, dt_keep)

    # DontCare regions (2D metric only): per detection, the largest intersection / detection area.
    dc = gt.name == "DontCare"
    dd, dg = _frame_pairs(dt.frame, gt.frame[dc], len(gt.frame_ids))
    dc_ov = np.zeros(len(dt.frame))
    if len(dd):
        np.maximum.at(dc_ov, dd, box2d_overlap(dt.bbox[dd], gt.bbox[np.flatnonzero(dc)[dg]], criterion=0))

    precision: dict[tuple[str, str, str, str], np.ndarray] = {}
    aos: dict[tuple[str, str, str], np.ndarray | None] = {}
    num_gt: dict[tuple[str, str], int] = {}
    cache: dict[tuple, tuple[np.ndarray, np.ndarray | None]] = {}
    for c in classes:
        for di, dname in enumerate(DIFFICULTIES):
            gflag, dflag = _gt_flags(gt, c, di, lower_gt), _dt_flags(dt, c, di, lower_dt)
            num_gt[c, dname] = int(np.sum(gflag == 0))
            for ov_name, table in OVERLAPS.items():
                for mi, metric in enumerate(METRICS):
                    key = (c, di, metric, table[c][mi])
                    if key not in cache:
                        with_aos = metric == "bbox" and compute_aos
                        cache[key] = _curves(
                            ov.d[metric], ov.g[metric], ov.o[metric], table[c][mi], gflag, dflag,
                            dt.score, dc_ov if metric == "bbox" else None, gt.alpha, dt.alpha, with_aos,
                        )  # fmt: skip
                    prec, orient = cache[key]
                    precision[ov_name, c, metric, dname] = prec
                    if metric == "bbox":
                        aos[ov_name, c, dname] = orient
    return KittiResult(classes, precision, aos, num_gt, compute_aos)


def _curves(
    pd: np.ndarray,
    pg: np.ndarray,
    po: np.ndarray,
    min_overlap: float,
    gflag: np.ndarray,
    dflag: np.ndarray,
    score: np.ndarray,
    dc_ov: np.ndarray | None,
    gt_alpha: np.ndarray,
    dt_alpha: np.ndarray,
    with_aos: bool,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Interpolated precision `[41]` (and AOS `[41]` when `with_aos`) of one class, difficulty, metric
    and minimum overlap, from the sparse pair overlaps (`po` > 0) and the flags of every box."""
    m = (po > min_overlap) & (gflag[pg] != -1) & (dflag[pd] != -1)
    pd, pg, po = pd[m], pg[m], po[m]
    num_valid_gt = int(np.sum(gflag == 0))
    # Pass 1 (every detection): the highest score wins; a TP's score is a threshold candidate.
    ug, pick = _greedy(pg, pd, np.lexsort((pd, -score[pd])).argsort(), np.ones((len(pd), 1), bool))
    pick = pick[:, 0]
    has = pick >= 0
    tp_pairs = pick[has][(gflag[ug[has]] == 0) & (dflag[pd[pick[has]]] == 0)]
    thr = score_thresholds(score[pd[tp_pairs]], num_valid_gt)
    prec = np.zeros(N_SAMPLE_PTS)
    orient = np.zeros(N_SAMPLE_PTS) if with_aos else None
    if len(thr) == 0:
        return prec, orient
    # Pass 2 (detections scoring >= each threshold): a valid detection of highest overlap, else the
    # first ignored one (ties: the earlier detection).
    valid = dflag[pd] == 0
    pref = np.lexsort((pd, np.where(valid, -po, 0.0), ~valid)).argsort()
    ug, pick = _greedy(pg, pd, pref, score[pd][:, None] >= thr[None, :])
    T = len(thr)
    tp = np.zeros(T)
    assigned_nodc = np.zeros(T)  # assigned valid detections outside DontCare (they are not FPs)
    sim = np.zeros(T)
    gi, ti = np.nonzero(pick >= 0)
    p = pick[gi, ti]
    vd = dflag[pd[p]] == 0
    is_tp = vd & (gflag[ug[gi]] == 0)
    tp += np.bincount(ti[is_tp], minlength=T)
    nodc = vd if dc_ov is None else vd & ~(dc_ov[pd[p]] > min_overlap)
    assigned_nodc += np.bincount(ti[nodc], minlength=T)
    # Valid detections above each threshold that no DontCare region swallows.
    cand = (dflag == 0) if dc_ov is None else (dflag == 0) & ~(dc_ov > min_overlap)
    s = np.sort(score[cand])
    n_valid = len(s) - np.searchsorted(s, thr, side="left")  # [T] scores >= threshold
    fp = n_valid - assigned_nodc
    with np.errstate(divide="ignore", invalid="ignore"):
        prec[:T] = tp / (tp + fp)
        if with_aos:
            np.add.at(sim, ti[is_tp], (1.0 + np.cos(gt_alpha[ug[gi[is_tp]]] - dt_alpha[pd[p[is_tp]]])) / 2.0)
            orient[:T] = sim / (tp + fp)
    prec = np.maximum.accumulate(prec[::-1])[::-1]  # best precision at this recall or beyond
    if with_aos:
        orient = np.maximum.accumulate(orient[::-1])[::-1]
    return prec, orient


# --- the kpis.json blocks ------------------------------------------------------------------------------

KPI_KEYS = {
    "kitti": ("R40", "strict"),
    "kitti_R11": ("R11", "strict"),
    "kitti_loose": ("R40", "loose"),
    "kitti_loose_R11": ("R11", "loose"),
}
"""kpis.json key -> (recall sampling, overlap set): `kitti` is the benchmark's headline (R40, strict)."""


def kitti_blocks(res: KittiResult) -> dict[str, Any]:
    """The kpis.json blocks of a `KittiResult`: `kitti`, `kitti_R11`, `kitti_loose`, `kitti_loose_R11` (each
    `[Class][metric][difficulty]`, fractions) and `kitti_info` (overlaps, counted ground truth, AOS)."""
    tables = res.tables()
    out: dict[str, Any] = {key: tables[rec][ov] for key, (rec, ov) in KPI_KEYS.items()}
    out["kitti_info"] = {
        "definition": "KITTI object devkit evaluate_object, as kitti-object-eval-python computes it (docs/KPIS.md)",
        "overlaps": {
            ov: {c: dict(zip(METRICS, OVERLAPS[ov][c])) for c in res.classes} for ov in ("strict", "loose")
        },
        "num_gt": {c: {d: res.num_gt[c, d] for d in DIFFICULTIES} for c in res.classes},
        "aos": res.compute_aos,
    }
    return out


def format_kitti_table(doc: Mapping[str, Any]) -> list[str]:
    """Plain-text lines: per class and metric, AP (R40, strict overlaps) easy / moderate / hard, in %."""
    t = doc.get("kitti") or {}
    lines = [f"KITTI AP R40 (%), strict overlaps   {'easy':>8}{'moderate':>10}{'hard':>8}"]
    for c, by_m in t.items():
        for m in TABLE_METRICS:
            vals = [by_m[m][d] for d in DIFFICULTIES]
            cells = "".join(
                f"{'-' if v is None else f'{100 * v:.2f}':>{w}}" for v, w in zip(vals, (8, 10, 8))
            )
            lines.append(f"  {c:<12}{m:<22}{cells}")
    return lines


def evaluate_kitti_files(
    gt_files: Mapping[str, Path], pred_files: Mapping[str, Path], classes: Sequence[str] = CLASSES
) -> dict[str, Any]:
    """`kitti_blocks` of result files `{frame_id: path}` against label files (same ids or a subset)."""
    gt = read_kitti_dir(gt_files, with_score=False)
    dt = read_kitti_dir(pred_files, with_score=True)
    return kitti_blocks(evaluate_kitti(gt, dt, classes))


def has_2d_boxes(gt_files: Mapping[str, Path], sample: int = 20) -> bool:
    """Whether the first `sample` non-empty label files hold a 2D box taller than 0 px (real KITTI labels do;
    the evaluate stage's calibration-free `report/kitti/ground_truth` files write `0 0 0 0`)."""
    seen = 0
    for path in gt_files.values():
        text = Path(path).read_text(errors="replace")
        for line in text.splitlines():
            cols = line.split()
            if len(cols) >= 8:
                try:
                    if float(cols[7]) - float(cols[5]) > 0:
                        return True
                except ValueError:
                    return False  # the KPI reader names the bad field
        seen += bool(text.strip())
        if seen >= sample:
            break
    return False
