"""KPIs of an evaluation: both models' predictions, sorted by frame id, scored against the ground truth
(`pfactory.metrics.detection`) and assembled into the kpis.json document (`report.kpis_document`).

The boxes are read back from the Parquet parts the driver wrote as the units landed (`columns.SplitBoxes`),
one kind at a time: the driver holds no detections while the models run.
"""

from __future__ import annotations

from typing import Any

from pfactory.evaluate.columns import FrameList, SplitBoxes, flat_pair
from pfactory.evaluate.params import EvaluateParams
from pfactory.evaluate.report import kpis_document
from pfactory.metrics.detection import KpiParams, evaluate_flat

KINDS = ("optimized", "reference")


def score(ev: EvaluateParams, inputs: Any, results: dict[str, dict[int, Any]], parts: Any) -> tuple:
    """KPIs of both models on the frames sorted by id (score ties then break the same way every run).

    In: `results[kind][unit]` with each unit's `frame_ids` (what the driver keeps), `parts` the
    `predictions.PartWriter` holding every unit's ground truth and predictions. Out: `(doc, kpis, ref_kpis,
    gt, preds)`: the kpis.json document, the `DetectionKpis` of the optimized model and of the reference
    (None without one), the ground truth and `{kind: predictions}` as `FrameList`s (frames sorted by id,
    each built when read)."""
    opt = results["optimized"]
    missing = sorted(set(range(len(inputs.units))) - set(opt))
    if missing:  # cannot happen unless a result was dropped: refuse to score a partial split
        raise RuntimeError(f"evaluate: units {missing[:5]} returned no result")
    ids = [f for r in opt.values() for f in r.frame_ids]
    if len(ids) != inputs.frames or len(set(ids)) != len(ids):
        raise RuntimeError(
            f"evaluate: {len(ids)} frames ({len(set(ids))} distinct) came back, manifest.json lists {inputs.frames}"
        )
    kpi_params = KpiParams(
        classes=inputs.data.classes,
        range_buckets_m=ev.range_buckets_m,
        frame_score_threshold=ev.frame_score_threshold,
    )
    gt = SplitBoxes.read(parts, "ground_truth", ids)
    preds: dict[str, FrameList] = {}
    kpis = ref = None
    for kind in KINDS:
        if not results[kind]:
            continue
        boxes = SplitBoxes.read(parts, kind, [f for r in results[kind].values() for f in r.frame_ids])
        k = evaluate_flat(*flat_pair(gt, boxes, kpi_params.classes), kpi_params,
                          latency=inputs.latency if kind == "optimized" else None)  # fmt: skip
        if kind == "optimized":
            kpis = k
            preds[kind] = boxes.frames()
        else:
            ref = k  # the reference's boxes are not kept: nothing after the KPIs reads them
    assert kpis is not None
    data_info = {
        "prepared_hash": inputs.data_hash,
        "split": ev.split,
        "frames": inputs.frames,
        "shards": len(inputs.shards),
        "ground_truth_boxes": len(gt.boxes),
    }
    doc = kpis_document(kpis, ref, inputs.latency, data_info, inputs.model_info)
    return doc, kpis, ref, gt.frames(), preds
