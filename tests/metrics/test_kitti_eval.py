"""KITTI's official metric (pfactory.metrics.kitti_eval): the reference's numbers on generated scenes
(golden fixture), hand-computed rules, rotated IoU against an exact polygon clip, and random scenes against
a slow per-frame implementation written from the definition."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pfactory.metrics.kitti_eval import (
    CLASSES,
    DIFFICULTIES,
    MAX_OCCLUSION,
    MAX_TRUNCATION,
    MIN_HEIGHT_PX,
    OVERLAPS,
    KittiObjects,
    ap_r11,
    ap_r40,
    bev_corners,
    evaluate_kitti,
    read_kitti_dir,
    rect_intersection_area,
    score_thresholds,
)
from tests.metrics.kitti_scenes import make_scenes, write_scenes

GOLDEN = json.loads((Path(__file__).parent / "kitti_golden.json").read_text())


def _eval_lines(tmp_path: Path, gt: dict[str, list[str]], dt: dict[str, list[str]]):
    labels, results = write_scenes(tmp_path, gt, dt)
    g = read_kitti_dir({p.stem: p for p in sorted(labels.glob("*.txt"))}, with_score=False)
    d = read_kitti_dir({p.stem: p for p in sorted(results.glob("*.txt"))}, with_score=True)
    return evaluate_kitti(g, d)


def _tier(scene: dict):
    """The two larger scenes (~2 s each here) run with --full; the others in the default tier."""
    marks = [pytest.mark.full] if scene["frames"] > 200 else []
    return pytest.param(scene, marks=marks, id=f"seed{scene['seed']}-{scene['frames']}f")


@pytest.mark.parametrize("scene", [_tier(s) for s in GOLDEN["scenes"]])
def test_equals_reference_evaluator(tmp_path: Path, scene: dict) -> None:
    """Every AP (R40 / R11, strict / loose, 3 classes x bbox/bev/3d/aos x 3 difficulties) to 1e-6."""
    gt, dt = make_scenes(
        scene["seed"], scene["frames"], scene["max_gt"], scene["alpha"], tuple(scene["drop"])
    )
    res = _eval_lines(tmp_path, gt, dt)
    assert res.compute_aos == scene["compute_aos"]
    tables = res.tables()
    checked, worst = 0, 0.0
    for rec, by_ov in scene["percent"].items():
        for ov, by_cls in by_ov.items():
            for c, by_m in by_cls.items():
                for m, by_d in by_m.items():
                    for d, ref in by_d.items():
                        ours = tables[rec][ov][c][m][d]
                        if ref is None:
                            assert ours is None, (rec, ov, c, m, d, ours)
                            continue
                        worst = max(worst, abs(ours - ref / 100))
                        checked += 1
    assert checked >= 3 * 3 * 3 * 4, checked
    assert worst <= 1e-6, f"largest difference from the reference: {worst:.3g} over {checked} APs"


# --- hand-computed rules -------------------------------------------------------------------------------

CAR = (1.5, 1.6, 3.9)


def _gt(
    t: str, bbox=(100, 100, 200, 160), trunc=0.0, occ=0, loc=(0.0, 1.6, 20.0), hwl=CAR, ry=0.0, alpha=0.0
) -> str:
    return " ".join(map(str, [t, trunc, occ, alpha, *bbox, *hwl, *loc, ry]))


def _dt(
    t: str, score: float, bbox=(100, 100, 200, 160), loc=(0.0, 1.6, 20.0), hwl=CAR, ry=0.0, alpha=0.0
) -> str:
    return _gt(t, bbox, 0.0, 0, loc, hwl, ry, alpha) + f" {score}"


def _res(tmp_path: Path, gt: dict, dt: dict):
    return _eval_lines(tmp_path, gt, dt)


def _p0(
    tmp_path: Path, gt: dict, dt: dict, metric: str = "3d", diff: str = "moderate", cls: str = "Car"
) -> float:
    """The interpolated precision at the first score threshold (the best over all thresholds)."""
    return float(_res(tmp_path, gt, dt).precision["strict", cls, metric, diff][0])


def test_perfect_detections_and_the_threshold_count(tmp_path: Path) -> None:
    # The benchmark samples precision at its score thresholds, one per TP up to 41 (not at recall values):
    # one perfectly detected car gives one threshold, so R40 (samples 1..40) is 0 and R11 is 1/11.
    t = _res(tmp_path, {"0": [_gt("Car")]}, {"0": [_dt("Car", 0.9)]}).tables()
    assert t["R40"]["strict"]["Car"]["3d"]["moderate"] == 0.0
    assert t["R11"]["strict"]["Car"]["3d"]["moderate"] == pytest.approx(1 / 11)
    # 41 of them: 41 thresholds, every AP 1 (AOS too: same alpha).
    gt = {f"{i:03d}": [_gt("Car")] for i in range(41)}
    dt = {f"{i:03d}": [_dt("Car", 0.5 + i / 100)] for i in range(41)}
    t = _res(tmp_path, gt, dt).tables()["R40"]["strict"]
    assert all(t["Car"][m][d] == 1.0 for m in ("bbox", "bev", "3d", "aos") for d in DIFFICULTIES)
    assert t["Pedestrian"]["3d"]["moderate"] == 0.0  # a class with no ground truth: 0, not an error


def test_van_matched_by_car_detection_is_neither_tp_nor_fp(tmp_path: Path) -> None:
    gt = {"0": [_gt("Van", loc=(5, 1.6, 20)), _gt("Car", bbox=(400, 100, 500, 160))]}
    dt = {"0": [_dt("Car", 0.9, loc=(5, 1.6, 20)), _dt("Car", 0.5, bbox=(400, 100, 500, 160))]}
    assert _p0(tmp_path, gt, dt) == 1.0  # the Van's detection is no FP
    gt["0"][0] = _gt("Truck", loc=(5, 1.6, 20))  # not a neighbour: the detection is an FP above the TP
    assert _p0(tmp_path, gt, dt) == 0.5
    # Person_sitting is Pedestrian's neighbour: its detection is no FP for Pedestrian.
    ped = (1.2, 0.6, 0.9)
    gt = {"0": [_gt("Person_sitting", hwl=ped, loc=(5, 1.6, 20)), _gt("Pedestrian", hwl=ped)]}
    dt = {"0": [_dt("Pedestrian", 0.9, hwl=ped, loc=(5, 1.6, 20)), _dt("Pedestrian", 0.5, hwl=ped)]}
    assert _p0(tmp_path, gt, dt, cls="Pedestrian") == 1.0
    res = _res(tmp_path, gt, dt)
    assert res.num_gt["Pedestrian", "moderate"] == 1 and res.num_gt["Cyclist", "moderate"] == 0


def test_difficulty_heights_occlusion_truncation(tmp_path: Path) -> None:
    # A 24 px ground truth and its 24 px detection are ignored at every level: only the other car counts.
    small = (100, 100, 140, 124)
    gt = {"0": [_gt("Car", bbox=small), _gt("Car", loc=(6, 1.6, 20))]}
    dt = {"0": [_dt("Car", 0.9, bbox=small), _dt("Car", 0.5, loc=(6, 1.6, 20))]}
    res = _res(tmp_path, gt, dt)
    assert [res.num_gt["Car", d] for d in DIFFICULTIES] == [1, 1, 1]
    assert [float(res.precision["strict", "Car", "bbox", d][0]) for d in DIFFICULTIES] == [1.0, 1.0, 1.0]
    # A 24 px detection on a 60 px ground truth: ignored, so no TP and no threshold.
    res = _res(tmp_path, {"0": [_gt("Car")]}, {"0": [_dt("Car", 0.9, bbox=(100, 100, 200, 124))]})
    assert float(res.precision["strict", "Car", "bbox", "easy"][0]) == 0.0
    # A ground truth exactly 40 px tall is not easy (height <= 40 is ignored), but moderate.
    res = _res(
        tmp_path,
        {"0": [_gt("Car", bbox=(100, 100, 200, 140))]},
        {"0": [_dt("Car", 0.9, bbox=(100, 100, 200, 140))]},
    )
    assert [res.num_gt["Car", d] for d in DIFFICULTIES] == [0, 1, 1]
    # Occlusion 1 / truncation 0.3: moderate and hard, not easy; occlusion 3: none.
    for kw, want in (
        ({"occ": 1}, [0, 1, 1]),
        ({"trunc": 0.3}, [0, 1, 1]),
        ({"trunc": 0.31}, [0, 0, 1]),
        ({"occ": 3}, [0, 0, 0]),
    ):
        res = _res(tmp_path, {"0": [_gt("Car", **kw)]}, {"0": [_dt("Car", 0.9)]})
        assert [res.num_gt["Car", d] for d in DIFFICULTIES] == want, kw


def test_dontcare_swallows_a_2d_false_positive_but_not_a_3d_one(tmp_path: Path) -> None:
    dc = "DontCare -1 -1 -10 300 100 500 200 -1 -1 -1 -1000 -1000 -1000 -10"
    gt = {"0": [_gt("Car"), dc]}
    dt = {"0": [_dt("Car", 0.9, bbox=(320, 110, 420, 180), loc=(8, 1.6, 30)), _dt("Car", 0.5)]}
    assert _p0(tmp_path, gt, dt, "bbox") == 1.0  # the FP inside the DontCare region does not count in 2D
    assert _p0(tmp_path, gt, dt, "3d") == 0.5  # ... but does in 3D
    assert float(_res(tmp_path, gt, dt).aos["strict", "Car", "moderate"][0]) == 1.0


def test_aos_of_a_flipped_heading(tmp_path: Path) -> None:
    gt = {"0": [_gt("Car", ry=0.3, alpha=0.3)]}
    res = _res(tmp_path, gt, {"0": [_dt("Car", 0.9, ry=0.3 + math.pi, alpha=0.3 + math.pi)]})
    assert float(res.precision["strict", "Car", "3d", "moderate"][0]) == 1.0  # IoU ignores the heading's sign
    assert float(res.aos["strict", "Car", "moderate"][0]) == pytest.approx(0.0, abs=1e-12)  # (1 + cos pi) / 2
    res = _res(tmp_path, gt, {"0": [_dt("Car", 0.9, ry=0.3, alpha=0.3 + math.pi / 2)]})
    assert float(res.aos["strict", "Car", "moderate"][0]) == pytest.approx(0.5)
    # No alpha in the results (-10, the port's marker): no AOS.
    res = _res(tmp_path, gt, {"0": [_dt("Car", 0.9, alpha=-10)]})
    assert res.compute_aos is False and res.tables()["R40"]["strict"]["Car"]["aos"]["moderate"] is None


def test_score_ties_and_empty_frames(tmp_path: Path) -> None:
    # A TP and an FP (another frame) with the same score: one threshold, precision 1/2 there; frame 1 has
    # no ground truth, frame 2 no result file at all (no detections).
    gt = {"0": [_gt("Car")], "1": [], "2": [_gt("Car")]}
    dt = {"0": [_dt("Car", 0.5)], "1": [_dt("Car", 0.5, loc=(-8, 1.6, 40))]}
    assert _p0(tmp_path, gt, dt) == 0.5
    assert score_thresholds(np.array([0.5, 0.5, 0.5]), 3).tolist() == [0.5, 0.5, 0.5]
    assert len(score_thresholds(np.linspace(1, 0, 200), 200)) == 41
    # Two tied detections on one car: the first in the file is the TP, the other a duplicate FP.
    gt = {"0": [_gt("Car")]}
    assert _p0(tmp_path, gt, {"0": [_dt("Car", 0.8), _dt("Car", 0.8, loc=(0.05, 1.6, 20.05))]}) == 0.5


def test_highest_score_wins_a_shared_ground_truth(tmp_path: Path) -> None:
    gt = {"0": [_gt("Car")]}
    # The better-scoring detection is the TP (threshold 0.8), the 0.4 duplicate is below it.
    assert _p0(tmp_path, gt, {"0": [_dt("Car", 0.4), _dt("Car", 0.8, loc=(0.05, 1.6, 20.05))]}) == 1.0


def test_ap_sampling() -> None:
    prec = np.linspace(1, 0, 41)
    assert ap_r40(prec) == pytest.approx(np.mean(prec[1:]))
    assert ap_r11(prec) == pytest.approx(np.mean(prec[::4]))


def test_bad_inputs() -> None:
    gt = KittiObjects.empty_like(["a"], with_score=False)
    with pytest.raises(ValueError, match="without ground truth"):
        evaluate_kitti(gt, KittiObjects.empty_like(["b"], with_score=True))
    with pytest.raises(ValueError, match="scores"):
        evaluate_kitti(gt, KittiObjects.empty_like(["a"], with_score=False))
    with pytest.raises(ValueError, match="no benchmark overlaps"):
        evaluate_kitti(gt, KittiObjects.empty_like(["a"], with_score=True), classes=("Van",))


# --- rotated IoU against an exact polygon clip ----------------------------------------------------------


def _clip_area(a: np.ndarray, b: np.ndarray) -> float:
    """Sutherland-Hodgman: the convex polygon `a` clipped by each edge of the convex polygon `b` (CCW)."""
    poly = [tuple(p) for p in a]
    for i in range(4):
        p, q = b[i], b[(i + 1) % 4]

        def side(x, p=p, q=q):
            return (q[0] - p[0]) * (x[1] - p[1]) - (q[1] - p[1]) * (x[0] - p[0])

        out = []
        for j in range(len(poly)):
            cur, nxt = np.array(poly[j]), np.array(poly[(j + 1) % len(poly)])
            sc, sn = side(cur), side(nxt)
            if sc >= 0:
                out.append(tuple(cur))
            if (sc >= 0) != (sn >= 0):
                out.append(tuple(cur + (nxt - cur) * (sc / (sc - sn))))
        poly = out
        if not poly:
            return 0.0
    x, y = np.array(poly).T
    return 0.5 * abs(float(np.sum(x * np.roll(y, -1) - np.roll(x, -1) * y)))


def test_rotated_intersection_against_polygon_clip() -> None:
    rng = np.random.default_rng(3)
    n = 400
    boxes = []
    for _ in range(2):
        boxes.append(
            bev_corners(
                rng.uniform(-2, 2, n),
                rng.uniform(-2, 2, n),
                rng.uniform(0.5, 5, n),
                rng.uniform(0.5, 3, n),
                rng.uniform(-np.pi, np.pi, n),
            )
        )
    # Adversarial: identical boxes, shared edges, the same box turned by pi / 2 (a square: the same set).
    a, b = boxes
    b[:5] = a[:5]
    sq = bev_corners(np.zeros(1), np.zeros(1), np.ones(1) * 2, np.ones(1) * 2, np.zeros(1))
    a[5], b[5] = (
        sq[0],
        bev_corners(np.zeros(1), np.zeros(1), np.ones(1) * 2, np.ones(1) * 2, np.full(1, np.pi / 2))[0],
    )
    a[6], b[6] = sq[0], sq[0] + np.array([2.0, 0.0])  # touching along an edge: area 0
    a[7], b[7] = sq[0], sq[0] + np.array([1.0, 0.0])  # half overlap
    got = rect_intersection_area(a, b)
    want = np.array([_clip_area(a[i], b[i]) for i in range(n)])
    np.testing.assert_allclose(got, want, atol=1e-9)
    assert got[0] == pytest.approx(_clip_area(a[0], a[0])) and got[5] == pytest.approx(4.0)
    assert got[6] == 0.0 and got[7] == pytest.approx(2.0)


# --- random scenes against a slow implementation written from the definition ----------------------------


def _corners(o: KittiObjects, k: int) -> np.ndarray:
    """Object k's BEV rectangle (location x, z; hwl's l, w; rotation_y) -> its corners [4, 2] in (x, z)."""
    one = slice(k, k + 1)
    return bev_corners(
        o.location[one, 0], o.location[one, 2], o.hwl[one, 2], o.hwl[one, 1], o.rotation_y[one]
    )[0]


def _slow(gt: KittiObjects, dt: KittiObjects, cls: str, diff: int, metric: str, min_ov: float):
    """Per frame, per threshold: the benchmark's loops, one box at a time (float64 geometry)."""
    gs, ds = np.concatenate([[0], np.cumsum(gt.counts)]), np.concatenate([[0], np.cumsum(dt.counts)])
    c = cls.lower()
    nb = {"car": "van", "pedestrian": "person_sitting"}.get(c)

    def gflag(i):
        n = gt.name[i].lower()
        v = 1 if n == c else 0 if n == nb else -1
        h = gt.bbox[i, 3] - gt.bbox[i, 1]
        hard = (
            gt.occluded[i] > MAX_OCCLUSION[diff]
            or gt.truncated[i] > MAX_TRUNCATION[diff]
            or h <= MIN_HEIGHT_PX[diff]
        )
        return 0 if v == 1 and not hard else 1 if v == 0 or (v == 1 and hard) else -1

    def dflag(j):
        if abs(dt.bbox[j, 3] - dt.bbox[j, 1]) < MIN_HEIGHT_PX[diff]:
            return 1
        return 0 if dt.name[j].lower() == c else -1

    def overlap(j, i):
        if metric == "bbox":
            a, b = dt.bbox[j], gt.bbox[i]
            iw, ih = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
            if iw <= 0 or ih <= 0:
                return 0.0
            return iw * ih / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - iw * ih)
        inter = _clip_area(_corners(dt, j), _corners(gt, i))
        aj, ai = dt.hwl[j, 2] * dt.hwl[j, 1], gt.hwl[i, 2] * gt.hwl[i, 1]
        if metric == "bev":
            return inter / (aj + ai - inter) if inter > 0 else 0.0
        yj, yi = dt.location[j, 1], gt.location[i, 1]
        iw = min(yj, yi) - max(yj - dt.hwl[j, 0], yi - gt.hwl[i, 0])
        if inter <= 0 or iw <= 0:
            return 0.0
        return iw * inter / (aj * dt.hwl[j, 0] + ai * gt.hwl[i, 0] - iw * inter)

    frames = []
    for f in range(len(gt.frame_ids)):
        G, D = range(gs[f], gs[f + 1]), range(ds[f], ds[f + 1])
        ov = {(j, i): overlap(j, i) for j in D for i in G}
        dc = [i for i in G if gt.name[i] == "DontCare"]
        frames.append((list(G), list(D), ov, dc, {i: gflag(i) for i in G}, {j: dflag(j) for j in D}))

    def match(G, D, ov, gf, df, thresh, with_fp):
        assigned, res = set(), []
        for i in G:
            if gf[i] == -1:
                continue
            best, val, mx, ign = -1, None, 0.0, False
            for j in D:
                if df[j] == -1 or j in assigned or (with_fp and dt.score[j] < thresh):
                    continue
                o = ov[j, i]
                if not with_fp and o > min_ov and (val is None or dt.score[j] > val):
                    best, val = j, dt.score[j]
                elif with_fp and o > min_ov and (o > mx or ign) and df[j] == 0:
                    best, val, mx, ign = j, 1, o, False
                elif with_fp and o > min_ov and val is None and df[j] == 1:
                    best, val, ign = j, 1, True
            if best >= 0:
                assigned.add(best)
                res.append((i, best))
        return assigned, res

    n_gt = sum(v == 0 for fr in frames for v in fr[4].values())
    tps = []
    for G, D, ov, _dc, gf, df in frames:
        tps += [dt.score[j] for i, j in match(G, D, ov, gf, df, 0, False)[1] if gf[i] == 0 and df[j] == 0]
    thr = score_thresholds(np.array(tps), n_gt)
    prec = np.zeros(41)
    for t, th in enumerate(thr):
        tp = fp = 0
        for G, D, ov, dc, gf, df in frames:
            assigned, res = match(G, D, ov, gf, df, th, True)
            tp += sum(1 for i, j in res if gf[i] == 0 and df[j] == 0)
            for j in D:
                if j in assigned or df[j] != 0 or dt.score[j] < th:
                    continue
                if metric == "bbox" and any(_dc_overlap(dt.bbox[j], gt.bbox[k]) > min_ov for k in dc):
                    continue
                fp += 1
        prec[t] = tp / (tp + fp)
    return np.maximum.accumulate(prec[::-1])[::-1]


def _dc_overlap(a, b) -> float:
    iw, ih = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
    return iw * ih / ((a[2] - a[0]) * (a[3] - a[1])) if iw > 0 and ih > 0 else 0.0


@pytest.mark.parametrize(
    ("seed", "frames"), [(11, 8), pytest.param(12, 25, marks=pytest.mark.full)]
)  # the slow loops: ~3 s for 8 frames here, ~10 s for 25
def test_random_scenes_against_slow_implementation(tmp_path: Path, seed: int, frames: int) -> None:
    gt_lines, dt_lines = make_scenes(seed, frames=frames, max_gt=10)
    labels, results = write_scenes(tmp_path, gt_lines, dt_lines)
    gt = read_kitti_dir({p.stem: p for p in sorted(labels.glob("*.txt"))}, with_score=False)
    dt = read_kitti_dir({p.stem: p for p in sorted(results.glob("*.txt"))}, with_score=True)
    res = evaluate_kitti(gt, dt)
    dt = dt.aligned(gt.frame_ids)
    for cls in CLASSES:
        for diff in (0, 1, 2):
            for mi, metric in enumerate(("bbox", "bev", "3d")):
                for ov in ("strict", "loose"):
                    want = _slow(gt, dt, cls, diff, metric, OVERLAPS[ov][cls][mi])
                    got = res.precision[ov, cls, metric, DIFFICULTIES[diff]]
                    np.testing.assert_allclose(got, want, atol=1e-12, err_msg=f"{cls} {metric} {ov} {diff}")


# --- through factory kpi -------------------------------------------------------------------------------


def test_factory_kpi_kitti_blocks_frames_and_auto(tmp_path: Path) -> None:
    from pfactory.metrics.kpi_cli import format_kpi_table, run_kpi
    from pfactory.sensors.errors import DatasetError

    gt, dt = make_scenes(21, frames=12)
    labels, results = write_scenes(tmp_path, gt, dt)
    auto = run_kpi(labels, results, out=tmp_path / "kpis.json")  # real 2D boxes: nuScenes + KITTI
    assert {"mAP", "kitti", "kitti_R11", "kitti_loose", "kitti_loose_R11", "kitti_info"} <= set(auto)
    assert auto["inputs"]["metrics"] == ["nuscenes", "kitti"]
    assert json.loads((tmp_path / "kpis.json").read_text())["kitti"] == auto["kitti"]
    direct = evaluate_kitti(
        read_kitti_dir({p.stem: p for p in sorted(labels.glob("*.txt"))}, False),
        read_kitti_dir({p.stem: p for p in sorted(results.glob("*.txt"))}, True),
    ).tables()
    assert auto["kitti"] == direct["R40"]["strict"] and auto["kitti_loose_R11"] == direct["R11"]["loose"]
    assert "KITTI AP R40" in format_kpi_table(auto) and "mAP" in format_kpi_table(auto)
    only = run_kpi(labels, results, metrics="kitti")
    assert "mAP" not in only and only["kitti"] == auto["kitti"]
    assert format_kpi_table(only).startswith("KITTI AP R40")
    from pfactory.metrics.kitti_eval import KPI_KEYS
    from pfactory.storage.artifacts import KITTI_KEYS, kitti_scalars

    assert tuple(KPI_KEYS) == KITTI_KEYS  # the MLflow names' keys, declared twice to keep artifacts light
    scalars = kitti_scalars(only)
    assert scalars["kitti/Car/3d/moderate"] == only["kitti"]["Car"]["3d"]["moderate"]
    assert len(scalars) == 4 * 3 * 4 * 3 - sum(
        v is None for k in KITTI_KEYS for c in only[k].values() for m in c.values() for v in m.values()
    )
    assert "kitti" not in run_kpi(labels, results, metrics="nuscenes")
    # --frames: only the listed frames are scored (KITTI's ImageSets/val.txt).
    (tmp_path / "val.txt").write_text("000003\n000001\n\n")
    part = run_kpi(labels, results, metrics="kitti", frames=tmp_path / "val.txt")
    sub = tmp_path / "sub"
    write_scenes(sub, {k: gt[k] for k in ("000001", "000003")}, {k: dt[k] for k in ("000001", "000003")})
    assert part["kitti"] == run_kpi(sub / "label_2", sub / "results", metrics="kitti")["kitti"]
    (tmp_path / "bad.txt").write_text("000001\n999999\n")
    with pytest.raises(DatasetError, match="999999"):
        run_kpi(labels, results, metrics="kitti", frames=tmp_path / "bad.txt")
    # Labels without 2D boxes (0 0 0 0, the stage's calibration-free files): auto leaves KITTI out.
    flat = {
        f: [" ".join([*x.split()[:4], "0", "0", "0", "0", *x.split()[8:]]) for x in lines]
        for f, lines in gt.items()
    }
    labels0, _ = write_scenes(tmp_path / "flat", flat, dt)
    assert "kitti" not in run_kpi(labels0, results)
