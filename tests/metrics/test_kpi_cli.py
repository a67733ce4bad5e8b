"""`run_kpi` (behind `factory kpi`) on KITTI files written in tmp_path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pfactory.metrics.detection import FrameDetections, evaluate_detections
from pfactory.metrics.kpi_cli import format_kpi_table, kitti_camera_to_lidar, run_kpi
from pfactory.metrics.synthetic import random_detections
from pfactory.sensors.errors import DatasetError
from pfactory.sensors.kitti import objects_to_lidar_boxes, parse_label_lines

# Lidar-like frame <- rectified camera frame, the fixed rotation of kpi_cli (no calibration).
T_RECT_FROM_LIDAR = np.array([[0.0, -1, 0, 0], [0, 0, -1, 0], [1, 0, 0, 0], [0, 0, 0, 1]])


def kitti_lines(f: FrameDetections) -> str:
    """Lidar-frame boxes -> KITTI label/result lines at full precision (the inverse rotation)."""
    out = []
    for i, (x, y, z, l, w, h, yaw) in enumerate(f.boxes.tolist()):
        loc = (-y, h / 2 - z, x)  # bottom centre in the camera frame (y down)
        ry = -yaw - math.pi / 2
        cols = [str(f.names[i]), "0", "0", "0", "0", "0", "50", "50", h, w, l, *loc, ry]
        if f.scores is not None:
            cols.append(f.scores[i])
        out.append(" ".join(c if isinstance(c, str) else repr(float(c)) for c in cols))
    return "\n".join(out) + "\n"


def write_dir(folder: Path, frames: list[FrameDetections]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in frames:
        (folder / f"{f.frame_id}.txt").write_text(kitti_lines(f))
    return folder


def test_same_kpis_as_the_library(tmp_path: Path) -> None:
    gts, preds = random_detections(n_frames=12, gt_per_frame=10, pred_per_frame=25, seed=3)
    out = tmp_path / "kpis.json"
    res = run_kpi(write_dir(tmp_path / "gt", gts), write_dir(tmp_path / "pred", preds), out)
    ref = evaluate_detections(gts, preds).metrics
    assert res["mAP"] == pytest.approx(ref["mAP"], abs=1e-9)
    assert res["NDS"] == pytest.approx(ref["NDS"], abs=1e-9)
    for name, c in ref["classes"].items():
        for m in ("ate", "ase", "aoe"):
            assert res["classes"][name][m] == pytest.approx(c[m], abs=1e-9)
    for k, r in ref["by_range"].items():
        assert res["by_range"][k]["mAP"] == pytest.approx(r["mAP"], abs=1e-9)
    written = json.loads(out.read_text())
    assert written["mAP"] == res["mAP"] and len(written["per_frame"]) == 12
    assert written["inputs"]["num_frames"] == 12
    assert "Car" in format_kpi_table(res)


def test_conversion_matches_the_calibrated_reader() -> None:
    text = "Car 0 0 0.3 10 10 50 50 1.5 1.8 4.2 -3.1 1.7 22.4 2.9\nCyclist 0 0 0 0 0 5 5 1.7 0.6 1.8 5 1.6 8 -0.4\n"
    objs = parse_label_lines(text)
    ours = kitti_camera_to_lidar(objs)
    ref = objects_to_lidar_boxes(objs, T_RECT_FROM_LIDAR)
    np.testing.assert_allclose(ours[:, :6], ref[:, :6], atol=1e-12)
    np.testing.assert_allclose(np.cos(ours[:, 6] - ref[:, 6]), 1.0, atol=1e-12)
    assert ours[0, 0] == 22.4 and ours[0, 1] == 3.1 and ours[0, 2] == pytest.approx(-1.7 + 0.75)


def test_missing_result_file_means_no_predictions(tmp_path: Path) -> None:
    gts, preds = random_detections(n_frames=4, gt_per_frame=8, seed=1)
    res = run_kpi(write_dir(tmp_path / "gt", gts), write_dir(tmp_path / "pred", preds[:2]))
    rows = {r["frame_id"]: r for r in res["per_frame"]}
    assert rows[gts[3].frame_id]["tp"] == 0 and rows[gts[3].frame_id]["fp"] == 0
    assert rows[gts[3].frame_id]["fn"] == len(gts[3].boxes)
    assert res["inputs"]["num_result_files"] == 2


def test_result_without_gt_is_an_error(tmp_path: Path) -> None:
    gts, preds = random_detections(n_frames=3, seed=1)
    write_dir(tmp_path / "gt", gts[:2])
    write_dir(tmp_path / "pred", preds)
    with pytest.raises(DatasetError, match=rf"{preds[2].frame_id}\.txt.*ground-truth file"):
        run_kpi(tmp_path / "gt", tmp_path / "pred")


def test_bad_lines_name_file_line_and_field(tmp_path: Path) -> None:
    gt = write_dir(tmp_path / "gt", [FrameDetections("000001", [[5, 0, 0, 4, 2, 1.5, 0]], ["Car"])])
    pred = tmp_path / "pred"
    pred.mkdir()
    good = "Car 0 0 0 0 0 50 50 1.5 2 4 0 0.75 5 0 0.9"
    (pred / "000001.txt").write_text(f"{good}\n\nCar 0 0 0 0 0 50 50 1.5 2 4 0 0.75 5 0 -0.2\n")
    with pytest.raises(DatasetError, match=r"000001\.txt: line 3 score: a score >= 0"):
        run_kpi(gt, pred)
    (pred / "000001.txt").write_text(f"{good}\nCar 0 0 0 0 0 50 50 1.5 2 0 0 0.75 5 0 0.9\n")
    with pytest.raises(DatasetError, match=r"line 2 dimensions"):
        run_kpi(gt, pred)
    (pred / "000001.txt").write_text(f"{good}\nCar 0 0 0 0 0 50 50 1.5 2 four 0 0.75 5 0 0.9\n")
    with pytest.raises(DatasetError, match=r"line 2 length"):
        run_kpi(gt, pred)
    (pred / "000001.txt").write_text("Car 0 0 0 0 0 50 50 1.5 2 4 0 0.75 5 0\n")  # no score column
    with pytest.raises(DatasetError, match=r"line 1"):
        run_kpi(gt, pred)
    with pytest.raises(DatasetError, match="existing directory"):
        run_kpi(gt, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="at least one"):
        run_kpi(tmp_path / "empty", pred)


def test_class_map_and_ignored_types(tmp_path: Path) -> None:
    gt = tmp_path / "gt"
    gt.mkdir()
    (gt / "a.txt").write_text(
        "Car 0 0 0 0 0 50 50 1.5 2 4 0 0.75 5 0\n"
        "Van 0 0 0 0 0 50 50 2 2 5 3 1 15 0\n"
        "DontCare -1 -1 -10 0 0 50 50 -1 -1 -1 -1000 -1000 -1000 -10\n"
    )
    pred = tmp_path / "pred"
    pred.mkdir()
    (pred / "a.txt").write_text(
        "Car 0 0 0 0 0 50 50 1.5 2 4 0 0.75 5 0 0.9\nCar 0 0 0 0 0 50 50 2 2 5 3 1 15 0 0.8\n"
    )
    default = run_kpi(gt, pred)  # Van ignored: the second prediction is a false positive
    assert default["classes"]["Car"]["num_gt"] == 1
    assert default["per_frame"][0]["fp"] == 1
    vans = run_kpi(gt, pred, class_map={"Car": "Car", "Van": "Car"}, range_buckets_m=())
    assert list(vans["classes"]) == ["Car"] and vans["classes"]["Car"]["num_gt"] == 2
    assert vans["classes"]["Car"]["mean_ap"] == pytest.approx(1.0, abs=1e-12)
    assert vans["by_range"] == {}


def test_label_2_subfolder_and_latency(tmp_path: Path) -> None:
    gts, preds = random_detections(n_frames=2, seed=9)
    write_dir(tmp_path / "gt" / "label_2", gts)
    res = run_kpi(tmp_path / "gt", write_dir(tmp_path / "pred", preds), latency={"p50_ms": 3.0})
    assert res["inputs"]["num_frames"] == 2 and res["latency"] == {"p50_ms": 3.0}


def test_error_breakdown_and_score_threshold(tmp_path: Path) -> None:
    gts, preds = random_detections(n_frames=10, gt_per_frame=10, pred_per_frame=25, seed=5)
    gt, pred = write_dir(tmp_path / "gt", gts), write_dir(tmp_path / "pred", preds)
    all_dets = run_kpi(gt, pred, frame_score_threshold=0.0)
    strict = run_kpi(gt, pred, frame_score_threshold=0.5)
    for name, e in all_dets["errors"].items():
        assert e["num_det"] == all_dets["classes"][name]["num_pred"]  # threshold 0: every detection
        assert e["ap"] == pytest.approx(all_dets["classes"][name]["ap"]["2.0"], abs=1e-12)
        assert strict["errors"][name]["num_det"] < e["num_det"]
        assert set(strict["by_range"]["0-20"]["errors"][name]["dap"]) == {
            "duplicate", "classification", "localization", "both", "background", "missed",
        }  # fmt: skip
    assert strict["params"]["frame_score_threshold"] == 0.5
    table = format_kpi_table(strict)
    assert "errors (score >= 0.5, d_fg 2 m, d_bg 4 m)" in table and "dAP (fixed)" in table


def test_cli_score_threshold(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from factory.cli import app

    gts, preds = random_detections(n_frames=3, gt_per_frame=6, pred_per_frame=12, seed=2)
    gt, pred = write_dir(tmp_path / "gt", gts), write_dir(tmp_path / "pred", preds)
    out = tmp_path / "k.json"
    args = ["kpi", "--gt", str(gt), "--pred", str(pred), "--out", str(out), "--frame-score-threshold", "0.6"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "errors (score >= 0.6" in res.output
    assert json.loads(out.read_text())["params"]["frame_score_threshold"] == 0.6
    res = CliRunner().invoke(app, [*args[:-1], "nan"])
    assert res.exit_code == 2 and "frame_score_threshold must be finite" in res.output
    # no second name that reads like evaluate.score_threshold (the detection threshold, another parameter)
    res = CliRunner().invoke(app, [*args[:-2], "--score-threshold", "0.6"])
    assert res.exit_code == 2 and "--score-threshold" in res.output


def _per_file(gt: Path, pred: Path) -> tuple[list[FrameDetections], list[FrameDetections]]:
    """The reference: every file through `load_kitti_frame`, ground truth first (the pre-columnar path)."""
    from pfactory.metrics.kpi_cli import DEFAULT_KITTI_CLASS_MAP as MAP
    from pfactory.metrics.kpi_cli import load_kitti_frame

    g = [load_kitti_frame(p, p.stem, MAP, with_score=False) for p in sorted(gt.glob("*.txt"))]
    return g, [load_kitti_frame(p, p.stem, MAP, with_score=True) for p in sorted(pred.glob("*.txt"))]


CAR = "Car 0 0 0 0 0 50 50 1.5 2 4 0 0.75 5 0"
ERROR_CASES = {  # (ground-truth files, result files): the first error is the per-file path's first error
    "GT size 0 before a later GT parse error": ([CAR, CAR.replace(" 2 4 ", " 2 0 "), CAR.replace(" 4 ", " x ")], [CAR + " 0.9"] * 3),
    "GT NaN before a negative score": ([CAR, CAR, CAR.replace("1.5", "nan")], [CAR + " -0.5"] * 3),
    "negative score, line 2": ([CAR] * 3, [CAR + " 0.9", CAR + " 0.9\n" + CAR + " -0.1", CAR + " 0.9"]),
    "result size 0": ([CAR] * 3, [CAR + " 0.9", CAR + " 0.9", CAR.replace("1.5", "0") + " 0.9"]),
    "15 columns in a result file": ([CAR] * 3, [CAR + " 0.9", CAR, CAR + " 0.9"]),
    "ignored types are not checked": ([CAR, "Van 0 0 0 0 0 50 50 0 0 0 0 0.75 5 0", CAR], [CAR + " 0.9"] * 3),
    "DontCare sentinels": (
        [CAR, "DontCare -1 -1 -10 503 169 590 190 -1 -1 -1 -1000 -1000 -1000 -10", CAR],
        ["Truck 0 0 0 0 0 50 50 1.5 2 4 0 0.75 5 0 -3", CAR + " 0.9", CAR + " 0.9"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_columnar_read_gives_the_per_file_results_and_errors(tmp_path: Path, case: str) -> None:
    gt_texts, pred_texts = ERROR_CASES[case]
    for folder, texts in (("gt", gt_texts), ("pred", pred_texts)):
        (tmp_path / folder).mkdir()
        for i, text in enumerate(texts):
            (tmp_path / folder / f"{i:06d}.txt").write_text(text + "\n")
    try:
        want = _per_file(tmp_path / "gt", tmp_path / "pred")
    except DatasetError as e:
        with pytest.raises(DatasetError) as got:
            run_kpi(tmp_path / "gt", tmp_path / "pred")
        assert str(got.value) == str(e)
        return
    from pfactory.metrics.kpi_cli import DEFAULT_KITTI_CLASS_MAP, _label_files, load_kitti_frames

    got = load_kitti_frames(
        _label_files(tmp_path / "gt", "", True),
        _label_files(tmp_path / "pred", "", False),
        DEFAULT_KITTI_CLASS_MAP,
    )
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        assert (
            a.frame_id == b.frame_id and np.array_equal(a.boxes, b.boxes) and list(a.names) == list(b.names)
        )
        assert (a.scores is None and b.scores is None) or np.array_equal(a.scores, b.scores)


def test_columnar_frames_equal_the_per_file_frames(tmp_path: Path) -> None:
    from pfactory.evaluate.predictions import write_kitti
    from pfactory.metrics.kpi_cli import DEFAULT_KITTI_CLASS_MAP, _label_files, load_kitti_frames

    gts, preds = random_detections(n_frames=30, gt_per_frame=8, pred_per_frame=15, seed=11)
    write_kitti(tmp_path / "gt", gts)  # the evaluate stage's writer: full-precision floats
    write_kitti(tmp_path / "pred", preds[:25])
    got = load_kitti_frames(
        _label_files(tmp_path / "gt", "", True),
        _label_files(tmp_path / "pred", "", False),
        DEFAULT_KITTI_CLASS_MAP,
    )
    want = _per_file(tmp_path / "gt", tmp_path / "pred")
    assert [len(x) for x in got] == [30, 25]
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        assert (
            a.frame_id == b.frame_id and np.array_equal(a.boxes, b.boxes) and list(a.names) == list(b.names)
        )
        assert (a.scores is None and b.scores is None) or np.array_equal(a.scores, b.scores)


def test_cli_honours_evaluate_overrides(tmp_path: Path) -> None:
    """`factory kpi -S evaluate.*` scores as the evaluate stage would with those params (it once validated
    the overrides and ignored them); an explicit --frame-score-threshold wins over params."""
    from typer.testing import CliRunner

    from factory.cli import app

    gts, preds = random_detections(n_frames=3, gt_per_frame=6, pred_per_frame=12, seed=2)
    gt, pred = write_dir(tmp_path / "gt", gts), write_dir(tmp_path / "pred", preds)
    out = tmp_path / "k.json"
    base = ["kpi", "--gt", str(gt), "--pred", str(pred), "--out", str(out)]
    res = CliRunner().invoke(app, [*base, "-S", "evaluate.frame_score_threshold=0.6", "-S", "evaluate.range_edges_m=[0,10]"])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["params"]["frame_score_threshold"] == 0.6
    assert doc["params"]["range_buckets_m"] == [[0.0, 10.0], [10.0, None]]  # JSON: an open last bucket
    res = CliRunner().invoke(app, [*base, "-S", "evaluate.frame_score_threshold=0.6", "--frame-score-threshold", "0.2"])
    assert res.exit_code == 0 and json.loads(out.read_text())["params"]["frame_score_threshold"] == 0.2, res.output
    res = CliRunner().invoke(app, [*base, "-S", "evaluate.frame_score_threshold=-1"])
    assert res.exit_code == 2 and "evaluate.frame_score_threshold" in res.output
