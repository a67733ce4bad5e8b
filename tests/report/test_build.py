"""The evaluate stage's report page (pfactory.report.build): self-contained, every section, the stage's numbers."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pfactory.metrics.detection import FrameDetections
from pfactory.metrics.errors import LABELS
from pfactory.report.build import build_report, calibration, worst_frames
from pfactory.report.inputs import ReportInputs, load_eval_dir
from tests.report.helpers import Page, external_references

SECTIONS = {"headline", "ranges", "errors", "pr", "worst", "calibration", "optimize"}


def test_stage_report_is_self_contained_and_complete(tracked_eval, report_html: Path) -> None:
    html = report_html.read_text()
    page = Page(html)
    assert external_references(html, page) == []
    assert page.ids() >= SECTIONS
    doc = tracked_eval["kpis"]
    text = page.all_text
    assert f"{doc['mAP']:.3f}" in text and f"{doc['NDS']:.3f}" in text
    # The per-class x range table: one column per bucket, the mean AP of the stage's kpis.json in each cell.
    ranges = page.table("grid")
    assert ranges[0] == ["class", "all ranges", "0-20 m", "20-40 m", "40+ m"]
    car = next(r for r in ranges if r[0] == "Car")
    assert car[1].startswith(f"{doc['classes']['Car']['mean_ap']:.3f}")
    assert car[2].startswith(f"{doc['by_range']['0-20']['classes']['Car']['mean_ap']:.3f}")
    # The error table: every class x range row carries the kpis.json counts.
    errors = page.table("errors")
    head = errors[0]
    for row in errors[1:]:
        blk = doc if row[1] == "all" else doc["by_range"][row[1]]
        e = blk["errors"][row[0]]
        assert [int(row[head.index(lbl)]) for lbl in LABELS] == [e[lbl] for lbl in LABELS], row
        assert int(row[head.index("missed")]) == e["missed"]
    assert len(errors) == 1 + 4 * len(doc["classes"])
    # Charts: inline SVG with readable text; one PR chart per class.
    svgs = [a for t, a in page.tags if t == "svg"]
    assert len(svgs) >= 3 + 3 + len(doc["classes"]) + 1
    assert "AP@2m gain if each error type were fixed" in text and "Score calibration" in text
    # Worst frames: a camera panel and a BEV per frame, real PNGs, also written to report/worst/.
    imgs = page.images()
    assert imgs and len(imgs) % 2 == 0
    sizes = [Image.open(io.BytesIO(b)).size for b in imgs]
    assert all(w > 300 and h > 100 for w, h in sizes)
    written = sorted((report_html.parent / "worst").glob("*.png"))
    assert len(written) == len(imgs) and {p.read_bytes() for p in written} == set(imgs)
    assert any(p.name.endswith("_image_2.png") for p in written) and any(
        p.name.endswith("_bev.png") for p in written
    )
    # Optimize: the parity verdict and the latency table of the optimize stage's files.
    parity = json.loads((tracked_eval["optimized"] / "parity.json").read_text())
    assert f"Parity vs PyTorch: {'passed' if parity['passed'] else 'FAILED'}" in text
    assert "onnxruntime/fp32" in text and "p99 ms" in text
    # The stage's report has no champion baseline (a cached output depends only on its inputs): said so.
    assert "Baseline: none (no champion comparison in the evaluate stage's report" in text
    assert "`factory report` and the pipeline run's report compare with the registry's current champion" in text


def test_report_is_reproducible(tracked_eval, tmp_path: Path) -> None:
    """Same evaluation, same bytes (no clock in the page); the numbers recomputed equal kpis.json."""
    inputs = load_eval_dir(tracked_eval["eval"])
    a, b = build_report(inputs), build_report(inputs)
    assert a.html == b.html
    assert "recomputed from predictions.parquet" not in a.html
    assert inputs.prepared is not None and inputs.parity is not None and inputs.latency is not None


def _frames(n_gt: list[int], scores: list[list[float]], n_found: list[int]):
    """Cars 10 m apart on the x axis; the first `n_found` detections of a frame 0.3 m from their car, the
    others 500 m away (background)."""
    gts, preds = [], []
    for f, (k, ss, found) in enumerate(zip(n_gt, scores, n_found)):
        boxes = np.array([[10.0 * j, 0, 0, 4, 2, 1.5, 0] for j in range(k)]).reshape(-1, 7)
        gts.append(FrameDetections(f"{f:03d}", boxes, ["Car"] * k))
        xs = [10.0 * j + (0.3 if j < found else 500) for j in range(len(ss))]
        pb = np.array([[x, 0, 0, 4, 2, 1.5, 0] for x in xs]).reshape(-1, 7)
        preds.append(FrameDetections(f"{f:03d}", pb, ["Car"] * len(ss), ss))
    return gts, preds


def test_worst_frames_and_calibration_by_hand() -> None:
    from pfactory.metrics.detection import KpiParams, evaluate_detections

    # Frame 0: 2 GT, found both; frame 1: 3 GT, one found + 2 background; frame 2: 1 GT missed.
    gts, preds = _frames([2, 3, 1], [[0.95, 0.85], [0.9, 0.15, 0.35], []], [2, 1, 0])
    params = KpiParams(classes=("Car",), range_buckets_m=(), frame_score_threshold=0.3)
    kpis = evaluate_detections(gts, preds, params)
    worst = worst_frames(kpis, 5)
    # Frame 1: 1 background + 2 missed; frame 2: 1 missed; frame 0 has no error.
    assert [(w["frame_id"], w["errors"]) for w in worst] == [("001", 3), ("002", 1)]
    # A tie goes to the smaller frame id, whatever the input order.
    tie_g, tie_p = _frames([1, 1, 2], [[], [], [0.9, 0.8]], [0, 0, 2])
    tied = worst_frames(evaluate_detections(tie_g[::-1], tie_p[::-1], params), 5)
    assert [w["frame_id"] for w in tied] == ["000", "001"]
    assert worst[0]["background"] == 1 and worst[0]["missed"] == 2  # the 0.15 detection is below 0.3
    cal = calibration(
        evaluate_detections(gts, preds, KpiParams(classes=("Car",), range_buckets_m=(), frame_score_threshold=0)),
        ["Car"],
    )
    bins = {round(r["lo"], 1): r for r in cal["all"]["bins"] if r["n"]}
    assert bins[0.9]["n"] == 2 and bins[0.9]["precision"] == 1.0  # 0.95 and 0.9: both tp
    assert bins[0.1]["precision"] == 0.0 and bins[0.3]["precision"] == 0.0  # background at 0.15 and 0.35
    assert bins[0.8]["precision"] == 1.0
    # ECE: |1 - 0.925| * 2/5 + |1 - 0.85| * 1/5 + |0 - 0.15| * 1/5 + |0 - 0.35| * 1/5
    assert cal["all"]["ece"] == pytest.approx((0.075 * 2 + 0.15 + 0.15 + 0.35) / 5)
    assert cal["Car"]["ece"] == cal["all"]["ece"]


def test_report_without_optional_inputs(tmp_path: Path) -> None:
    """No optimize files, no prepared data, no champion: the page still builds and says what is missing."""
    gts, preds = _frames([2, 1], [[0.9, 0.2], [0.8]], [2, 1])
    from pfactory.metrics.detection import KpiParams, evaluate_detections

    params = KpiParams(classes=("Car",))
    doc = evaluate_detections(gts, preds, params).metrics
    doc["data"] = {"split": "val", "frames": 2, "prepared_hash": "0" * 64}
    html = build_report(ReportInputs("bare", doc, gts, preds, notes=["nothing else was given"])).html
    page = Page(html)
    assert page.ids() >= SECTIONS and external_references(html, page) == []
    assert "No optimize stage output found" in page.all_text and "nothing else was given" in page.all_text
    assert "not drawn: no prepared data" in page.all_text
