"""KPI deltas, worst-frame choice and the MLflow metric names, on KPIs of random detections."""

from __future__ import annotations

import numpy as np
import pytest

from pfactory.evaluate.report import kpi_delta, kpis_document, mlflow_scalars
from pfactory.metrics.detection import KpiParams, evaluate_detections
from pfactory.metrics.synthetic import random_detections


def _kpis(seed: int):
    gts, preds = random_detections(12, gt_per_frame=6, pred_per_frame=10, seed=seed)
    return evaluate_detections(gts, preds, KpiParams())


def test_delta_is_optimized_minus_reference_everywhere() -> None:
    a, b = _kpis(0), _kpis(1)
    doc = kpis_document(a, b, None, {"frames": 12}, {})
    d = doc["delta"]
    assert d["mAP"] == pytest.approx(a.metrics["mAP"] - b.metrics["mAP"])
    assert d["NDS"] == pytest.approx(a.metrics["NDS"] - b.metrics["NDS"])
    for name, c in d["classes"].items():
        ca, cb = a.metrics["classes"][name], b.metrics["classes"][name]
        assert c["ap"]["2.0"] == pytest.approx(ca["ap"]["2.0"] - cb["ap"]["2.0"])
        assert c["aoe"] == pytest.approx(ca["aoe"] - cb["aoe"])
    assert d["by_range"]["40+"]["mAP"] == pytest.approx(
        a.metrics["by_range"]["40+"]["mAP"] - b.metrics["by_range"]["40+"]["mAP"]
    )
    assert kpi_delta(doc, doc)["mAP"] == 0.0
    assert "params" not in doc["reference"] and doc["params"]["dist_th_tp_m"] == 2.0


def test_mlflow_names() -> None:
    a, b = _kpis(2), _kpis(3)
    doc = kpis_document(a, b, None, {"frames": 12}, {})
    runs = {"optimized": {"throughput_fps": 10.0, "overhead_per_task_ms": 1.5}}
    s = mlflow_scalars(doc, {"total_s": 3.0}, runs)
    for name in ("eval/mAP", "eval/NDS", "eval/Car/ap_2.0", "eval/0-20/mAP", "eval/40-inf/Car/ate",
                 "eval/reference/mAP", "eval/delta/mAP", "eval/delta/Car/mean_ap", "eval/throughput_fps",
                 "eval/optimized/overhead_per_task_ms", "eval/frames", "time/total_s"):  # fmt: skip
        assert name in s, name
    assert all(np.isfinite(v) for v in s.values())
    assert s["eval/delta/mAP"] == pytest.approx(s["eval/mAP"] - s["eval/reference/mAP"])
