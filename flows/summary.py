"""The one-screen summary `factory run` prints: stages, KPIs, gates, where things are, how to look."""

from __future__ import annotations

import os
from typing import Any

from pfactory.tracking import redact_uri


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def render_summary(result: dict[str, Any], wall_s: float | None = None) -> Any:
    """A rich renderable of a `flows.pipeline.pipeline` result (`wall_s`: the command's own wall time)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [
        Text(f"run {result['run_id']}  (MLflow run {result.get('mlflow_run_id')})", style="bold")
    ]

    stages = Table(title="stages", title_justify="left")
    for col in ("stage", "wall s", "work s", "how"):
        stages.add_column(col)
    work = (result.get("orchestration") or {}).get("stage_work_s", {})
    for stage, r in result.get("stages", {}).items():
        stages.add_row(stage, _fmt(r.get("seconds"), 1), _fmt(work.get(stage), 1), r["how"])
    parts.append(stages)

    orch = result.get("orchestration") or {}
    if orch:
        line = (
            f"total {orch['total_s']:.1f} s in the flow; stage processes' start-up {orch['stage_startup_s']:.1f} s; "
            f"orchestration (Prefect + DVC + MLflow) {orch['orchestration_s']:.1f} s "
            f"= {100 * (orch.get('orchestration_fraction') or 0):.1f}%"
        )
        if wall_s is not None:
            outside = wall_s - sum(work.values()) - orch["stage_startup_s"]
            line += (
                f"\ncommand wall {wall_s:.1f} s, of which outside the stage processes (Prefect start-up "
                f"included) {outside:.1f} s = {100 * outside / wall_s:.1f}%"
            )
        parts.append(Text(line))

    start = result.get("startup") or {}
    if start.get("prefect_start_s") is not None:
        prefect = (
            "local Prefect API"
            if start.get("prefect") == "ephemeral"
            else f"Prefect API {start.get('prefect')}"
        )
        first = [k for k in ("prefect", "mlflow") if start.get(f"{k}_first_start")]
        parts.append(
            Text(
                f"services: {prefect} up in {start['prefect_start_s']:.1f} s, MLflow store in "
                f"{start.get('mlflow_start_s', 0):.1f} s"
                + (f" (first start: {' and '.join(first)} database created)" if first else "")
            )
        )

    kpis = result.get("kpis")
    if kpis:
        t = Table(title="KPIs (evaluate, val split)", title_justify="left")
        t.add_column("metric")
        t.add_column("value")
        t.add_row("mAP", _fmt(kpis.get("mAP")))
        t.add_row("NDS*", _fmt(kpis.get("NDS")))
        for c, ap in (kpis.get("classes") or {}).items():
            t.add_row(f"{c} mean AP", _fmt(ap))
        t.add_row("mAP delta vs PyTorch", _fmt(kpis.get("delta_mAP_vs_pytorch"), 4))
        parts.append(t)
    if "parity_passed" in result:
        parts.append(Text(f"parity gate (optimize): {'passed' if result['parity_passed'] else 'FAILED'}"))

    promo = result.get("promotion")
    if promo:
        t = Table(title=f"promotion: {promo.get('decision')}", title_justify="left")
        for col in ("gate", "value", "threshold", "passed", "margin"):
            t.add_column(col)
        for g in promo.get("gates", []):
            t.add_row(
                g["name"],
                _fmt(g.get("value")),
                _fmt(g.get("threshold")),
                str(g.get("passed")),
                _fmt(g.get("margin")),
            )
        parts.append(t)
        parts.append(
            Text(
                f"registered version {promo.get('version')}; champion {promo.get('champion_before')} -> "
                f"{promo.get('champion_after')}"
            )
        )

    ws = result.get("workspace", "")
    parts.append(
        Text(
            "where: workspace "
            f"{ws} (params.yaml, dvc.lock, artifacts/, logs/)\n"
            f"look:  mlflow ui --backend-store-uri {redact_uri(os.environ.get('MLFLOW_TRACKING_URI', ''))}\n"
            "       prefect server start   (flow runs; PREFECT_HOME is under artifacts/.state/prefect)\n"
            f"       cd {ws} && dvc metrics show && dvc plots show\n"
            f"       factory compare   |   factory lineage {result.get('registered_model', 'MODEL')}@champion"
        )
    )
    return Group(*parts)
