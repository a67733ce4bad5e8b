"""Parity of an optimized artifact vs the PyTorch model: metrics per output, a gate, `parity.json`.

In:  reference and candidate outputs of the same frames, each a list (one entry per runner call) of
     `{"boxes": [B, K, 7], "scores": [B, K], "labels": [B, K]}` numpy arrays; `ParityParams`.
Out: `compare_outputs(...) -> dict` of metrics; `gate(metrics, tolerance) -> list[str]` of failures,
     each naming the metric, its value and the limit; `parity_report(...)` assembles `parity.json`.

How outputs are compared (docs/OPTIMIZE.md, "Parity"):
- detections: entries with reference score >= `score_threshold` (`evaluate.score_threshold`; candidate entries likewise);
- matching: greedy in descending reference score, a candidate of the same label whose BEV centre is
  within `match_distance_m` and not yet taken. Matching, not index alignment, because two peaks whose
  scores differ by 1e-7 may swap rank between runtimes: same detections, different order;
- boxes: over matched pairs, the metric parameters x, y, z, l, w, h: max |diff|, max rel diff
  (|diff| / max(|ref|, boxes_rel_floor)), cosine of the flattened pairs;
- yaw: max and 99th-percentile |diff| wrapped to [-pi, pi], absolute (radians): an angle has no
  meaningful relative error, and yaw = atan2(sin, cos) amplifies float noise by 1 / |(sin, cos)| (~1e3
  for a random-init head; an unsure heading of a trained one), so FP32 bounds the percentile tightly
  (`yaw_p99_atol`) and every detection loosely (`yaw_atol`);
- scores: max |diff| and rel diff over matched pairs; cosine of the full rank-aligned score vectors
  (both sorted descending, so the cosine does not depend on tie order);
- gate of each element check: numpy `allclose`, |diff| <= atol + rtol * |ref|, reported as
  `tolerance_ratio` = max |diff| / (atol + rtol * |ref|) (<= 1 passes). An rtol alone cannot work in
  float32: PyTorch against itself at another thread count differs by 1.1e-4 relative on a 0.18 score;
- labels: agreement of the rank-aligned labels over reference detections (informational);
- match rate: matched / max(#reference, #candidate detections): missing and extra detections both count;
- repeatability: the candidate run twice on the same frames must agree (to `repeat_atol`; 0 = bitwise):
  a kernel that races (ORT's ScatterND reduction over duplicate rows did: graph_rewrite.py) shows here
  even when one run happens to land close to PyTorch;
- agreement (`detection_agreement`, the robust view INT8 is gated on): the same matching restricted to
  confident detections (score >= `agreement_score_threshold`, 0.3), their match rate, and quantiles of
  the matched-score |diff|, BEV centre distance and |yaw diff| (p50/p95/p99/max); the heading agreement:
  the share of matched confident detections whose heading stayed within `HEADING_TURNED_RAD` (a layer
  that turns headings keeps every box and score, and only this sees it). A percentile, not the worst
  element: one near-threshold peak that INT8 moves by 0.2 is noise, many are a defect.

Rates are judged with their support (`judge_rate`): a match rate k/n (n = max(#reference, #candidate)) is
gated only when n >= `rate_min_support`, and then refused only when the upper bound of its two-sided
Wilson score interval at `rate_confidence` is below the limit -- 2 of 3 confident detections is noise
("n=3 < 10: too few to judge"), 40 of 60 is a defect (upper bound 0.78 < 0.95). parity.json records
each rate's verdict (`artifacts.<name>.rates`) and the rule (`rate_rule`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from pfactory.metrics.cut import DEFAULT_SCORE_THRESHOLD
from pfactory.optimize.params import ParityParams, ParityTolerance

Outputs = dict[str, np.ndarray]
BOX_FIELDS = ("x", "y", "z", "l", "w", "h", "yaw")


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64).ravel()
    b = b.astype(np.float64).ravel()
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 and nb == 0.0:
        return 1.0  # both all-zero: identical
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


def match_detections(
    ref_boxes: np.ndarray,  # [K, 7]
    ref_scores: np.ndarray,  # [K]
    ref_labels: np.ndarray,  # [K]
    cand_boxes: np.ndarray,  # [K', 7]
    cand_scores: np.ndarray,  # [K']
    cand_labels: np.ndarray,  # [K']
    score_threshold: float,
    max_distance_m: float,
    boundary_atol: float = 0.0,
) -> tuple[list[tuple[int, int]], int, int]:
    """Greedy same-label nearest-centre matching of one frame: (pairs (ref i, cand j), #ref, #cand).

    Reference detections are those with score >= threshold, taken in descending score; any candidate
    entry may match (a reference at 0.051 whose candidate scores 0.049 is still the same detection), but
    #cand counts only candidates above the threshold.

    The top-K cut: when one side's K entries all score >= threshold, its list was cut by rank, not by the
    threshold, and which of two cells scoring alike within rounding makes the K-th place is rounding. An
    unmatched detection of the other side scoring within `boundary_atol` of that side's lowest score is such a
    near-tie at the cut (seen: an FP32 export of a barely trained model, every score of the K = 100 above 0.05,
    2 of 100 swapped at the cut by 1e-7): it is counted neither as missed nor as extra.
    """
    ref_idx = np.flatnonzero(ref_scores >= score_threshold)
    ref_idx = ref_idx[np.argsort(-ref_scores[ref_idx], kind="stable")]
    n_cand = int((cand_scores >= score_threshold).sum())
    if ref_idx.size == 0 or cand_boxes.shape[0] == 0:
        return [], int(ref_idx.size), n_cand
    d = np.linalg.norm(ref_boxes[ref_idx, None, :2] - cand_boxes[None, :, :2], axis=-1)  # [R, K']
    d = np.where(ref_labels[ref_idx, None] == cand_labels[None, :], d, np.inf)  # same label only
    taken = np.zeros(cand_boxes.shape[0], dtype=bool)
    pairs: list[tuple[int, int]] = []
    for row, i in enumerate(ref_idx):
        dist = np.where(taken, np.inf, d[row])  # [K']
        j = int(np.argmin(dist))
        if dist[j] <= max_distance_m:
            taken[j] = True
            pairs.append((int(i), j))
    n_ref = int(ref_idx.size)
    if boundary_atol > 0 and cand_scores.size and ref_scores.size:
        matched = np.zeros(ref_scores.shape[0], dtype=bool)
        matched[[i for i, _ in pairs]] = True
        if cand_scores.min() >= score_threshold:  # the candidate's list is full: cut by rank
            n_ref -= int(
                (~matched[ref_idx] & (ref_scores[ref_idx] <= cand_scores.min() + boundary_atol)).sum()
            )
        if ref_scores.min() >= score_threshold:  # the reference's list is full
            extra = ~taken & (cand_scores >= score_threshold)
            n_cand -= int((extra & (cand_scores <= ref_scores.min() + boundary_atol)).sum())
    return pairs, n_ref, n_cand


def _quantiles(x: list[float] | np.ndarray) -> dict[str, float | None]:
    """p50/p95/p99/max of `x` (linear interpolation); None for an empty sample."""
    a = np.asarray(x, dtype=np.float64)
    if a.size == 0:
        return {"p50": None, "p95": None, "p99": None, "max": None}
    p50, p95, p99 = (float(v) for v in np.quantile(a, [0.5, 0.95, 0.99]))
    return {"p50": p50, "p95": p95, "p99": p99, "max": float(a.max())}


HEADING_TURNED_RAD = 0.5
"""A matched detection whose |yaw diff| (wrapped) exceeds this (~29 degrees) has its heading turned."""


def detection_agreement(
    reference: Sequence[Outputs],
    candidate: Sequence[Outputs],
    score_threshold: float,
    match_distance_m: float,
) -> dict[str, Any]:
    """Agreement of confident detections: both sides cut at `score_threshold` (> 0).

    Out: {"score_threshold", "frames", "reference_detections", "candidate_detections", "matched",
    "match_rate" (matched / max(#ref, #cand): a missed or an extra confident detection both count),
    "scores_abs_diff" {p50, p95, p99, max} over matched pairs, "centre_distance_m" and "yaw_abs_diff" (rad,
    wrapped) likewise, "headings_kept" (matched pairs with |yaw diff| <= `HEADING_TURNED_RAD`) and
    "heading_agreement" (headings_kept / matched; 1.0 when nothing matched)}.
    Matching as `match_detections` (same label, BEV centre within `match_distance_m`), so two
    runtimes that swap the rank of near-tied peaks agree.
    """
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference batches vs {len(candidate)} candidate batches")
    n_ref = n_cand = n_matched = frames = 0
    sdiff: list[float] = []
    dist: list[float] = []
    ydiff: list[float] = []
    for r, c in zip(reference, candidate):
        for b in range(r["scores"].shape[0]):
            frames += 1
            rb, rs, rl = r["boxes"][b], r["scores"][b], r["labels"][b]
            cb, cs, cl = c["boxes"][b], c["scores"][b], c["labels"][b]
            pairs, nr, nc = match_detections(rb, rs, rl, cb, cs, cl, score_threshold, match_distance_m)
            n_ref += nr
            n_cand += nc
            n_matched += len(pairs)
            for i, j in pairs:
                sdiff.append(abs(float(cs[j]) - float(rs[i])))
                dist.append(float(np.hypot(*(cb[j, :2].astype(np.float64) - rb[i, :2]))))
                ydiff.append(abs(math.remainder(float(cb[j, 6]) - float(rb[i, 6]), 2 * math.pi)))
    kept = sum(d <= HEADING_TURNED_RAD for d in ydiff)
    return {
        "score_threshold": score_threshold,
        "frames": frames,
        "reference_detections": n_ref,
        "candidate_detections": n_cand,
        "matched": n_matched,
        "match_rate": 1.0 if max(n_ref, n_cand) == 0 else n_matched / max(n_ref, n_cand),
        "scores_abs_diff": _quantiles(sdiff),
        "centre_distance_m": _quantiles(dist),
        "yaw_abs_diff": _quantiles(ydiff),
        "headings_kept": kept,
        "heading_agreement": 1.0 if not ydiff else kept / len(ydiff),
    }


def _box_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a - b for [M, 7] boxes with the yaw difference wrapped to [-pi, pi]."""
    d = a.astype(np.float64) - b.astype(np.float64)
    d[:, 6] = (d[:, 6] + math.pi) % (2 * math.pi) - math.pi
    return d


def _ratio(diff: np.ndarray, ref: np.ndarray, atol: float | None, rtol: float | None) -> float | None:
    """max |diff| / (atol + rtol * |ref|): <= 1 means numpy-`allclose`; None when neither is set."""
    if atol is None and rtol is None:
        return None
    allowed = (atol or 0.0) + (rtol or 0.0) * np.abs(ref)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(diff == 0, 0.0, diff / allowed)  # 0/0 (exact match at zero tolerance) is fine
    return float(r.max()) if r.size else 0.0


def repeatability(first: Sequence[Outputs], second: Sequence[Outputs]) -> dict[str, Any]:
    """Index-aligned differences between two runs of the same runner on the same frames (0 = repeatable)."""
    boxes = scores = 0.0
    labels = 0
    for a, b in zip(first, second):
        boxes = max(boxes, float(np.abs(a["boxes"].astype(np.float64) - b["boxes"]).max(initial=0.0)))
        scores = max(scores, float(np.abs(a["scores"].astype(np.float64) - b["scores"]).max(initial=0.0)))
        labels += int((a["labels"] != b["labels"]).sum())
    return {"boxes_max_abs_diff": boxes, "scores_max_abs_diff": scores, "labels_mismatch": labels}


@dataclass
class _Tally:
    """What `compare_outputs` gathers frame by frame: the matched pairs' boxes and scores, the rank-sorted
    score vectors, label agreement, detection counts and the index-aligned worst differences."""

    ref_pairs: list[np.ndarray] = field(default_factory=list)
    cand_pairs: list[np.ndarray] = field(default_factory=list)
    ref_pair_scores: list[np.ndarray] = field(default_factory=list)
    cand_pair_scores: list[np.ndarray] = field(default_factory=list)
    ref_sorted: list[np.ndarray] = field(default_factory=list)
    cand_sorted: list[np.ndarray] = field(default_factory=list)
    label_agree: int = 0
    label_total: int = 0
    n_ref: int = 0
    n_cand: int = 0
    n_matched: int = 0
    frames: int = 0
    aligned_boxes: float = 0.0
    aligned_scores: float = 0.0


def compare_outputs(
    reference: Sequence[Outputs],
    candidate: Sequence[Outputs],
    params: ParityParams,
    tol: ParityTolerance | None = None,
    repeat: Sequence[Outputs] | None = None,
    score_threshold: float = DEFAULT_SCORE_THRESHOLD,
) -> dict[str, Any]:
    """Metrics of `candidate` vs `reference` (module docstring); both cover the same frames in order, their
    detections scoring >= `score_threshold` (`evaluate.score_threshold`) compared.

    With `tol`, also each element check's `tolerance_ratio` = max |diff| / (atol + rtol * |ref|), which
    `gate` compares with 1 (numpy `allclose` semantics). `repeat`: a second run of the candidate on the
    same frames -> `repeatability` (gated by `tol.repeat_atol`).
    """
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference batches vs {len(candidate)} candidate batches")
    t = tol or ParityTolerance()
    tally = _Tally()
    for r, c in zip(reference, candidate):
        for key in ("boxes", "scores", "labels"):
            if r[key].shape != c[key].shape:
                raise ValueError(f"output {key}: candidate shape {c[key].shape} != reference {r[key].shape}")
        for b in range(r["scores"].shape[0]):
            _tally_frame(tally, r, c, b, params, t, score_threshold)
    n_ref, n_cand, n_matched = tally.n_ref, tally.n_cand, tally.n_matched
    metrics: dict[str, Any] = {
        "frames": tally.frames,
        "reference_detections": n_ref,
        "candidate_detections": n_cand,
        "matched": n_matched,
        "match_rate": 1.0 if max(n_ref, n_cand) == 0 else n_matched / max(n_ref, n_cand),
        "labels": {
            "rank_agreement": 1.0 if tally.label_total == 0 else tally.label_agree / tally.label_total
        },
        "aligned": {"boxes_max_abs_diff": tally.aligned_boxes, "scores_max_abs_diff": tally.aligned_scores},
    }
    scores_cos = (
        _cosine(np.concatenate(tally.ref_sorted), np.concatenate(tally.cand_sorted))
        if tally.ref_sorted
        else 1.0
    )
    metrics["tolerance"] = t.model_dump()  # the atol/rtol the tolerance ratios below were computed with
    metrics["repeatability"] = repeatability(candidate, repeat) if repeat is not None else None
    metrics["agreement"] = detection_agreement(
        reference, candidate, params.agreement_score_threshold, params.match_distance_m
    )
    if n_matched:
        metrics.update(_matched_diffs(tally, params, t, scores_cos))
    else:
        metrics.update(_no_diffs(scores_cos))
    return metrics


def _tally_frame(
    tally: _Tally, r: Outputs, c: Outputs, b: int, params: ParityParams, t: ParityTolerance, score_threshold: float
) -> None:
    """Add frame `b` of the reference batch `r` and the candidate batch `c` to `tally`: matching with the
    scores' tolerance at the top-K cut as the near-tie margin (`match_detections`), the matched pairs, the
    rank-sorted scores, label agreement and the index-aligned diffs over reference detections."""
    tally.frames += 1
    rb, rs, rl = r["boxes"][b], r["scores"][b], r["labels"][b]
    cb, cs, cl = c["boxes"][b], c["scores"][b], c["labels"][b]
    floor = float(min(rs.min(initial=1.0), cs.min(initial=1.0)))  # scores' tolerance at the top-K cut
    tie = (t.scores_atol or 0.0) + (t.scores_rtol or 0.0) * floor
    pairs, nr, nc = match_detections(
        rb, rs, rl, cb, cs, cl, score_threshold, params.match_distance_m, tie
    )
    tally.n_ref += nr
    tally.n_cand += nc
    tally.n_matched += len(pairs)
    if pairs:
        i, j = (np.asarray(x) for x in zip(*pairs))
        tally.ref_pairs.append(rb[i])
        tally.cand_pairs.append(cb[j])
        tally.ref_pair_scores.append(rs[i])
        tally.cand_pair_scores.append(cs[j])
    tally.ref_sorted.append(np.sort(rs)[::-1])
    tally.cand_sorted.append(np.sort(cs)[::-1])
    valid = rs >= score_threshold
    tally.label_agree += int((rl[valid] == cl[valid]).sum())
    tally.label_total += int(valid.sum())
    # Index-aligned diffs over reference detections: informational (rank swaps inflate them).
    if valid.any():
        tally.aligned_boxes = max(tally.aligned_boxes, float(np.abs(_box_diff(cb[valid], rb[valid])).max()))
        tally.aligned_scores = max(
            tally.aligned_scores, float(np.abs(cs[valid].astype(np.float64) - rs[valid]).max())
        )


def _matched_diffs(
    tally: _Tally, params: ParityParams, t: ParityTolerance, scores_cos: float
) -> dict[str, dict[str, Any]]:
    """The "boxes", "yaw" and "scores" blocks over the matched pairs of `tally` (at least one)."""
    rb_all, cb_all = np.concatenate(tally.ref_pairs), np.concatenate(tally.cand_pairs)  # [M, 7]
    diff = np.abs(_box_diff(cb_all, rb_all))  # [M, 7]
    rel = diff / np.maximum(np.abs(rb_all.astype(np.float64)), params.boxes_rel_floor)  # [M, 7]
    rs_all = np.concatenate(tally.ref_pair_scores).astype(np.float64)  # [M]
    cs_all = np.concatenate(tally.cand_pair_scores).astype(np.float64)
    sdiff = np.abs(cs_all - rs_all)
    srel = sdiff / np.maximum(np.abs(rs_all), params.scores_rel_floor)
    return {
        "boxes": {
            "max_abs_diff": float(diff[:, :6].max()),
            "max_rel_diff": float(rel[:, :6].max()),
            "cosine": _cosine(rb_all[:, :6], cb_all[:, :6]),
            "max_abs_diff_per_field": {f: float(diff[:, k].max()) for k, f in enumerate(BOX_FIELDS)},
            "tolerance_ratio": _ratio(
                diff[:, :6], rb_all[:, :6].astype(np.float64), t.boxes_atol, t.boxes_rtol
            ),
        },
        "yaw": {
            "max_abs_diff": float(diff[:, 6].max()),
            "p99_abs_diff": float(np.percentile(diff[:, 6], 99)),
            "tolerance_ratio": _ratio(diff[:, 6], rb_all[:, 6].astype(np.float64), t.yaw_atol, None),
        },
        "scores": {
            "max_abs_diff": float(sdiff.max()),
            "max_rel_diff": float(srel.max()),
            "cosine": scores_cos,
            "tolerance_ratio": _ratio(sdiff, rs_all, t.scores_atol, t.scores_rtol),
        },
    }


def _no_diffs(scores_cos: float) -> dict[str, dict[str, Any]]:
    """The "boxes", "yaw" and "scores" blocks when nothing matched (or there was nothing to match): the
    diffs are undefined, reported as null; the match rate carries the verdict."""
    return {
        "boxes": {
            "max_abs_diff": None,
            "max_rel_diff": None,
            "cosine": None,
            "max_abs_diff_per_field": {},
            "tolerance_ratio": None,
        },
        "yaw": {"max_abs_diff": None, "p99_abs_diff": None, "tolerance_ratio": None},
        "scores": {
            "max_abs_diff": None,
            "max_rel_diff": None,
            "cosine": scores_cos,
            "tolerance_ratio": None,
        },
    }


def gate(
    metrics: dict[str, Any],
    tol: ParityTolerance,
    min_support: int | None = None,
    confidence: float | None = None,
) -> list[str]:
    """Failures of `metrics` (from `compare_outputs(..., tol)`) against `tol`; [] = passed.

    One line per failing check, naming the metric, its value and the limit, e.g.
    "scores: max |diff| / (atol 1e-05 + rtol 0.0001 * |ref|) = 1.3 > 1 (max |diff| 1.8e-05)". The rates
    (`min_agreement`, `min_match_rate`) are judged with their support (`rate_verdicts`; `min_support` /
    `confidence` None: ParityParams' defaults).
    """
    failures: list[str] = []
    elementwise = ("boxes_atol", "boxes_rtol", "yaw_atol", "scores_atol", "scores_rtol")
    used = metrics.get("tolerance", {})
    if any(used.get(k) != getattr(tol, k) for k in elementwise):
        raise ValueError("metrics were computed with another atol/rtol: pass the same tol to compare_outputs")

    def close(name: str, atol: float | None, rtol: float | None) -> None:
        if atol is None and rtol is None:
            return
        m = metrics[name]
        ratio = m.get("tolerance_ratio")
        if m["max_abs_diff"] is None or ratio is None:
            return  # nothing matched: the match rate decides
        if not ratio <= 1.0:  # NaN fails too
            failures.append(
                f"{name}: max |diff| / (atol {atol or 0:g} + rtol {rtol or 0:g} * |ref|) = {ratio:.3g} > 1 "
                f"(max |diff| {m['max_abs_diff']:.3g})"
            )

    def lower(name: str, value: float | None, limit: float | None) -> None:
        if limit is None or value is None:
            return
        if not value >= limit:
            failures.append(f"{name} = {value:.6g} < {limit:.6g}")

    rates = {r["name"]: r for r in rate_verdicts(metrics, tol, min_support, confidence)}
    agree = metrics.get("agreement")
    if agree is not None:
        th = agree["score_threshold"]
        failures += [
            r["text"] for name, r in rates.items() if name.startswith("agreement.") and not r["passed"]
        ]
        p99 = agree["scores_abs_diff"]["p99"]
        if tol.scores_p99_atol is not None and p99 is not None and not p99 <= tol.scores_p99_atol:
            failures.append(
                f"agreement.scores p99 |diff| (score >= {th:g}) = {p99:.4g} > {tol.scores_p99_atol:g} "
                f"(max {agree['scores_abs_diff']['max']:.3g} over {agree['matched']} matched)"
            )
    elif tol.min_agreement is not None or tol.scores_p99_atol is not None:
        raise ValueError("metrics have no 'agreement' block: computed by an older compare_outputs")
    close("boxes", tol.boxes_atol, tol.boxes_rtol)
    close("yaw", tol.yaw_atol, None)
    p99 = metrics["yaw"].get("p99_abs_diff")
    if tol.yaw_p99_atol is not None and p99 is not None and not p99 <= tol.yaw_p99_atol:
        failures.append(
            f"yaw: p99 |diff| = {p99:.3g} > {tol.yaw_p99_atol:g} rad (max |diff| {metrics['yaw']['max_abs_diff']:.3g}"
            f" over {metrics['matched']} matched)"
        )
    close("scores", tol.scores_atol, tol.scores_rtol)
    lower("scores.cosine", metrics["scores"]["cosine"], tol.min_cosine)
    lower("boxes.cosine", metrics["boxes"]["cosine"], tol.min_cosine)
    if "match_rate" in rates and not rates["match_rate"]["passed"]:
        failures.append(rates["match_rate"]["text"])
    rep = metrics.get("repeatability")
    if tol.repeat_atol is not None and rep is not None:
        worst = max(rep["boxes_max_abs_diff"], rep["scores_max_abs_diff"])
        if not worst <= tol.repeat_atol or rep["labels_mismatch"]:
            failures.append(
                f"repeatability: two runs on the same frames differ by {worst:.3g} (> {tol.repeat_atol:g}), "
                f"{rep['labels_mismatch']} labels -- a nondeterministic kernel"
            )
    return failures


def wilson_interval(k: int, n: int, confidence: float) -> tuple[float, float]:
    """Two-sided Wilson score interval (lower, upper) of a proportion k/n at `confidence` (e.g. 0.95);
    (0, 1) for n = 0. Unlike the normal approximation it stays inside [0, 1] and is honest at small n."""
    if n <= 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0)
    p = k / n
    den = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_rule(min_support: int, confidence: float) -> str:
    """The sentence parity.json and the docs state for every rate gate."""
    return (
        f"a rate k/n is judged only with n >= {min_support}; then refused only when the upper bound of its "
        f"two-sided {confidence:.0%} Wilson score interval is below the limit"
    )


def judge_rate(
    name: str, k: int, n: int, limit: float, min_support: int, confidence: float
) -> dict[str, Any]:
    """A rate gate with its support: {"name", "k", "n", "rate", "limit", "lower", "upper", "confidence",
    "min_support", "judged", "passed", "text"}. Not judged (passed, "too few to judge") when n < min_support;
    else passed unless the Wilson upper bound < limit. `text` is one line naming both figures."""
    rate = 1.0 if n == 0 else k / n
    lower, upper = wilson_interval(k, n, confidence)
    judged = n >= min_support
    passed = not judged or upper >= limit
    head = f"{name} = {k}/{n} = {rate:.4g}"
    if not judged:
        text = f"{head}, n={n} < {min_support}: too few to judge"
    else:
        verdict = ">=" if passed else "<"
        text = f"{head}: Wilson {confidence:.0%} upper bound {upper:.4g} {verdict} {limit:g} (n={n})"
    return {
        "name": name, "k": k, "n": n, "rate": rate, "limit": limit, "lower": lower, "upper": upper,
        "confidence": confidence, "min_support": min_support, "judged": judged, "passed": passed, "text": text,
    }  # fmt: skip


def rate_verdicts(
    metrics: dict[str, Any],
    tol: ParityTolerance,
    min_support: int | None = None,
    confidence: float | None = None,
) -> list[dict[str, Any]]:
    """`judge_rate` of each gated rate of `metrics` (the agreement match rate, the box-level match rate).
    `min_support` / `confidence` None: `ParityParams`' defaults."""
    fields = ParityParams.model_fields
    ms = int(fields["rate_min_support"].default if min_support is None else min_support)
    cf = float(fields["rate_confidence"].default if confidence is None else confidence)
    out = []
    agree = metrics.get("agreement")
    if agree is not None and tol.min_agreement is not None:
        n = max(int(agree["reference_detections"]), int(agree["candidate_detections"]))
        name = f"agreement.match_rate (score >= {agree['score_threshold']:g})"
        out.append(judge_rate(name, int(agree["matched"]), n, tol.min_agreement, ms, cf))
    if agree is not None and tol.min_heading_agreement is not None and "headings_kept" in agree:
        name = f"agreement.heading (|yaw diff| <= {HEADING_TURNED_RAD:g} rad, score >= {agree['score_threshold']:g})"
        kept, n = int(agree["headings_kept"]), int(agree["matched"])
        out.append(judge_rate(name, kept, n, tol.min_heading_agreement, ms, cf))
    if tol.min_match_rate is not None:
        n = max(int(metrics["reference_detections"]), int(metrics["candidate_detections"]))
        out.append(judge_rate("match_rate", int(metrics["matched"]), n, tol.min_match_rate, ms, cf))
    return out


def tolerance_for(params: ParityParams, precision: str) -> ParityTolerance:
    """The gate of a precision ("fp32" | "fp16" | "int8")."""
    return getattr(params, precision)


def parity_report(
    results: dict[str, dict[str, Any]],
    params: ParityParams,
    frame_ids: Sequence[str],
    reference: str,
    score_threshold: float = DEFAULT_SCORE_THRESHOLD,
) -> dict[str, Any]:
    """`parity.json`: per artifact (`"<backend>/<precision>"`) its metrics, gate and failures; the detection
    cut the comparison used (`score_threshold`, `evaluate.score_threshold`) recorded.

    `results[name]` = {"precision": str, "metrics": compare_outputs(...)}.
    """
    artifacts: dict[str, Any] = {}
    support = (params.rate_min_support, params.rate_confidence)
    for name, r in results.items():
        tol = tolerance_for(params, r["precision"])
        failures = gate(r["metrics"], tol, *support)
        artifacts[name] = {
            "precision": r["precision"],
            "metrics": r["metrics"],
            "tolerance": tol.model_dump(),
            "rates": rate_verdicts(r["metrics"], tol, *support),
            "failures": failures,
            "passed": not failures,
        }
    return {
        "reference": reference,
        "split": params.split,
        "frames": len(frame_ids),
        "frame_ids": list(frame_ids),
        "score_threshold": score_threshold,
        "agreement_score_threshold": params.agreement_score_threshold,
        "match_distance_m": params.match_distance_m,
        "boxes_rel_floor": params.boxes_rel_floor,
        "scores_rel_floor": params.scores_rel_floor,
        "rate_rule": rate_rule(*support),
        "artifacts": artifacts,
        "passed": all(a["passed"] for a in artifacts.values()),
    }


def report_failures(report: dict[str, Any]) -> list[str]:
    """ "<artifact>: <failure>" lines of a parity report (empty when it passed)."""
    return [f"{name}: {f}" for name, a in report["artifacts"].items() for f in a["failures"]]
