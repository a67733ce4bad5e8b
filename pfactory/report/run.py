"""Entry points of the run report: `factory report`, the evaluate stage's report, and its MLflow logging.

`make_report(source, out, vs, ...)`: `source` is an evaluation directory, an MLflow run (id or pipeline run
name) or `MODEL@ALIAS` / `MODEL/VERSION`; `vs` is `champion` (the registry's), `none`, or another run /
model / evaluation directory. The evaluate stage's own report is `pfactory.report.stage` (no champion: a
cached output depends only on its inputs). `log_report(report_dir, run_id)`: the one place the report goes
to MLflow (a pipeline's parent run: the flow logs it, compared with the champion; a lone `factory evaluate`:
its own run).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from pfactory.report.build import Report, write_report
from pfactory.report.inputs import Baseline, ReportError, ReportInputs, load_eval_dir, read_kpis, summary_of
from pfactory.report.sources import champion_baseline, load_run, mlflow_client
from pfactory.report.stage import log_report


def _tracking_available() -> bool:
    """A tracking server is configured, or the project's sqlite DB exists (never create an empty one)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return True
    from pfactory.runtime.project import project_root

    return (project_root() / "artifacts" / "mlflow" / "mlflow.db").is_file()


def _other_baseline(ref: str, default_model: str, workdir: Path, kpis: dict[str, Any]) -> Baseline:
    """`--vs RUN | MODEL@ALIAS | EVAL_DIR`: that evaluation's KPIs (with a note when its data differ)."""
    if Path(ref).is_dir():
        label, doc = f"evaluation {ref}", read_kpis(Path(ref) / "kpis.json")
    else:
        other = load_run(mlflow_client(), ref, workdir, default_model)
        label, doc = other.name, other.kpis
    from pfactory.promote.evidence import same_data

    mine, theirs = kpis.get("data") or {}, doc.get("data") or {}
    note = ""
    if not same_data(mine, theirs):
        note = (
            f"the baseline was evaluated on other data ({str(theirs.get('prepared_hash'))[:12]}..., split "
            f"{theirs.get('split')}, {theirs.get('frames')} frames): the deltas compare different frames"
        )
    return Baseline(label, summary_of(doc, ref), note)


def resolve_report(
    source: str,
    workdir: Path,
    vs: str = "champion",
    optimized: Path | None = None,
    prepared: Path | None = None,
    model_name: str = "pfactory-detector",
    alias: str = "champion",
) -> ReportInputs:
    """What the page shows, read now (module docstring): the source's evaluation and the baseline `vs` (the
    registry's champion as it is at this call). `workdir`: where runs and models are downloaded to."""
    if Path(source).is_dir():
        inputs = load_eval_dir(Path(source), optimized, prepared)
    else:
        inputs = load_run(mlflow_client(), source, workdir / "source", model_name, prepared)
    if vs == "champion":
        if _tracking_available():
            inputs.baseline = champion_baseline(
                mlflow_client(), inputs.kpis, model_name, alias, inputs.run_ids.get("pipeline")
            )
        if inputs.baseline is None:
            inputs.notes.append(f"no champion ({model_name}@{alias}) in the registry: no baseline deltas")
    elif vs != "none":
        inputs.baseline = _other_baseline(vs, model_name, workdir / "baseline", inputs.kpis)
    return inputs


def make_report(
    source: str,
    out: Path,
    vs: str = "champion",
    optimized: Path | None = None,
    prepared: Path | None = None,
    model_name: str = "pfactory-detector",
    alias: str = "champion",
    worst_n: int = 6,
) -> tuple[ReportInputs, Report]:
    """Resolve `source` and `vs` (`resolve_report`), build the page and write it to `out`."""
    with tempfile.TemporaryDirectory(prefix="pfactory-report-") as tmp:
        inputs = resolve_report(source, Path(tmp), vs, optimized, prepared, model_name, alias)
        report = write_report(inputs, out, worst_n)
    return inputs, report


__all__ = ["ReportError", "log_report", "make_report", "resolve_report"]
