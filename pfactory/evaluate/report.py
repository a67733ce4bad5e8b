"""The evaluate stage's reports: kpis.json content, KPI deltas, PR-curve plot data and PNG, and the MLflow
scalars. (The worst frames are drawn by the run report, pfactory.report: `report/worst/`.)

In:  `DetectionKpis` of the optimized model (and of the PyTorch reference), per-frame counts, frames.
Out: plain dicts / files, each written atomically:
    kpis_document(...)            the kpis.json dict (layout in docs/EVALUATE.md)
    kpi_delta(a, b)               a - b for mAP, NDS, and per class AP/mean AP/ATE/ASE/AOE, per range bucket
    write_pr_csv(folder, kpis)    `<class>.csv` (recall, precision, confidence at the TP threshold): DVC plots
    render_pr_png(path, kpis)     precision-recall per class, one line per distance threshold
    mlflow_scalars(document, ...) `eval/...` metric names (docs/EVALUATE.md)
    write_reports(...)            kpis.json, pr/, report/{pr_curves,per_frame}.json, pr.png of one evaluation
    write_timings(...)            report/timings.json: per task and per run
matplotlib is imported inside the renderers (Agg canvas, no pyplot state).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.metrics.detection import DetectionKpis
from pfactory.storage import artifacts as af
from pfactory.storage.fsutil import atomic_write_bytes, atomic_write_json, atomic_write_text

TP_KEYS = ("ate", "ase", "aoe")


def _diff(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return float(a) - float(b)


def _class_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"mAP": _diff(a["mAP"], b["mAP"]), "NDS": _diff(a["NDS"], b["NDS"]), "classes": {}}
    for name, ca in a["classes"].items():
        cb = b["classes"][name]
        out["classes"][name] = {
            "ap": {th: _diff(v, cb["ap"][th]) for th, v in ca["ap"].items()},
            "mean_ap": _diff(ca["mean_ap"], cb["mean_ap"]),
            **{k: _diff(ca[k], cb[k]) for k in TP_KEYS},
        }
    return out


def kpi_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """`a - b` (optimized minus reference) for the summary numbers, overall and per range bucket."""
    out = _class_delta(a, b)
    out["by_range"] = {k: _class_delta(v, b["by_range"][k]) for k, v in a.get("by_range", {}).items()}
    return out


def summary(kpis: DetectionKpis) -> dict[str, Any]:
    """The KPI summary without the evaluation params (those are stated once, at the top level)."""
    return {k: v for k, v in kpis.metrics.items() if k not in ("params", "latency")}


def kpis_document(
    optimized: DetectionKpis,
    reference: DetectionKpis | None,
    latency: dict[str, Any] | None,
    data: dict[str, Any],
    model: dict[str, Any],
) -> dict[str, Any]:
    """kpis.json: the optimized model's KPIs at the top (issue layout), then latency, reference, delta,
    data and model lineage. Nothing run-dependent (timings, paths of the run) so reruns are identical."""
    doc = summary(optimized)
    doc["params"] = optimized.metrics["params"]
    doc["latency"] = latency
    doc["reference"] = summary(reference) if reference is not None else None
    doc["delta"] = kpi_delta(doc, doc["reference"]) if reference is not None else None
    doc["data"] = data
    doc["model"] = model
    return doc


def write_pr_csv(folder: Path, kpis: DetectionKpis, threshold: str) -> list[Path]:
    """One `<class>.csv` per class: recall, precision, confidence (101 points) at distance `threshold`."""
    paths = []
    for name, by_th in kpis.pr_curves().items():
        c = by_th[threshold]
        rows = ["recall,precision,confidence"]
        rows += [f"{r!r},{p!r},{s!r}" for r, p, s in zip(c["recall"], c["precision"], c["confidence"])]
        paths.append(atomic_write_text(folder / f"{name}.csv", "\n".join(rows) + "\n"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", pil_kwargs={"compress_level": 3})
    return atomic_write_bytes(path, buf.getvalue())


def render_pr_png(path: Path, kpis: DetectionKpis, title: str) -> Path:
    """Precision vs recall per class (one panel each), one line per distance threshold, AP in the legend."""
    from matplotlib.figure import Figure

    curves = kpis.pr_curves()
    fig = Figure(figsize=(4 * len(curves), 3.6), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(curves), squeeze=False)[0]
    for ax, (name, by_th) in zip(axes, curves.items()):
        aps = kpis.metrics["classes"][name]["ap"]
        for th, c in by_th.items():
            ax.plot(c["recall"], c["precision"], label=f"{th} m: AP {aps[th]:.3f}")
        ax.set_title(name, fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("recall", fontsize=8)
        ax.set_ylabel("precision", fontsize=8)
        ax.legend(fontsize=7, loc="lower left")
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def mlflow_scalars(
    document: dict[str, Any], timings: dict[str, float], runs: dict[str, Any]
) -> dict[str, float]:
    """MLflow metrics of the stage (names in docs/EVALUATE.md)."""
    from pfactory.storage.artifacts import error_scalars, kitti_scalars, kpi_scalars

    out = kpi_scalars(document, prefix="eval/")
    out.update(error_scalars(document, prefix="eval/"))
    out.update(kitti_scalars(document))  # kitti/Car/3d/moderate, ... (KITTI data only)
    if document.get("reference") is not None:
        out.update(kpi_scalars(document["reference"], prefix="eval/reference/"))
        delta = document["delta"]
        out["eval/delta/mAP"] = delta["mAP"]
        out["eval/delta/NDS"] = delta["NDS"]
        for name, c in delta["classes"].items():
            out[f"eval/delta/{name}/mean_ap"] = c["mean_ap"]
            for th, v in c["ap"].items():
                out[f"eval/delta/{name}/ap_{th}"] = v
            for k in TP_KEYS:
                out[f"eval/delta/{name}/{k}"] = c[k]
    out["eval/frames"] = document["data"]["frames"]
    for kind, stats in runs.items():
        out[f"eval/{kind}/throughput_fps"] = stats["throughput_fps"]
        out[f"eval/{kind}/overhead_per_task_ms"] = stats["overhead_per_task_ms"]
    if "optimized" in runs:
        out["eval/throughput_fps"] = runs["optimized"]["throughput_fps"]
    out.update({f"time/{k}": v for k, v in timings.items()})
    return {k: float(v) for k, v in out.items() if v is not None and np.isfinite(v)}


def write_reports(ev: Any, inputs: Any, tmp: Path, doc: dict, kpis: Any, ref: Any) -> None:
    """kpis.json, pr/<class>.csv, report/{pr_curves,per_frame}.json and report/pr.png of one evaluation."""
    report = tmp / "report"
    atomic_write_json(tmp / af.KPIS, doc)
    atomic_write_json(tmp / af.EVAL_METRICS, af.headline(doc))  # what DVC shows; the detail is kpis.json
    tp_th = doc["params"]["dist_th_tp_m"]
    th_key = next(k for k in next(iter(doc["classes"].values()))["ap"] if float(k) == tp_th)
    write_pr_csv(tmp / "pr", kpis, th_key)
    atomic_write_json(
        report / "pr_curves.json",
        {"optimized": kpis.pr_curves(), "reference": ref.pr_curves() if ref else None},
    )
    atomic_write_json(
        report / "per_frame.json",
        {
            "optimized": kpis.per_frame,
            "reference": ref.per_frame if ref else None,
            "frame_score_threshold": ev.frame_score_threshold,
        },
    )
    render_pr_png(
        report / "pr.png", kpis, f"{inputs.optimized.name}: mAP {doc['mAP']:.4f}, NDS* {doc['NDS']:.4f}"
    )


def write_timings(tmp: Path, where: str, runs: dict, timings: dict, results: dict) -> None:
    units = [
        {"kind": kind, "unit": u, "frames": len(r.frame_ids), "worker": r.worker, "pid": r.pid,
         **{k: round(v, 6) for k, v in r.timings.items()}}
        for kind in ("optimized", "reference")
        for u, r in sorted(results[kind].items())
    ]  # fmt: skip
    atomic_write_json(
        tmp / "report" / "timings.json",
        {
            "cluster": where,
            "runs": runs,
            "timings_s": {k: round(v, 4) for k, v in timings.items()},
            "units": units,
        },
    )
