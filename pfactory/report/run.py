"""Entry points of the run report: `factory report`, the evaluate stage's report, and its MLflow logging.

`make_report(source, out, vs, ...)`: `source` is an evaluation directory, an MLflow run (id or pipeline run
name) or `MODEL@ALIAS` / `MODEL/VERSION`; `vs` is `champion` (the registry's), `none`, or another run /
model / evaluation directory. `write_stage_report(...)`: the evaluate stage's `report/report.html` and
`report/worst/*.png`, from what the stage has in memory. `log_report(report_dir, run_id)`: the one place the
report goes to MLflow (a pipeline's parent run: the flow logs it; a lone `factory evaluate`: its own run).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pfactory.metrics.detection import FrameDetections
from pfactory.report.build import Report, write_report
from pfactory.report.frames import write_pngs
from pfactory.report.inputs import (
    Baseline,
    ReportError,
    ReportInputs,
    champion_baseline,
    load_eval_dir,
    load_run,
    mlflow_client,
    read_kpis,
    summary_of,
)


def _tracking_available() -> bool:
    """A tracking server is configured, or the project's sqlite DB exists (never create an empty one)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return True
    from pfactory.tracking import project_root

    return (project_root() / "artifacts" / "mlflow" / "mlflow.db").is_file()


def _other_baseline(ref: str, default_model: str, workdir: Path, kpis: dict[str, Any]) -> Baseline:
    """`--vs RUN | MODEL@ALIAS | EVAL_DIR`: that evaluation's KPIs (with a note when its data differ)."""
    if Path(ref).is_dir():
        label, doc = f"evaluation {ref}", read_kpis(Path(ref) / "kpis.json")
    else:
        other = load_run(mlflow_client(), ref, workdir, default_model)
        label, doc = other.name, other.kpis
    from pfactory.registry.evidence import same_data

    mine, theirs = kpis.get("data") or {}, doc.get("data") or {}
    note = ""
    if not same_data(mine, theirs):
        note = (
            f"the baseline was evaluated on other data ({str(theirs.get('prepared_hash'))[:12]}..., split "
            f"{theirs.get('split')}, {theirs.get('frames')} frames): the deltas compare different frames"
        )
    return Baseline(label, summary_of(doc, ref), note)


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
    """Resolve `source` and `vs` (module docstring), build the page and write it to `out`."""
    with tempfile.TemporaryDirectory(prefix="pfactory-report-") as tmp:
        if Path(source).is_dir():
            inputs = load_eval_dir(Path(source), optimized, prepared)
        else:
            inputs = load_run(mlflow_client(), source, Path(tmp) / "source", model_name, prepared)
        if vs == "champion":
            if _tracking_available():
                inputs.baseline = champion_baseline(
                    mlflow_client(), inputs.kpis, model_name, alias, inputs.run_ids.get("pipeline")
                )
            if inputs.baseline is None:
                inputs.notes.append(f"no champion ({model_name}@{alias}) in the registry: no baseline deltas")
        elif vs != "none":
            inputs.baseline = _other_baseline(vs, model_name, Path(tmp) / "baseline", inputs.kpis)
        report = write_report(inputs, out, worst_n)
    return inputs, report


def write_stage_report(
    report_dir: Path,
    doc: dict[str, Any],
    gt: Sequence[FrameDetections],
    pred: Sequence[FrameDetections],
    optimized: Path,
    prepared: Path,
    worst_n: int,
    champion: tuple[str, str] | None = None,
) -> Path:
    """The evaluate stage's report: `report_dir/report.html` and the panels in `report_dir/worst/`.

    `champion` = (registered model, alias): compare against it when tracking is on (a failed registry
    lookup becomes a note on the page, never a failed stage)."""
    from pfactory.data.shards import open_prepared
    from pfactory.registry.evidence import read_json

    inputs = ReportInputs(
        name=f"evaluation of {(doc.get('model') or {}).get('artifact', optimized)}",
        kpis=doc,
        gt=list(gt),
        pred=list(pred),
        provenance=[("optimized", str(optimized)), ("prepared data", str(prepared))],
        prepared=open_prepared(prepared),
    )
    parent = os.environ.get("PFACTORY_PARENT_RUN_ID")
    if parent:
        inputs.provenance.insert(0, ("pipeline run", parent))
    for fname, attr in (("parity.json", "parity"), ("latency.json", "latency")):
        if (optimized / fname).is_file():
            setattr(inputs, attr, read_json(optimized / fname, f"the optimize stage's {fname}"))
    if champion is not None:
        try:
            inputs.baseline = champion_baseline(mlflow_client(), doc, *champion, parent)
        except Exception as e:  # the report explains; the stage's job (the KPIs) is done
            inputs.notes.append(f"champion lookup failed ({type(e).__name__}: {e}): no baseline deltas")
        if inputs.baseline is None and not inputs.notes:
            inputs.notes.append(
                f"no champion ({champion[0]}@{champion[1]}) in the registry yet: no baseline deltas"
            )
    report = write_report(inputs, report_dir / "report.html", worst_n)
    if report.worst:
        write_pngs(report_dir / "worst", report.worst)
    return report_dir / "report.html"


REPORT_SUFFIXES = (".html", ".png", ".svg")
MAX_IMAGES = 8


def log_report(report_dir: Path, run_id: str | None = None, client: Any = None) -> list[str]:
    """Log an evaluation's report folder (`eval/report/`: report.html, pr.png, worst/*.png) to MLflow run
    `run_id` (else the active run) of `client`'s store (else the current tracking URI) under `report/`, the PNGs also as MLflow images (keys `pr_curves`,
    `worst_frames_bev`: the run page's image grid); returns the artifact paths logged.

    The one owner of the report's place in MLflow: a pipeline's parent run gets it from the flow
    (`flows/parent_run.py`, also when evaluate was restored from DVC's run-cache), a lone `factory evaluate`
    from the stage itself (`pfactory/evaluate/evaluation.py`)."""
    import mlflow
    from PIL import Image

    report_dir = Path(report_dir)
    if not report_dir.is_dir():
        return []
    client = client or mlflow.MlflowClient()
    run_id = run_id or mlflow.active_run().info.run_id
    files = [p for p in sorted(report_dir.rglob("*")) if p.is_file() and p.suffix.lower() in REPORT_SUFFIXES]
    logged: list[str] = []
    for p in files:
        rel = p.relative_to(report_dir)
        folder = "report" + (f"/{rel.parent.as_posix()}" if rel.parent != Path(".") else "")
        client.log_artifact(run_id, str(p), folder)
        logged.append(f"{folder}/{p.name}")
    pngs = [p for p in files if p.suffix.lower() == ".png"][:MAX_IMAGES]
    for step, p in enumerate(pngs):
        with Image.open(p) as im:
            key = "pr_curves" if p.name.startswith("pr") else "worst_frames_bev"
            client.log_image(run_id, im.convert("RGB"), key=key, step=step, synchronous=True)
    return logged


__all__ = ["ReportError", "log_report", "make_report", "write_stage_report"]
