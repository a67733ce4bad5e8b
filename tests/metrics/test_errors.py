"""The error breakdown (`pfactory.metrics.errors`): planted cases of every label and of `dap`, a loop
reference written from the definitions on random scenes, and `dap` against the devkit-equivalent AP of
detections fixed by hand."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest

from pfactory.metrics.detection import FrameDetections, KpiParams, evaluate_detections
from pfactory.metrics.errors import DAP_KEYS, LABELS
from pfactory.metrics.synthetic import random_detections

CAR, PED = "Car", "Pedestrian"
PARAMS = KpiParams(classes=(CAR, PED), range_buckets_m=((0.0, 100.0), (100.0, math.inf)))


def box(x: float, y: float = 0.0, yaw: float = 0.0, lwh: tuple = (4.0, 2.0, 1.5)) -> list[float]:
    return [x, y, 0.0, *lwh, yaw]


def planted() -> tuple[FrameDetections, FrameDetections, list[str | None]]:
    """One frame, one detection of every label (module docstring of pfactory.metrics.errors)."""
    gt = FrameDetections(
        "f0",
        [box(10), box(30), box(50), box(70), box(90), box(110), box(130, 10)],
        [CAR, CAR, PED, CAR, CAR, PED, CAR],
    )
    dets = [  # (box, class, score, expected label)
        (box(10.5), CAR, 0.9, "tp"),  # GT 0
        (box(11.0), CAR, 0.8, "duplicate"),  # GT 0 again, 1 m
        (box(50.5), CAR, 0.7, "classification"),  # 0.5 m from the pedestrian GT 2, no car near
        (box(33.0), CAR, 0.6, "localization"),  # 3 m from the unmatched car GT 1
        (box(113.0), CAR, 0.5, "both"),  # 3 m from the pedestrian GT 5 only
        (box(200.0), CAR, 0.45, "background"),  # 70 m from everything
        (box(90.2, yaw=math.pi), CAR, 0.4, "tp"),  # GT 4, facing backwards: a heading flip
        (box(130.0, 12.5), CAR, 0.35, "localization"),  # 2.5 m from car GT 6, nearest first
        (box(129.0, 10.0), CAR, 0.32, "tp"),  # GT 6 at 1 m (taken before by nobody: 0.35 was 2.5 m off)
        (box(150.0), CAR, 0.1, None),  # below frame_score_threshold: not labelled
    ]
    pred = FrameDetections("f0", [d[0] for d in dets], [d[1] for d in dets], [d[2] for d in dets])
    return gt, pred, [d[3] for d in dets]


def test_every_label_planted() -> None:
    gt, pred, expected = planted()
    kpis = evaluate_detections([gt], [pred], PARAMS)
    car = kpis.metrics["errors"][CAR]
    assert {k: car[k] for k in (*LABELS, "missed", "heading_flip", "num_det", "num_gt")} == {
        "tp": 3, "duplicate": 1, "classification": 1, "localization": 2, "both": 1, "background": 1,
        "missed": 2, "heading_flip": 1, "num_det": 9, "num_gt": 5,
    }  # fmt: skip
    # GT 3 (nobody near) and GT 1 (only the localization error near it) are missed.
    ped = kpis.metrics["errors"][PED]
    assert ped["num_det"] == 0 and ped["missed"] == 2 and ped["tp"] == 0
    frame = kpis.errors.frame("f0")
    assert frame["pred"] == {i: lbl for i, lbl in enumerate(expected) if lbl is not None}
    assert frame["heading_flip"] == [6]
    assert frame["missed"] == [1, 2, 3, 5]  # GT box indices in the frame (cars 1, 3; pedestrians 2, 5)
    # Per range bucket: the same breakdown on the boxes inside the bucket.
    near = kpis.metrics["by_range"]["0-100"]["errors"][CAR]
    far = kpis.metrics["by_range"]["100+"]["errors"][CAR]
    assert (near["tp"], near["duplicate"], near["classification"], near["localization"]) == (2, 1, 1, 1)
    assert (far["tp"], far["both"], far["background"], far["localization"]) == (1, 1, 1, 1)
    assert near["missed"] + far["missed"] == 2


def test_thresholds_are_inclusive_and_configurable() -> None:
    gt = FrameDetections("f", [box(0.0, 10.0), box(0.0, 40.0)], [CAR, PED])
    pred = FrameDetections(
        "f",
        [box(2.0, 10.0), box(4.0, 40.0), box(0.0, 44.0 + 1e-9)],
        [CAR, CAR, CAR],
        [0.9, 0.8, 0.7],
    )
    labels = evaluate_detections([gt], [pred], PARAMS).errors.frame("f")["pred"]
    assert labels == {0: "tp", 1: "both", 2: "background"}  # d = 2 is tp, d = 4 is "both", 4 + 1e-9 is not
    wide = KpiParams(classes=(CAR, PED), error_bg_dist_m=5.0, frame_score_threshold=0.75)
    labels = evaluate_detections([gt], [pred], wide).errors.frame("f")["pred"]
    assert labels == {0: "tp", 1: "both"}  # 0.7 is below the threshold
    with pytest.raises(ValueError, match="error_bg_dist_m"):
        KpiParams(error_bg_dist_m=1.0)


def test_dap_planted_by_hand() -> None:
    """Two cars, one found twice: AP by the devkit's definition (101 recall points, the min-recall
    point excluded, a repeated recall takes the last precision, (p - 0.1) / 0.9 averaged over 90 points)."""
    gt = FrameDetections("f", [box(0), box(20)], [CAR, CAR])
    pred = FrameDetections("f", [box(0.5), box(1.0)], [CAR, CAR], [0.9, 0.8])
    car = evaluate_detections([gt], [pred], PARAMS).metrics["errors"][CAR]
    assert (car["tp"], car["duplicate"], car["missed"]) == (1, 1, 1)
    # As it is: recall 0.5 at precision 1 then 0.5 -> points 11..49 at 1, point 50 at (0.5 - 0.1) / 0.9.
    base = (39 + 0.4 / 0.9) / 90
    assert car["ap"] == pytest.approx(base, abs=1e-12)
    # Without the duplicate: points 11..50 at 1.
    assert car["dap"]["duplicate"] == pytest.approx(40 / 90 - base, abs=1e-12)
    # Without the missed car: recall 1 at precision 1, then 0.5 at recall 1 -> 89 points at 1, one at 0.4/0.9.
    assert car["dap"]["missed"] == pytest.approx((89 + 0.4 / 0.9) / 90 - base, abs=1e-12)
    for k in ("classification", "localization", "both", "background"):
        assert car["dap"][k] == 0.0


def test_dap_planted_fixes_claim_free_ground_truth_once() -> None:
    """Two localization errors on one free car: the higher score becomes its tp, the other is removed;
    a classification error on a free pedestrian moves to the pedestrians' AP; one on a found pedestrian is removed."""
    gt = FrameDetections("f", [box(0), box(30), box(60)], [CAR, PED, PED])
    pred = FrameDetections(
        "f",
        [box(3.0), box(-3.5), box(30.5), box(60.3), box(60.2)],
        [CAR, CAR, CAR, PED, CAR],
        [0.9, 0.8, 0.7, 0.6, 0.5],
    )
    kpis = evaluate_detections([gt], [pred], PARAMS)
    assert kpis.errors.frame("f")["pred"] == {
        0: "localization", 1: "localization", 2: "classification", 3: "tp", 4: "classification",
    }  # fmt: skip
    e = kpis.metrics["errors"]
    # Fixed by hand: car 0 -> tp on GT 0, car 1 removed; pedestrians unchanged.
    fixed_loc = FrameDetections(
        "f", [box(0.0), box(30.5), box(60.3), box(60.2)], [CAR, CAR, PED, CAR], [0.9, 0.7, 0.6, 0.5]
    )
    # Fixed by hand: det 2 becomes a pedestrian on GT 1, det 4 (GT 2 already found) removed.
    fixed_cls = FrameDetections(
        "f", [box(3.0), box(-3.5), box(30.0), box(60.3)], [CAR, CAR, PED, PED], [0.9, 0.8, 0.7, 0.6]
    )
    for name, fixed in (("localization", fixed_loc), ("classification", fixed_cls)):
        after = evaluate_detections([gt], [fixed], PARAMS).metrics["classes"]
        for c in (CAR, PED):
            assert e[c]["dap"][name] == pytest.approx(after[c]["ap"]["2.0"] - e[c]["ap"], abs=1e-12), (
                name,
                c,
            )
    assert e[PED]["dap"]["classification"] > 0  # the pedestrian found by the fix
    assert e[CAR]["dap"]["localization"] > 0


# ---------------------------------------------------------------------------------------------
# A loop reference, written from the definitions (issue 18 / the module docstring)
# ---------------------------------------------------------------------------------------------


def _dist(a: np.ndarray, b: np.ndarray) -> float:
    dx, dy = float(b[0] - a[0]), float(b[1] - a[1])
    return math.sqrt(dx * dx + dy * dy)


def reference_labels(
    gts: Sequence[FrameDetections], preds: Sequence[FrameDetections], params: KpiParams
) -> tuple[dict, dict, dict, dict]:
    """labels {(frame, box): label}, targets {(frame, box): GT box}, flips {(frame, box)}, missed {(frame, gt box)}."""
    d_fg, d_bg = params.dist_th_tp_m, params.error_bg_dist_m
    by_id = {f.frame_id: f for f in preds}
    labels, targets, flips, missed = {}, {}, set(), set()
    for g in gts:
        p = by_id.get(g.frame_id)
        gi = [i for i in range(len(g.boxes)) if g.names[i] in params.classes]
        di = [] if p is None else [i for i in range(len(p.boxes)) if p.names[i] in params.classes]
        di = [i for i in di if p.scores[i] >= params.frame_score_threshold]
        matched: set[int] = set()
        for c in params.classes:
            order = sorted((i for i in di if p.names[i] == c), key=lambda i: (-p.scores[i], -i))
            for i in order:
                best, best_d = None, math.inf
                for j in gi:
                    if g.names[j] == c and j not in matched and _dist(p.boxes[i], g.boxes[j]) < best_d:
                        best, best_d = j, _dist(p.boxes[i], g.boxes[j])
                if best is not None and best_d <= d_fg:
                    matched.add(best)
                    labels[g.frame_id, i], targets[g.frame_id, i] = "tp", best
                    diff = abs((g.boxes[best, 6] - p.boxes[i, 6] + math.pi) % (2 * math.pi) - math.pi)
                    if diff > math.pi / 2:
                        flips.add((g.frame_id, i))
        for i in di:
            if (g.frame_id, i) in labels:
                continue
            same = [(_dist(p.boxes[i], g.boxes[j]), j) for j in gi if g.names[j] == p.names[i]]
            other = [(_dist(p.boxes[i], g.boxes[j]), j) for j in gi if g.names[j] != p.names[i]]
            free = [(d, j) for d, j in same if j not in matched and d <= d_bg]
            if any(d <= d_fg for d, _ in same):
                lbl, tgt = "duplicate", min(same)[1]
            elif any(d <= d_fg for d, _ in other):
                lbl, tgt = "classification", min(other)[1]
            elif any(d <= d_bg for d, _ in same):
                lbl, tgt = "localization", (min(free) if free else min(same))[1]
            elif any(d <= d_bg for d, _ in other):
                lbl, tgt = "both", min(other)[1]
            else:
                lbl, tgt = "background", None
            labels[g.frame_id, i], targets[g.frame_id, i] = lbl, tgt
        missed |= {(g.frame_id, j) for j in gi if j not in matched}
    return labels, targets, flips, missed


def fixed_by_hand(gts, preds, params, kind, labels, targets, missed):
    """The inputs after TIDE's fix of every `kind` error (detections below the threshold dropped)."""
    thr = params.frame_score_threshold
    gt_by = {g.frame_id: g for g in gts}
    out_g, out_p = [], []
    for g in gts:
        keep = [j for j in range(len(g.boxes)) if not (kind == "missed" and (g.frame_id, j) in missed)]
        out_g.append(FrameDetections(g.frame_id, g.boxes[keep], g.names[keep]))
    for p in preds:
        g = gt_by[p.frame_id]
        found = {targets[k] for k, v in labels.items() if k[0] == p.frame_id and v == "tp"}
        order = sorted(range(len(p.boxes)), key=lambda i: (-p.scores[i], -i))
        boxes, names, scores, rank = [], [], [], []
        for i in order:
            if p.scores[i] < thr or p.names[i] not in params.classes:
                continue
            b, n, lbl = p.boxes[i].copy(), str(p.names[i]), labels[p.frame_id, i]
            if lbl == kind and kind in ("duplicate", "both", "background"):
                continue
            if lbl == kind and kind in ("localization", "classification"):
                t = targets[p.frame_id, i]
                if t in found:
                    continue  # its GT is taken: the fix removes it
                found.add(t)
                b[:2] = g.boxes[t, :2]
                n = str(g.names[t])
            boxes.append(b)
            names.append(n)
            scores.append(p.scores[i])
            rank.append(i)
        back = np.argsort(rank, kind="stable")  # input order again (it breaks score ties)
        out_p.append(
            FrameDetections(
                p.frame_id,
                np.array(boxes).reshape(-1, 7)[back],
                np.array(names)[back],
                np.array(scores)[back],
            )
        )
    return out_g, out_p


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_loop_reference_and_hand_fixed_ap(seed: int) -> None:
    gts, preds = random_detections(n_frames=25, gt_per_frame=12, pred_per_frame=30, seed=seed)
    params = KpiParams(frame_score_threshold=(0.0, 0.3, 0.5)[seed], range_buckets_m=())
    kpis = evaluate_detections(gts, preds, params)
    labels, targets, flips, missed = reference_labels(gts, preds, params)
    got = {}
    for g in gts:
        fr = kpis.errors.frame(g.frame_id)
        got.update({(g.frame_id, i): lbl for i, lbl in fr["pred"].items()})
        assert {(g.frame_id, i) for i in fr["heading_flip"]} == {k for k in flips if k[0] == g.frame_id}
        assert {(g.frame_id, j) for j in fr["missed"]} == {k for k in missed if k[0] == g.frame_id}
    assert got == labels
    assert len(set(labels.values())) == len(LABELS)  # every label occurs

    for c in params.classes:
        e = kpis.metrics["errors"][c]
        n = {
            lbl: sum(1 for (f, i), v in labels.items() if v == lbl and _name(preds, f, i) == c)
            for lbl in LABELS
        }
        assert {lbl: e[lbl] for lbl in LABELS} == n
        assert e["tp"] + e["missed"] == e["num_gt"]
    base = {c: kpis.metrics["errors"][c]["ap"] for c in params.classes}
    if params.frame_score_threshold == 0.0:  # all detections: the breakdown's AP is the KPI's AP at d_fg
        for c in params.classes:
            assert base[c] == kpis.metrics["classes"][c]["ap"]["2.0"]
    for kind in DAP_KEYS:
        g2, p2 = fixed_by_hand(gts, preds, params, kind, labels, targets, missed)
        after = evaluate_detections(g2, p2, params).metrics["classes"]
        for c in params.classes:
            want = after[c]["ap"]["2.0"] - base[c]
            assert kpis.metrics["errors"][c]["dap"][kind] == pytest.approx(want, abs=1e-12), (kind, c)


def _name(preds: Sequence[FrameDetections], frame_id: str, i: int) -> str:
    return str(next(p for p in preds if p.frame_id == frame_id).names[i])


def test_empty_inputs() -> None:
    gt = FrameDetections("a", np.zeros((0, 7)), [])
    pred = FrameDetections("a", [box(1)], [CAR], [0.9])
    e = evaluate_detections([gt], [pred], PARAMS).metrics["errors"][CAR]
    assert e["background"] == 1 and e["ap"] == 0.0 and all(v == 0.0 for v in e["dap"].values())
    e = evaluate_detections([FrameDetections("a", [box(1)], [CAR])], [], PARAMS).metrics["errors"][CAR]
    assert e["missed"] == 1 and e["num_det"] == 0 and e["dap"]["missed"] == 0.0


def test_standalone_matching_equals_the_shared_one() -> None:
    """`error_breakdown` without the KPI pass's matches computes them itself: the same labels."""
    from pfactory.metrics.errors import error_breakdown
    from pfactory.metrics.matching import flatten_frames

    gts, preds = random_detections(n_frames=20, gt_per_frame=10, pred_per_frame=25, seed=4)
    params = KpiParams(frame_score_threshold=0.2)
    g = flatten_frames(gts, params.classes, is_pred=False)
    p = flatten_frames(preds, params.classes, is_pred=True, frame_index=g.frame_index)
    alone = error_breakdown(g, p, params)
    shared = evaluate_detections(gts, preds, params)
    assert alone.summary == shared.metrics["errors"]
    assert np.array_equal(alone.label, shared.errors.label)
