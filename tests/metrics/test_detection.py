"""Detection KPIs on hand-computed cases, the output layout, and input validation.

Agreement with nuscenes-devkit on random and adversarial scenes is in test_devkit_agreement.py.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pfactory.metrics.detection import FrameDetections, KpiParams, evaluate_detections
from pfactory.metrics.synthetic import random_detections

LWH = (4.0, 2.0, 1.5)


def box(x: float, y: float, yaw: float = 0.0, lwh: tuple[float, float, float] = LWH) -> list[float]:
    return [x, y, 0.5, *lwh, yaw]


def gt_frame(fid: str, boxes: list[list[float]], names: list[str] | str = "Car") -> FrameDetections:
    names = [names] * len(boxes) if isinstance(names, str) else names
    return FrameDetections(fid, np.array(boxes).reshape(-1, 7), names)


def pred_frame(
    fid: str, boxes: list[list[float]], scores: list[float], names: list[str] | str = "Car"
) -> FrameDetections:
    names = [names] * len(boxes) if isinstance(names, str) else names
    return FrameDetections(fid, np.array(boxes).reshape(-1, 7), names, np.array(scores))


CAR_ONLY = KpiParams(classes=("Car",), range_buckets_m=())


def test_perfect_predictions() -> None:
    gts, _ = random_detections(n_frames=8, gt_per_frame=10, seed=1)
    preds = [FrameDetections(g.frame_id, g.boxes, g.names, np.linspace(1.0, 0.5, len(g.boxes))) for g in gts]
    m = evaluate_detections(gts, preds).metrics
    for c in m["classes"].values():
        # mean(1 - 0.1) / (1 - 0.1) is 1.0000000000000004 in floats, in the devkit too
        assert c["ap"] == pytest.approx({"0.5": 1.0, "1.0": 1.0, "2.0": 1.0, "4.0": 1.0}, abs=1e-12)
        assert (c["ate"], c["ase"], c["aoe"]) == (0.0, 0.0, 0.0)
    assert m["mAP"] == pytest.approx(1.0, abs=1e-12) and m["NDS"] == pytest.approx(1.0, abs=1e-12)


def test_half_recall() -> None:
    # 2 GT, 1 exact prediction: precision 1 up to recall 0.5, 0 after (right=0). AP counts the
    # 90 recall points 0.11..1.00, of which 0.11..0.50 (40) have precision 1: (40 * 0.9) / 90 / 0.9.
    m = evaluate_detections(
        [gt_frame("a", [box(5, 0), box(15, 0)])], [pred_frame("a", [box(5, 0)], [0.9])], CAR_ONLY
    ).metrics
    assert m["classes"]["Car"]["ap"]["2.0"] == pytest.approx(40 / 90, abs=1e-12)


def test_false_positive_first_interpolates_linearly() -> None:
    # FP (0.9) then TP (0.8): (recall, precision) = (0, 0), (1, 0.5); np.interp gives
    # precision 0.5 r. AP = sum_{i=21..100} (0.005 i - 0.1) / 90 / 0.9 = 16.2 / 81 = 0.2.
    m = evaluate_detections(
        [gt_frame("a", [box(5, 0)])], [pred_frame("a", [box(30, 0), box(5, 0)], [0.9, 0.8])], CAR_ONLY
    ).metrics
    assert m["classes"]["Car"]["ap"]["1.0"] == pytest.approx(0.2, abs=1e-12)


def test_distance_thresholds_and_tp_errors() -> None:
    # 1.5 m off, twice as long, heading flipped + 0.1 rad: a match at 2 and 4 m only;
    # ATE 1.5, ASE 1 - (4*2*1.5) / (8*2*1.5) = 0.5, AOE pi - 0.1.
    gts = [gt_frame("a", [box(10, 0, yaw=0.3)])]
    preds = [pred_frame("a", [box(10, 1.5, yaw=0.3 + math.pi + 0.1, lwh=(8.0, 2.0, 1.5))], [0.7])]
    c = evaluate_detections(gts, preds, CAR_ONLY).metrics["classes"]["Car"]
    assert c["ap"] == pytest.approx({"0.5": 0.0, "1.0": 0.0, "2.0": 1.0, "4.0": 1.0}, abs=1e-12)
    assert c["ate"] == pytest.approx(1.5)
    assert c["ase"] == pytest.approx(0.5)
    assert c["aoe"] == pytest.approx(math.pi - 0.1)
    half = KpiParams(classes=("Car",), range_buckets_m=(), half_turn_classes=("Car",))
    assert evaluate_detections(gts, preds, half).metrics["classes"]["Car"]["aoe"] == pytest.approx(0.1)


def test_exactly_on_threshold_is_not_a_match() -> None:
    c = evaluate_detections(
        [gt_frame("a", [box(10, 0)])], [pred_frame("a", [box(12, 0)], [0.5])], CAR_ONLY
    ).metrics["classes"]["Car"]
    assert c["ap"]["2.0"] == 0.0 and c["ap"]["4.0"] == pytest.approx(1.0, abs=1e-12)


def test_greedy_by_score_not_by_distance() -> None:
    # GT at 0 and 3 m. The 0.9 prediction at 1.4 m takes the GT at 0 (1.4 < 1.6) although the
    # 0.8 prediction sits 0.1 m from it; the 0.8 one is left with the GT 2.9 m away: FP at 2 m.
    gts = [gt_frame("a", [box(0, 0), box(3, 0)])]
    preds = [pred_frame("a", [box(1.4, 0), box(0.1, 0)], [0.9, 0.8])]
    kpis = evaluate_detections(gts, preds, CAR_ONLY)
    curve = kpis.curves["Car"][2.0]
    assert (curve.precision[:50] == 1.0).all() and (curve.precision[51:] == 0.0).all()  # recall stops at 1/2
    assert kpis.metrics["classes"]["Car"]["ap"]["4.0"] == pytest.approx(1.0, abs=1e-12)


def test_no_gt_and_no_predictions() -> None:
    gts = [gt_frame("a", [box(5, 0)], "Car")]
    preds = [pred_frame("a", [box(5, 0), box(9, 9)], [0.9, 0.9], ["Car", "Pedestrian"])]
    m = evaluate_detections(gts, preds, KpiParams(range_buckets_m=())).metrics
    assert m["classes"]["Car"]["mean_ap"] == pytest.approx(1.0, abs=1e-12)
    for name in ("Pedestrian", "Cyclist"):  # no GT: the devkit's "no predictions" (AP 0, errors 1)
        c = m["classes"][name]
        assert c["mean_ap"] == 0.0 and (c["ate"], c["ase"], c["aoe"]) == (1.0, 1.0, 1.0)
    assert m["mAP"] == pytest.approx(1 / 3)
    # NDS* = (5 mAP + sum over ATE/ASE/AOE of max(0, 1 - class-mean error)) / 8
    assert m["NDS"] == pytest.approx((5 / 3 + 3 * (1 - 2 / 3)) / 8)
    empty = evaluate_detections(gts, [], CAR_ONLY).metrics
    assert empty["mAP"] == 0.0 and empty["classes"]["Car"]["ate"] == 1.0


def test_range_buckets_filter_both_sides() -> None:
    # GT at 19.8 m, its prediction at 20.3 m: in "0-20" the GT is missed, in "20-40" the
    # prediction is a false positive; the 30 m pair is a TP in "20-40"; overall both are TPs.
    gts = [gt_frame("a", [box(19.8, 0), box(30, 0)])]
    preds = [pred_frame("a", [box(20.3, 0), box(30, 0.2)], [0.9, 0.95])]
    m = evaluate_detections(gts, preds, KpiParams(classes=("Car",))).metrics
    assert list(m["by_range"]) == ["0-20", "20-40", "40+"]
    assert m["classes"]["Car"]["ap"]["1.0"] == pytest.approx(1.0, abs=1e-12)
    assert m["by_range"]["0-20"]["classes"]["Car"]["ap"]["1.0"] == 0.0
    assert m["by_range"]["0-20"]["classes"]["Car"]["num_pred"] == 0
    r2 = m["by_range"]["20-40"]["classes"]["Car"]
    assert (r2["num_gt"], r2["num_pred"]) == (1, 2)
    # TP (0.95) then FP: (recall, precision) = (1, 1), (1, 0.5); np.interp at recall 1 takes the
    # last 0.5, so AP = (89 * 0.9 + 0.4) / 90 / 0.9 = 80.5 / 81 (the devkit's number too).
    assert r2["ap"]["1.0"] == pytest.approx(80.5 / 81, abs=1e-12)
    assert m["by_range"]["40+"]["classes"]["Car"]["num_gt"] == 0


def test_per_frame_counts_and_latency() -> None:
    gts = [gt_frame("a", [box(5, 0), box(10, 0)]), gt_frame("b", [box(5, 5)], "Pedestrian")]
    preds = [
        pred_frame("a", [box(5, 0.5), box(40, 0), box(10, 0)], [0.9, 0.8, 0.1]),  # 0.1 is below 0.3
        pred_frame("c", [box(1, 1)], [0.5], "Cyclist"),  # a frame without GT: a false positive
    ]
    kpis = evaluate_detections(gts, preds, latency={"p50_ms": 12.5})
    rows = {r["frame_id"]: r for r in kpis.per_frame}
    assert list(rows) == ["a", "b", "c"]
    assert (rows["a"]["tp"], rows["a"]["fp"], rows["a"]["fn"]) == (1, 1, 1)
    assert rows["b"]["classes"]["Pedestrian"] == {"tp": 0, "fp": 0, "fn": 1}
    assert rows["c"]["classes"]["Cyclist"] == {"tp": 0, "fp": 1, "fn": 0}
    assert kpis.metrics["latency"] == {"p50_ms": 12.5}


def test_output_layout_is_json() -> None:
    gts, preds = random_detections(n_frames=5, seed=2)
    kpis = evaluate_detections(gts, preds)
    d = kpis.to_dict()
    json.dumps(d, allow_nan=False)  # no NaN/inf anywhere (range bucket "40+" has hi = null)
    assert {"mAP", "NDS", "tp_errors", "classes", "by_range", "params", "per_frame", "pr_curves"} <= set(d)
    assert set(d["classes"]) == {"Car", "Pedestrian", "Cyclist"}
    assert set(d["classes"]["Car"]) >= {"ap", "ate", "ase", "aoe"}
    assert list(d["classes"]["Car"]["ap"]) == ["0.5", "1.0", "2.0", "4.0"]
    curve = d["pr_curves"]["Car"]["2.0"]
    assert len(curve["recall"]) == len(curve["precision"]) == 101
    assert np.all(np.diff(curve["confidence"]) <= 0)  # descending, as the devkit asserts
    assert d["params"]["range_buckets_m"][-1] == [40.0, None]


def test_invariant_to_rotation_about_the_sensor() -> None:
    # BEV distances, ranges, sizes and yaw differences do not change under a rotation about +z.
    gts, preds = random_detections(n_frames=10, gt_per_frame=15, seed=4)

    def rotate(f: FrameDetections, a: float) -> FrameDetections:
        b = f.boxes.copy()
        c, s = math.cos(a), math.sin(a)
        b[:, 0], b[:, 1] = c * f.boxes[:, 0] - s * f.boxes[:, 1], s * f.boxes[:, 0] + c * f.boxes[:, 1]
        b[:, 6] += a
        return FrameDetections(f.frame_id, b, f.names, f.scores)

    a = evaluate_detections(gts, preds).metrics
    b = evaluate_detections([rotate(f, 0.7) for f in gts], [rotate(f, 0.7) for f in preds]).metrics
    assert b["mAP"] == pytest.approx(a["mAP"], abs=1e-9)
    assert b["NDS"] == pytest.approx(a["NDS"], abs=1e-9)
    for k in a["by_range"]:
        assert b["by_range"][k]["mAP"] == pytest.approx(a["by_range"][k]["mAP"], abs=1e-9)


def test_ignores_other_classes() -> None:
    gts = [gt_frame("a", [box(5, 0), box(9, 0)], ["Car", "DontCare"])]
    preds = [pred_frame("a", [box(5, 0), box(9, 0)], [0.9, 0.95], ["Car", "Van"])]
    c = evaluate_detections(gts, preds, CAR_ONLY).metrics["classes"]["Car"]
    assert c["mean_ap"] == pytest.approx(1.0, abs=1e-12) and (c["num_gt"], c["num_pred"]) == (1, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"boxes": np.zeros((2, 6)), "names": ["Car"] * 2}, r"\[N, 7\]"),
        ({"boxes": [box(1, 1)], "names": ["Car", "Car"]}, "2 names for 1 boxes"),
        ({"boxes": [box(1, 1, lwh=(0.0, 1.0, 1.0))], "names": ["Car"]}, "size <= 0"),
        ({"boxes": [box(np.nan, 1)], "names": ["Car"]}, "finite"),
        ({"boxes": [box(1, 1)], "names": ["Car"], "scores": [-0.1]}, "scores must be finite and >= 0"),
        ({"boxes": [box(1, 1)], "names": ["Car"], "scores": [0.1, 0.2]}, "2 scores for 1 boxes"),
    ],
)
def test_frame_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FrameDetections("f7", **kwargs)


def test_evaluate_validation() -> None:
    g = gt_frame("a", [box(1, 1)])
    with pytest.raises(ValueError, match="appears twice"):
        evaluate_detections([g, g], [])
    with pytest.raises(ValueError, match="has no scores"):
        evaluate_detections([g], [g])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"classes": ()}, "classes"),
        ({"dist_ths_m": (0.5, 1.0), "dist_th_tp_m": 2.0}, "dist_th_tp_m"),
        ({"dist_ths_m": (-1.0, 2.0)}, "positive"),
        ({"min_precision": 1.0}, "min_precision"),
        ({"range_buckets_m": ((20, 10),)}, "lo < hi"),
        ({"class_range_m": {"Truck": 50.0}}, "Truck"),
    ],
)
def test_params_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KpiParams(**kwargs)


def test_params_accept_lists() -> None:
    p = KpiParams(classes=["Car"], dist_ths_m=[1, 2], range_buckets_m=[[0, 50]])  # as from params.yaml
    assert p.classes == ("Car",) and p.dist_ths_m == (1.0, 2.0) and p.range_buckets_m == ((0.0, 50.0),)
