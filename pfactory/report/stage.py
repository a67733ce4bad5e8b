"""The evaluate stage's own run report, and the one place a report goes to MLflow.

`write_stage_report(...)`: `report/report.html` and `report/worst/*.png` from what the stage has in memory,
with no baseline (a DVC-cached output depends only on its declared inputs, and the registry's champion is
not one of them: `factory report` and the pipeline's parent run compare with the champion as it is then).
`log_report(report_dir, run_id)`: the page and its PNGs to an MLflow run. Nothing of the registry is
imported here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pfactory.metrics.detection import FrameDetections
from pfactory.report.build import write_report
from pfactory.report.frames import write_pngs
from pfactory.report.inputs import ReportInputs

NO_CHAMPION = (
    "no champion comparison in the evaluate stage's report (a cached output depends only on its inputs): "
    "`factory report` and the pipeline run's report compare with the registry's current champion"
)


def write_stage_report(
    report_dir: Path,
    doc: dict[str, Any],
    gt: Sequence[FrameDetections],
    pred: Sequence[FrameDetections],
    optimized: Path,
    prepared: Path,
    worst_n: int,
) -> Path:
    """The evaluate stage's report: `report_dir/report.html` and the panels in `report_dir/worst/`.

    No baseline: the stage's outputs are a function of its declared inputs (DVC caches them), and the
    registry's champion is not one of them; the comparison is made where the champion is current."""
    from pfactory.prepare.shards import open_prepared
    from pfactory.promote.evidence import read_json

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
    inputs.no_baseline = "no champion comparison in the evaluate stage's report: a cached output"
    inputs.notes.append(NO_CHAMPION)
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


