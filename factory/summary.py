"""The one-screen summary `factory run` prints: stages, KPIs, gates, where things are, how to look."""

from __future__ import annotations

import os
from typing import Any

from flows.failure import openable
from pfactory.tracking.runs import redact_uri, runs_table_url


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def where_and_look(result: dict[str, Any]) -> str:
    """Where the run's files are and the commands to look at it, one command per line (none longer than it
    must be: paths relative to the cwd), so a narrow terminal wraps a line, never a command in two."""
    ws = openable(result.get("workspace", ""))
    state = openable(os.environ.get("PREFECT_HOME", "artifacts/.state/prefect"))
    exp = result.get("experiment")
    lines = [f"where: workspace {ws}", "  (params.yaml, dvc.lock, artifacts/, logs/)"]
    if result.get("checked_out"):
        lines.append("  its outputs are also at the project's paths: follow-up commands use them")
    cache = result.get("cache") or {}
    if cache.get("dir"):  # links into the cache, not copies (pfactory/storage/dvccache.py); `factory disk` / `factory gc`
        lines.append(f"  DVC cache {openable(cache['dir'])} ({cache.get('link_types')}: outputs are links into it)")
    pushed = result.get("pushed")
    if pushed:
        lines.append(f"  dvc push to {pushed['remote']}: " + ("done" if pushed["ok"] else f"FAILED ({pushed['detail']})"))
    gc = result.get("gc")
    if gc:
        lines.append(
            f"  gc: {len(gc.get('runs_removed', []))} runs removed, {gc.get('freed_bytes', 0) / 2**20:.1f} MiB freed"
            if gc.get("ok") else f"  gc after the run FAILED: {gc.get('error')}"
        )  # fmt: skip
    uri = redact_uri(os.environ.get("MLFLOW_TRACKING_URI", ""))
    if uri.startswith("sqlite:///"):
        uri = "sqlite:///" + openable(uri.removeprefix("sqlite:///"))
    lines += [
        "look:",
        f"  mlflow ui --backend-store-uri {uri}",
        # MLflow 3's UI opens in its GenAI view unless told (a browser setting): this link opens the runs
        # table with the KPI columns
        f"    then {runs_table_url(result.get('mlflow_experiment_id', ''))}",
        f"  PREFECT_HOME={state} prefect server start",
    ]
    if exp:
        lines += [
            "  dvc exp show --only-changed --drop '/'",
            f"  dvc exp apply {exp['name']}",
            f"  dvc metrics diff {exp['name']} <other run>",
        ]
    else:
        lines.append("  (not a DVC experiment: the project has no git commit; `git init && git add -A && git commit`)")
        lines.append(f"  cd {ws} && dvc metrics show")
    lines += ["  dvc plots show --open", "  factory compare", f"  factory lineage {result.get('registered_model', 'MODEL')}@champion"]
    return "\n".join(lines)


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
    lineage = result.get("lineage") or {}
    for stage, r in result.get("stages", {}).items():
        how = r["how"]
        by = (lineage.get(stage) or {}).get("computed_by")
        if how != "ran" and by:  # restored from a cache another run (maybe another clone) filled
            how += f" (from {by.split(' (')[0]})"
        stages.add_row(stage, _fmt(r.get("seconds"), 1), _fmt(work.get(stage), 1), how)
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
    if promo:  # the same table as `factory promote` (one renderer)
        from pfactory.promote.report import promotion_view

        parts.append(promotion_view(promo))

    return Group(*parts)


def print_summary(result: dict[str, Any], wall_s: float | None = None, console: Any = None) -> None:
    """Print the summary, then the where/look lines with soft wrapping: rich never breaks a command in two
    (a narrow terminal wraps the long line itself, and a copy of it stays one command)."""
    from rich.console import Console

    console = console or Console()
    console.print(render_summary(result, wall_s))
    console.print(where_and_look(result), soft_wrap=True, highlight=False, markup=False)
