"""The `evaluate` stage: an optimized detector (and its PyTorch checkpoint) over a prepared split on Dask -> KPIs.

Files in:  `optimized` (`paths.optimized`: backend.json + artifacts, latency.json), `model` (`paths.model`,
           optional: the PyTorch reference), `data` (`paths.prepared`: the `evaluate.split` shards).
Files out (`out` = `paths.eval`, built in a temporary sibling and renamed into place on success):
    kpis.json                     DVC metrics: mAP, NDS, per class / range, latency, reference, delta, lineage
    pr/<class>.csv                DVC plots: precision-recall at the 2 m threshold (101 points)
    report/predictions.parquet    every GT / optimized / reference box, sorted (pfactory.evaluate.predictions)
    report/kitti/{ground_truth,optimized,reference}/<frame_id>.txt   KITTI label / result files (calibration-free)
    kitti_results/<frame_id>.txt, kitti_frames.txt   KITTI data (manifest's raw / --raw): result files the KITTI
                                  evaluator accepts, in the frame's own camera frame (pfactory.evaluate.kitti_results)
    report/results_nusc.json      nuScenes data only: the optimized model's detections as a nuScenes detection
                                  submission (pfactory.evaluate.nusc_submission), global frame from `raw`'s tables
    report/per_frame.json         TP/FP/FN per frame and class (error analysis), both models
    report/pr_curves.json         PR curves of every class and distance threshold, both models
    report/pr.png                 PR curves
    report/report.html, report/worst/NN_<frame_id>_<panel>.png   the run report (pfactory.report) and its worst
                                  frames (camera + BEV, error labels)
    report/timings.json           per task: worker, pid, load/read/infer seconds; per run: throughput, overhead
Metrics back: flat dict with mAP, NDS, reference_mAP, delta_mAP, frames, data_hash, kpis_path, throughput and
the MLflow scalars (`eval/...`, `time/...`; docs/EVALUATE.md). The work: `pfactory.evaluate.evaluation`.

Run: `python -m tasks.evaluate [-S evaluate.workers=2 ...]` (DVC; paths from params.yaml) or
`factory evaluate --model OPTIMIZED --data PREPARED --out DIR [--reference MODEL] [--dask ADDRESS|local:N]`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks._command import DASK_HELP, Command, Option

STAGE = "evaluate"


def sections() -> Mapping[str, type]:
    """What this stage reads of params.yaml (besides `paths`)."""
    from pfactory.evaluate.params import EvaluateParams

    return {"evaluate": EvaluateParams}


def run(
    params: Any,
    optimized: Path,
    model: Path | None,
    data: Path,
    out: Path,
    dask_address: str | None = None,
    track: bool = True,
    progress: bool | None = None,
    raw: Path | None = None,
) -> dict[str, Any]:
    """Evaluate `optimized` (and `model`, the PyTorch reference, unless None) on `data`; build `out`.

    `dask_address`: None -> `evaluate.dask_address` -> a LocalCluster of `evaluate.workers`; "local:N"; or a
    scheduler address. `track`: one MLflow run (`pfactory.tracking.runs.stage_run`). `progress`: a rich bar on
    stderr (None = when stderr is a terminal). `raw`: the raw dataset of `data` (None: the one its manifest
    names, `pfactory.evaluate.evaluation.open_raw`); KITTI data also gets KITTI result files and KITTI's
    official metric (pfactory.evaluate.kitti_results); for nuScenes data its tables place
    `report/results_nusc.json` in the global frame. Raises `EvaluateInputError` on a bad input (before any
    work starts), `EvaluateTaskError` when a unit fails on a worker.
    """
    from pfactory.config.section import section_of
    from pfactory.evaluate.evaluation import evaluate
    from pfactory.evaluate.params import EvaluateParams
    from pfactory.runtime.project import configure_environment
    from pfactory.storage import artifacts as af
    from pfactory.storage.fsutil import check_output_dir

    ev = section_of(params, STAGE, EvaluateParams)
    check_output_dir(out, STAGE, (optimized, model, data))  # refuse a foreign --out before any work
    configure_environment()  # Dask scratch inside the project, offline MLflow
    address = dask_address or ev.dask_address
    if progress is None:
        progress = sys.stderr.isatty()
    args = (ev, Path(optimized), None if model is None else Path(model), Path(data), Path(out), address, progress)
    from pfactory.report.stage import log_report, write_stage_report

    if not track:
        return evaluate(*args, None, write_stage_report, raw=raw)
    from pfactory.tracking.runs import stage_run

    with stage_run(STAGE, ev.model_dump(mode="json")) as active:
        metrics = evaluate(*args, active, write_stage_report, raw=raw)
        if not os.environ.get("PFACTORY_PARENT_RUN_ID"):  # a lone evaluation: its own run shows the report
            log_report(Path(out) / af.REPORT_DIR)  # (under a pipeline the flow logs it to the parent run)
        return metrics


def body(p: Any, o: Any) -> dict:
    """The stage's work (`tasks._stage.run_stage`); `o`: the values of `COMMAND.options`.
    Bad inputs (EvaluateInputError): a usage error, nothing ran. A unit failed on a worker (EvaluateTaskError):
    it ran and failed. Each error class carries its exit code."""
    from pfactory.storage import artifacts as af

    ref = None if o.no_reference else o.reference or Path(p.paths.model)
    if ref is not None and o.reference is None and not (ref / af.WEIGHTS).is_file():
        ref = None  # the default reference is optional; an explicit --reference must exist
    metrics = run(
        p, o.model or Path(p.paths.optimized), ref, o.data or Path(p.paths.prepared),
        o.out or Path(p.paths.eval), dask_address=o.dask, track=not o.no_track, raw=o.raw,
    )  # fmt: skip
    if o.summary:
        import json

        from pfactory.metrics.kpi_cli import format_kpi_table

        print(format_kpi_table(json.loads(Path(metrics["kpis_path"]).read_text())), file=sys.stderr)
    return metrics


COMMAND = Command(
    STAGE,
    "Run the optimized detector (and its PyTorch checkpoint) over a prepared split on Dask; write KPIs.\n\n"
    "Exit 1 when a work unit fails or the scheduler cannot be reached, 2 on bad inputs.\n"
    "Example: factory evaluate --model artifacts/optimized --data artifacts/prepared --out artifacts/eval "
    "--dask local:2",
    (
        Option("model", "Optimized model directory (backend.json). Default: paths.optimized.", Path),
        Option("data", "Prepared shards. Default: paths.prepared.", Path),
        Option("out", "Output directory. Default: paths.eval.", Path),
        Option("reference", "Trained PyTorch model directory for the KPI delta. Default: paths.model, if it "
               "holds a model.", Path),
        Option("no_reference", "Skip the PyTorch reference.", bool, False),
        Option("dask", DASK_HELP.format(key="evaluate.dask_address")),
        Option("no_track", "Do not open an MLflow run.", bool, False),
        Option("raw", "Raw dataset of --data (KITTI: KITTI's metric + result files; nuScenes: results_nusc.json). "
               "Default: the one --data's manifest names, if unchanged.", Path),
        Option("summary", "Print the KPI table on stderr.", bool, True),
    ),
    body,
    sections,
)


def main(argv: list[str] | None = None) -> None:
    """`python -m tasks.evaluate [options of COMMAND] [-S k=v ...]` (= `factory evaluate`; paths.* defaults)."""
    from tasks._stage import stage_main

    stage_main(COMMAND, argv)


if __name__ == "__main__":
    main()
