"""The matching core (pfactory.metrics.matching) against loops written from the devkit's algorithm."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pfactory.metrics.matching import (
    ap_from_precision,
    ap_of_list,
    flatten_frames,
    greedy_match,
    interp_precision,
)
from pfactory.metrics.synthetic import random_detections


def loop_match(gt_frame, gt_xy, pred_frame, pred_xy, score, th):
    """nuscenes-devkit accumulate's loop: predictions by (score, index) descending, each takes the nearest
    untaken GT of its frame (first on a tie) when strictly closer than th."""
    order = [i for _, i in sorted((s, i) for i, s in enumerate(score))][::-1]
    taken, matched = set(), [-1] * len(score)
    for i in order:
        best, best_d = None, math.inf
        for j in range(len(gt_frame)):
            if gt_frame[j] != pred_frame[i] or j in taken:
                continue
            d = math.sqrt((gt_xy[j, 0] - pred_xy[i, 0]) ** 2 + (gt_xy[j, 1] - pred_xy[i, 1]) ** 2)
            if d < best_d:
                best, best_d = j, d
        if best is not None and best_d < th:
            taken.add(best)
            matched[i] = best
    return order, matched


@pytest.mark.parametrize("decimals", [None, 1, 0])
def test_greedy_match_equals_the_devkit_loop(decimals) -> None:
    gts, preds = random_detections(
        n_frames=15, gt_per_frame=8, pred_per_frame=20, seed=3, score_decimals=decimals
    )
    g = flatten_frames(gts, ("Car",), is_pred=False)
    p = flatten_frames(preds, ("Car",), is_pred=True, frame_index=g.frame_index)
    ths = (0.5, 1.0, 2.0, 4.0)
    order, matched = greedy_match(g.frame, g.boxes[:, :2], p.frame, p.boxes[:, :2], p.score, ths)
    for t, th in enumerate(ths):
        ref_order, ref = loop_match(g.frame, g.boxes[:, :2], p.frame, p.boxes[:, :2], p.score, th)
        assert order.tolist() == ref_order
        assert matched[t].tolist() == ref, th


def test_flatten_keeps_each_boxs_index_in_its_frame() -> None:
    gts, _ = random_detections(n_frames=4, gt_per_frame=5, seed=1)
    flat = flatten_frames(gts, ("Pedestrian",), is_pred=False)
    for f, b in zip(flat.frame, flat.box):
        frame = gts[int(f)]
        assert frame.names[b] == "Pedestrian"
    assert len(flat.box) == sum(int((f.names == "Pedestrian").sum()) for f in gts)


def test_ap_from_flags() -> None:
    # One TP of two GT, then an FP: precision 1 up to recall 0.5, then 0.5 at recall 0.5 (np.interp's last).
    prec = interp_precision(np.array([True, False]), 2)
    assert prec[:50].tolist() == [1.0] * 50 and prec[50] == 0.5 and prec[51:].max() == 0.0
    assert ap_from_precision(prec, 0.1, 0.1) == pytest.approx((39 + 0.4 / 0.9) / 90, abs=1e-12)
    assert (
        ap_of_list(np.array([False, False]), 3, 0.1, 0.1) == 0.0
        and ap_of_list(np.array([True]), 0, 0.1, 0.1) == 0.0
    )
