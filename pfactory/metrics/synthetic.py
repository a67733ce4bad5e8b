"""Random but detector-like ground truth and predictions, for KPI tests and benchmarks.

In:  a frame count, mean boxes per frame, a seed. Out: `(gt_frames, pred_frames)`, two lists
of `FrameDetections` with the same frame ids. Deterministic for a given seed.

Predictions are a noisy copy of most GT boxes (centre jitter that straddles the 0.5-4 m
thresholds, size and yaw noise, some heading flips, some class confusions) plus false positives,
some of them near a GT box, so every branch of the matching is exercised. `score_decimals`
rounds scores to create many ties.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pfactory.metrics.detection import FrameDetections

# Rough mean sizes (l, w, h) in metres for the default classes; other classes get car-ish boxes.
_SIZE_LWH = {"Car": (4.5, 1.9, 1.6), "Pedestrian": (0.8, 0.7, 1.75), "Cyclist": (1.8, 0.6, 1.7)}


def random_detections(
    n_frames: int,
    gt_per_frame: float = 40.0,
    pred_per_frame: float = 100.0,
    classes: Sequence[str] = ("Car", "Pedestrian", "Cyclist"),
    seed: int = 0,
    score_decimals: int | None = None,
    extent_m: float = 60.0,
    recall: float = 0.75,
) -> tuple[list[FrameDetections], list[FrameDetections]]:
    """`n_frames` frames with ~Poisson(`gt_per_frame`) GT and ~`pred_per_frame` predictions each."""
    rng = np.random.default_rng(seed)
    classes = list(classes)
    probs = np.linspace(2.0, 1.0, len(classes))
    probs /= probs.sum()  # the first class is the most frequent, as cars are
    size_lwh = np.array([_SIZE_LWH.get(c, _SIZE_LWH["Car"]) for c in classes])  # [C, 3]
    gts, preds = [], []
    for f in range(n_frames):
        fid = f"{f:06d}"
        m = int(rng.poisson(gt_per_frame))
        cls = rng.choice(len(classes), size=m, p=probs)  # [M]
        gt = np.empty((m, 7))
        gt[:, :2] = rng.uniform(-extent_m, extent_m, size=(m, 2))
        gt[:, 2] = rng.normal(0.0, 0.5, size=m)
        gt[:, 3:6] = size_lwh[cls] * rng.lognormal(0.0, 0.1, size=(m, 3))
        gt[:, 6] = rng.uniform(-np.pi, np.pi, size=m)
        gts.append(FrameDetections(fid, gt, np.array(classes)[cls]))

        # True-positive-like copies of detected GT boxes.
        det = rng.random(m) < recall
        k = int(det.sum())
        tp = gt[det].copy()
        tp[:, :2] += rng.normal(0.0, 1.0, size=(k, 2)) * rng.choice([0.1, 0.4, 1.5], size=(k, 1))
        tp[:, 3:6] *= rng.lognormal(0.0, 0.15, size=(k, 3))
        tp[:, 6] += rng.normal(0.0, 0.2, size=k) + np.pi * (rng.random(k) < 0.05)  # a few flips
        tp_cls = cls[det].copy()
        confuse = rng.random(k) < 0.05
        tp_cls[confuse] = rng.choice(len(classes), size=int(confuse.sum()))
        tp_score = rng.beta(5, 2, size=k)

        # False positives: half anywhere, half within a few metres of some GT box.
        n_fp = max(0, int(rng.poisson(max(pred_per_frame - k, 0.0))))
        fp = np.empty((n_fp, 7))
        fp[:, :2] = rng.uniform(-extent_m, extent_m, size=(n_fp, 2))
        near = (rng.random(n_fp) < 0.5) & (m > 0)
        if m > 0:
            anchor = rng.integers(0, m, size=n_fp)
            fp[near, :2] = gt[anchor[near], :2] + rng.normal(0.0, 2.0, size=(int(near.sum()), 2))
        fp_cls = rng.choice(len(classes), size=n_fp, p=probs)
        fp[:, 2] = rng.normal(0.0, 0.5, size=n_fp)
        fp[:, 3:6] = size_lwh[fp_cls] * rng.lognormal(0.0, 0.2, size=(n_fp, 3))
        fp[:, 6] = rng.uniform(-np.pi, np.pi, size=n_fp)
        fp_score = rng.beta(2, 5, size=n_fp)

        boxes = np.concatenate([tp, fp])
        names = np.array(classes)[np.concatenate([tp_cls, fp_cls]).astype(np.int64)]
        scores = np.concatenate([tp_score, fp_score])
        if score_decimals is not None:
            scores = np.round(scores, score_decimals)
        perm = rng.permutation(len(boxes))
        preds.append(FrameDetections(fid, boxes[perm], names[perm], scores[perm]))
    return gts, preds
