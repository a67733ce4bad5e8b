"""The `evaluate` stage: an optimized detector (and its PyTorch checkpoint) over a prepared split on Dask -> KPIs.

Files in:  `optimized` (`paths.optimized`: backend.json + artifacts, latency.json), `model` (`paths.model`,
           optional: the PyTorch reference), `data` (`paths.prepared`: the `evaluate.split` shards).
Files out (`out` = `paths.eval`, built in a temporary sibling and renamed into place on success):
    kpis.json                     DVC metrics: mAP, NDS, per class / range, latency, reference, delta, lineage
    pr/<class>.csv                DVC plots: precision-recall at the 2 m threshold (101 points)
    report/predictions.parquet    every GT / optimized / reference box, sorted (pfactory.evaluate.predictions)
    report/kitti/{ground_truth,optimized,reference}/<frame_id>.txt   KITTI label / result files (calibration-free)
    kitti_results/<frame_id>.txt, kitti_frames.txt   KITTI data (paths.raw / --raw): result files the KITTI
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
from pathlib import Path
from typing import Any

from pfactory import artifacts as af
from pfactory.evaluate.params import EvaluateParams
from pfactory.section import section_of

SECTIONS = {"evaluate": EvaluateParams}  # what this stage reads of params.yaml (besides `paths`)

STAGE = "evaluate"


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
    scheduler address. `track`: one MLflow run (`pfactory.tracking.stage_run`). `progress`: a rich bar on
    stderr (None = when stderr is a terminal). `raw`: the raw dataset of `data`; KITTI data also gets KITTI
    result files and KITTI's official metric (pfactory.evaluate.kitti_results); for
    nuScenes data its tables place `report/results_nusc.json` in the global frame. Raises `EvaluateInputError` on a bad input (before any
    work starts), `EvaluateTaskError` when a unit fails on a worker.
    """
    from pfactory.evaluate.evaluation import evaluate
    from pfactory.fsutil import check_output_dir
    from pfactory.tracking import configure_environment

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
    from pfactory.tracking import stage_run

    with stage_run(STAGE, ev.model_dump(mode="json")) as active:
        metrics = evaluate(*args, active, write_stage_report, raw=raw)
        if not os.environ.get("PFACTORY_PARENT_RUN_ID"):  # a lone evaluation: its own run shows the report
            log_report(Path(out) / af.REPORT_DIR)  # (under a pipeline the flow logs it to the parent run)
        return metrics


def main(argv: list[str] | None = None) -> None:
    """`python -m tasks.evaluate [--model OPTIMIZED] [--data DIR] [--out DIR] [--reference MODEL | --no-reference]
    [--dask ADDRESS|local:N] [--no-track]` (= `factory evaluate`; directories default to paths.*)."""
    import argparse

    from tasks._stage import stage_main

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--model", type=Path, default=None, help="optimized model (default: paths.optimized)"
        )
        parser.add_argument(
            "--data", type=Path, default=None, help="prepared shards (default: paths.prepared)"
        )
        parser.add_argument("--out", type=Path, default=None, help="output (default: paths.eval)")
        parser.add_argument("--reference", type=Path, default=None,
                            help="PyTorch model for the KPI delta (default: paths.model, if it holds one)")  # fmt: skip
        parser.add_argument("--no-reference", action="store_true", help="skip the PyTorch reference")
        parser.add_argument(
            "--dask", default=None, help="scheduler address or local:N (default: evaluate.dask_address)"
        )
        parser.add_argument("--no-track", action="store_true", help="do not open an MLflow run")
        parser.add_argument("--raw", type=Path, default=None,
                            help="raw dataset of --data (default: paths.raw, if it exists); KITTI: KITTI metric + result files; nuScenes: results_nusc.json")  # fmt: skip
        parser.add_argument("--summary", action="store_true", help="print the KPI table on stderr")

    def body(p: Any, args: argparse.Namespace) -> dict:
        ref = None if args.no_reference else args.reference or Path(p.paths.model)
        if ref is not None and args.reference is None and not (ref / af.WEIGHTS).is_file():
            ref = None  # the default reference is optional; an explicit --reference must exist
        raw = args.raw or (Path(p.paths.raw) if Path(p.paths.raw).is_dir() else None)
        metrics = run(
            p, args.model or Path(p.paths.optimized), ref, args.data or Path(p.paths.prepared),
            args.out or Path(p.paths.eval), dask_address=args.dask, track=not args.no_track, raw=raw,
        )  # fmt: skip
        if args.summary:
            import json

            from pfactory.metrics.kpi_cli import format_kpi_table

            print(format_kpi_table(json.loads(Path(metrics["kpis_path"]).read_text())), file=sys.stderr)
        return metrics

    # Bad inputs (EvaluateInputError): a usage error, nothing ran. A unit failed on a worker
    # (EvaluateTaskError): it ran and failed. Each error class carries its exit code.
    stage_main(STAGE, argv, body, add_arguments, sections=SECTIONS)


if __name__ == "__main__":
    main()
