"""KPIs of an evaluation: both models' predictions, sorted by frame id, scored against the ground truth
(`pfactory.metrics.detection`) and assembled into the kpis.json document (`report.kpis_document`)."""

from __future__ import annotations

from typing import Any

from pfactory.evaluate.params import EvaluateParams
from pfactory.evaluate.report import kpis_document
from pfactory.metrics.detection import KpiParams, evaluate_detections

KINDS = ("optimized", "reference")


def score(ev: EvaluateParams, inputs: Any, results: dict[str, dict[int, Any]]) -> tuple:
    """KPIs of both models on the frames sorted by id (score ties then break the same way every run)."""
    opt = results["optimized"]
    missing = sorted(set(range(len(inputs.units))) - set(opt))
    if missing:  # cannot happen unless a result was dropped: refuse to score a partial split
        raise RuntimeError(f"evaluate: units {missing[:5]} returned no result")
    gt = sorted((f for r in opt.values() for f in r.gt), key=lambda f: f.frame_id)
    ids = [f.frame_id for f in gt]
    if len(ids) != inputs.frames or len(set(ids)) != len(ids):
        raise RuntimeError(
            f"evaluate: {len(ids)} frames ({len(set(ids))} distinct) came back, manifest.json lists {inputs.frames}"
        )
    kpi_params = KpiParams(
        classes=inputs.data.classes,
        range_buckets_m=ev.range_buckets_m,
        frame_score_threshold=ev.frame_score_threshold,
    )
    preds = {
        kind: sorted((f for r in results[kind].values() for f in r.pred), key=lambda f: f.frame_id)
        for kind in KINDS
        if results[kind]
    }
    kpis = evaluate_detections(gt, preds["optimized"], kpi_params, latency=inputs.latency)
    ref = evaluate_detections(gt, preds["reference"], kpi_params) if "reference" in preds else None
    data_info = {
        "prepared_hash": inputs.data_hash,
        "split": ev.split,
        "frames": inputs.frames,
        "shards": len(inputs.shards),
        "ground_truth_boxes": int(sum(len(f.boxes) for f in gt)),
    }
    doc = kpis_document(kpis, ref, inputs.latency, data_info, inputs.model_info)
    return doc, kpis, ref, gt, preds
