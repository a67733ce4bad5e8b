"""KPIs: 3D detection metrics with nuScenes semantics (`detection`), and the KITTI-file front end
behind `factory kpi` (`kpi_cli.run_kpi`, imported lazily by the CLI)."""

from pfactory.metrics.detection import (
    DetectionKpis,
    FrameDetections,
    KpiParams,
    MetricCurves,
    calc_ap,
    calc_tp,
    evaluate_detections,
)

__all__ = [
    "DetectionKpis",
    "FrameDetections",
    "KpiParams",
    "MetricCurves",
    "calc_ap",
    "calc_tp",
    "evaluate_detections",
]
