"""The `evaluate` stage: an optimized detector (and its PyTorch checkpoint) over a prepared split on Dask -> KPIs.

Files in:  `optimized` (`paths.optimized`: backend.json + artifacts, latency.json), `model` (`paths.model`,
           optional: the PyTorch reference), `data` (`paths.prepared`: the `evaluate.split` shards).
Files out (`out` = `paths.eval`, built in a temporary sibling and renamed into place on success):
    kpis.json                     DVC metrics: mAP, NDS, per class / range, latency, reference, delta, lineage
    pr/<class>.csv                DVC plots: precision-recall at the 2 m threshold (101 points)
    report/predictions.parquet    every GT / optimized / reference box, sorted (pfactory.evaluate.predictions)
    report/kitti/{ground_truth,optimized,reference}/<frame_id>.txt   KITTI label / result files
    report/per_frame.json         TP/FP/FN per frame and class (error analysis), both models
    report/pr_curves.json         PR curves of every class and distance threshold, both models
    report/pr.png, report/bev/NN_<frame_id>.png   PR curves; BEV of the worst frames
    report/timings.json           per task: worker, pid, load/read/infer seconds; per run: throughput, overhead
Metrics back: flat dict with mAP, NDS, reference_mAP, delta_mAP, frames, data_hash, kpis_path, throughput and
the MLflow scalars (`eval/...`, `time/...`; docs/EVALUATE.md).

Work runs on Dask (`pfactory.evaluate.distributed`): one task per unit of row groups, models loaded once per
worker, results written as they arrive, files identical whatever the completion order or a worker's death.

Run: `python -m tasks.evaluate [-S evaluate.workers=2 ...]` (DVC; paths from params.yaml) or
`factory evaluate --model OPTIMIZED --data PREPARED --out DIR [--reference MODEL] [--dask ADDRESS|local:N]`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pfactory.evaluate.params import EvaluateParams

STAGE = "evaluate"
KINDS = ("optimized", "reference")


def _section(params: Any) -> EvaluateParams:
    """The evaluate section of the full `Params` (or an `EvaluateParams` given directly)."""
    if isinstance(params, EvaluateParams):
        return params
    section = getattr(params, "evaluate", None)
    if not isinstance(section, EvaluateParams):
        raise TypeError("run() needs the project Params (with an `evaluate` section) or an EvaluateParams")
    return section


def run(
    params: Any,
    optimized: Path,
    model: Path | None,
    data: Path,
    out: Path,
    dask_address: str | None = None,
    track: bool = True,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Evaluate `optimized` (and `model`, the PyTorch reference, unless None) on `data`; build `out`.

    `dask_address`: None -> `evaluate.dask_address` -> a LocalCluster of `evaluate.workers`; "local:N"; or a
    scheduler address. `track`: one MLflow run (`pfactory.tracking.stage_run`). `progress`: a rich bar on
    stderr (None = when stderr is a terminal). Raises `EvaluateInputError` on a bad input (before any
    work starts), `EvaluateTaskError` when a unit fails on a worker.
    """
    from pfactory.tracking import configure_environment

    ev = _section(params)
    configure_environment()  # Dask scratch inside the project, offline MLflow
    address = dask_address or ev.dask_address
    if progress is None:
        progress = sys.stderr.isatty()
    args = (
        ev,
        Path(optimized),
        None if model is None else Path(model),
        Path(data),
        Path(out),
        address,
        progress,
    )
    if not track:
        return _run(*args, None)
    from pfactory.tracking import stage_run

    with stage_run(STAGE, ev.model_dump(mode="json")) as active:
        return _run(*args, active)


@contextlib.contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Callable[[str, int], None]]:
    """`advance(kind, frames)`: a rich progress bar per model on stderr, or nothing."""
    if not enabled:
        yield lambda kind, n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, Any] = {}

        def advance(kind: str, n: int) -> None:
            if kind not in tasks:
                tasks[kind] = bar.add_task(f"evaluate {kind} (frames)", total=total)
            bar.advance(tasks[kind], n)

        yield advance


def _run(
    ev: EvaluateParams,
    optimized: Path,
    model: Path | None,
    data: Path,
    out: Path,
    address: str | None,
    progress: bool,
    active: Any,
) -> dict[str, Any]:
    from pfactory.evaluate.distributed import dask_client, run_units
    from pfactory.evaluate.inputs import resolve_inputs
    from pfactory.evaluate.predictions import PartWriter, write_kitti
    from pfactory.fsutil import atomic_directory

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    inputs = resolve_inputs(
        optimized, model if ev.reference else None, data, ev.split, ev.backend, ev.precision, ev.device,
        ev.slice_frames, ev.batch_size, ev.score_threshold,
    )  # fmt: skip
    timings["plan_s"] = time.perf_counter() - t_start
    results: dict[str, dict[int, Any]] = {k: {} for k in KINDS}
    runs: dict[str, dict[str, Any]] = {}

    with atomic_directory(out) as tmp:
        report = tmp / "report"
        parts = PartWriter(report)
        with _progress(progress, inputs.frames) as advance:

            def on_result(res: Any) -> None:
                # Streamed: each unit's files are written as it lands (names depend only on frame ids).
                results[res.kind][res.unit] = _Slim(res)
                write_kitti(report / "kitti" / res.kind, res.pred)
                parts.add(res.kind, res.unit, res.pred)
                if res.kind == "optimized":
                    write_kitti(report / "kitti" / "ground_truth", res.gt)
                    parts.add("ground_truth", res.unit, res.gt)
                advance(res.kind, len(res.frame_ids))

            t0 = time.perf_counter()
            with dask_client(address, ev.workers, ev.threads_per_worker) as (client, where):
                timings["cluster_s"] = time.perf_counter() - t0
                specs = [inputs.optimized] + ([inputs.reference] if inputs.reference else [])
                for spec in specs:  # one model at a time: clean throughput figures per model
                    stats = run_units(client, spec, inputs.data, inputs.units, on_result)
                    runs[spec.kind] = stats.to_json()
                    timings[f"{spec.kind}_s"] = stats.wall_s
        t0 = time.perf_counter()
        doc, kpis, ref_kpis, gt, preds = _score(ev, inputs, results)
        timings["kpi_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        _write_reports(ev, inputs, tmp, doc, kpis, ref_kpis, gt, preds, results)
        parts.finish(report / "predictions.parquet")
        timings["report_s"] = time.perf_counter() - t0
        timings["total_s"] = time.perf_counter() - t_start
        _write_timings(tmp, where, runs, timings, results)

    from pfactory.evaluate.report import mlflow_scalars

    scalars = mlflow_scalars(doc, {k: round(v, 3) for k, v in timings.items()}, runs)
    metrics: dict[str, Any] = {
        "mAP": doc["mAP"],
        "NDS": doc["NDS"],
        "frames": inputs.frames,
        "data_hash": inputs.data_hash,
        "split": ev.split,
        "kpis_path": str(out / "kpis.json"),
        "cluster": where,
        "throughput_fps": runs["optimized"]["throughput_fps"],
        **scalars,
    }
    if doc["reference"] is not None:
        metrics.update(
            reference_mAP=doc["reference"]["mAP"], reference_NDS=doc["reference"]["NDS"],
            delta_mAP=doc["delta"]["mAP"], delta_NDS=doc["delta"]["NDS"],
        )  # fmt: skip
    if active is not None:
        _log_mlflow(out, scalars, inputs)
        metrics["mlflow_run_id"] = active.info.run_id
    return metrics


class _Slim:
    """What the driver keeps of a `UnitResult` (files are already written)."""

    __slots__ = ("frame_ids", "gt", "kind", "pid", "pred", "timings", "unit", "worker")

    def __init__(self, res: Any) -> None:
        for k in self.__slots__:
            setattr(self, k, getattr(res, k))


def _score(ev: EvaluateParams, inputs: Any, results: dict[str, dict[int, Any]]) -> tuple:
    """KPIs of both models on the frames sorted by id (score ties then break the same way every run)."""
    from pfactory.evaluate.report import kpis_document
    from pfactory.metrics.detection import KpiParams, evaluate_detections

    opt = results["optimized"]
    missing = sorted(set(range(len(inputs.units))) - set(opt))
    if missing:  # cannot happen unless a result was dropped: refuse to score a partial split
        raise RuntimeError(f"evaluate: units {missing[:5]} returned no result")
    gt = sorted((f for r in opt.values() for f in r.gt), key=lambda f: f.frame_id)
    ids = [f.frame_id for f in gt]
    if len(ids) != inputs.frames or len(set(ids)) != len(ids):
        raise RuntimeError(
            f"evaluate: {len(ids)} frames ({len(set(ids))} distinct) came back, manifest.json lists {inputs.frames}"
        )
    kpi_params = KpiParams(
        classes=inputs.data.classes,
        range_buckets_m=ev.range_buckets_m,
        score_threshold=ev.frame_score_threshold,
    )
    preds = {
        kind: sorted((f for r in results[kind].values() for f in r.pred), key=lambda f: f.frame_id)
        for kind in KINDS
        if results[kind]
    }
    kpis = evaluate_detections(gt, preds["optimized"], kpi_params, latency=inputs.latency)
    ref = evaluate_detections(gt, preds["reference"], kpi_params) if "reference" in preds else None
    data_info = {
        "prepared_hash": inputs.data_hash,
        "split": ev.split,
        "frames": inputs.frames,
        "shards": len(inputs.shards),
        "ground_truth_boxes": int(sum(len(f.boxes) for f in gt)),
    }
    doc = kpis_document(kpis, ref, inputs.latency, data_info, inputs.model_info)
    return doc, kpis, ref, gt, preds


def _write_reports(
    ev: EvaluateParams,
    inputs: Any,
    tmp: Path,
    doc: dict,
    kpis: Any,
    ref: Any,
    gt: list,
    preds: dict,
    results: dict,
) -> None:
    from pfactory.evaluate.report import render_bev, render_pr_png, worst_frames, write_pr_csv
    from pfactory.fsutil import atomic_write_json

    report = tmp / "report"
    atomic_write_json(tmp / "kpis.json", doc)
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
            "score_threshold": ev.frame_score_threshold,
        },
    )
    render_pr_png(
        report / "pr.png", kpis, f"{inputs.optimized.name}: mAP {doc['mAP']:.4f}, NDS* {doc['NDS']:.4f}"
    )
    worst = worst_frames(kpis.per_frame, ev.worst_frames)
    if worst:
        by_id = {f.frame_id: f for f in gt}
        pred_by_id = {f.frame_id: f for f in preds["optimized"]}
        unit_of = {fid: u for u, r in results["optimized"].items() for fid in r.frame_ids}
        points = _points_of(inputs, [w["frame_id"] for w in worst], unit_of)
        for rank, w in enumerate(worst):
            fid = w["frame_id"]
            title = f"frame {fid}: {w['tp']} TP, {w['fp']} FP, {w['fn']} FN (2 m, score >= {ev.frame_score_threshold})"
            render_bev(report / "bev" / f"{rank:02d}_{fid}.png", points[fid], by_id[fid], pred_by_id[fid], title,
                       ev.frame_score_threshold)  # fmt: skip


def _points_of(inputs: Any, frame_ids: list[str], unit_of: dict[str, int]) -> dict[str, Any]:
    """Points `[N, 4]` of a few frames, read from their units' row groups."""
    from pfactory.data.shards import fixed_rows, open_shard

    out: dict[str, Any] = {}
    for unit_index in sorted({unit_of[f] for f in frame_ids}):
        u = inputs.units[unit_index]
        table = open_shard(Path(inputs.data.root) / u.shard).read_row_groups(
            list(range(u.rg_start, u.rg_stop)), columns=["frame_id", "points"]
        )
        for fid, pts in zip(
            table.column("frame_id").to_pylist(), fixed_rows(table.column("points"), 4, "float32")
        ):
            if fid in frame_ids:
                out[fid] = pts
    return out


def _write_timings(tmp: Path, where: str, runs: dict, timings: dict, results: dict) -> None:
    from pfactory.fsutil import atomic_write_json

    units = [
        {"kind": kind, "unit": u, "frames": len(r.frame_ids), "worker": r.worker, "pid": r.pid,
         **{k: round(v, 6) for k, v in r.timings.items()}}
        for kind in KINDS
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


def _log_mlflow(out: Path, scalars: dict[str, float], inputs: Any) -> None:
    """Metrics, kpis.json, plots, reports and the predictions table (the KITTI text files are left out:
    predictions.parquet holds the same boxes, and thousands of small files slow the artifact store)."""
    import mlflow

    mlflow.log_metrics(scalars)
    mlflow.set_tags({"eval.data_hash": inputs.data_hash, "eval.artifact": inputs.optimized.name})
    mlflow.log_artifact(str(out / "kpis.json"), artifact_path="eval")
    mlflow.log_artifacts(str(out / "pr"), artifact_path="eval/pr")
    report = out / "report"
    for p in sorted(report.iterdir()):
        if p.is_file():
            mlflow.log_artifact(str(p), artifact_path="eval/report")
    if (report / "bev").is_dir():
        mlflow.log_artifacts(str(report / "bev"), artifact_path="eval/report/bev")


def main(argv: list[str] | None = None) -> None:
    from pfactory.cli_stage import stage_main

    def body(p: Any) -> dict:
        from pfactory.evaluate.distributed import EvaluateTaskError
        from pfactory.evaluate.inputs import EvaluateInputError

        try:
            return run(
                p, Path(p.paths.optimized), Path(p.paths.model), Path(p.paths.prepared), Path(p.paths.eval)
            )
        except EvaluateInputError as e:  # bad inputs: usage error, nothing ran
            print(f"evaluate: {e}", file=sys.stderr)
            sys.exit(2)
        except (EvaluateTaskError, ConnectionError) as e:  # it ran and failed
            print(f"evaluate: {e}", file=sys.stderr)
            sys.exit(1)

    stage_main(STAGE, argv, body)


if __name__ == "__main__":
    main()
