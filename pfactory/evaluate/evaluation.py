"""One evaluation: an optimized detector (and its PyTorch checkpoint) over a prepared split on Dask -> KPIs.

`evaluate(ev, optimized, model, data, out, address, progress, active)` plans the work
(`inputs.resolve_inputs`), runs it on Dask (`distributed.run_units`: one task per unit of row groups,
models loaded once per worker), writes each unit's predictions as it arrives and keeps none of them
(`UnitRecord`), then scores (`scoring.score`, reading the boxes back from the parts) and writes the
reports (`report.write_reports`), all inside `out` built in a temporary sibling and renamed into place
on success. Files identical whatever the completion order
or a worker's death. The files are listed in `tasks/evaluate.py` (the stage) and docs/EVALUATE.md.
Metrics back: flat dict with mAP, NDS, reference_mAP, delta_mAP, frames, data_hash, kpis_path,
throughput and the MLflow scalars (`eval/...`, `time/...`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pfactory.evaluate.params import EvaluateParams
from pfactory.evaluate.scoring import KINDS, score
from pfactory.runtime.progress import emit as emit_progress
from pfactory.storage import artifacts as af


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


def evaluate(
    ev: EvaluateParams,
    optimized: Path,
    model: Path | None,
    data: Path,
    out: Path,
    address: str | None,
    progress: bool,
    active: Any,
    write_report: Callable[..., Any] | None = None,
    raw: Path | Literal[False] | None = None,
) -> dict[str, Any]:
    """Evaluate `optimized` (and `model`, the PyTorch reference, unless None) on `data`; build `out`.

    `address`: a scheduler address, "local:N", or None (Dask's own `scheduler-address` /
    `DASK_SCHEDULER_ADDRESS` when set, else a LocalCluster of `ev.workers`; where it came from is in
    timings.json's and the metrics' `cluster`, and the MLflow tag `evaluate.cluster`). `progress`: a
    rich bar per model on stderr. `active`: the MLflow run to log to (None: no tracking). `write_report`:
    `(report_dir, doc, gt, pred, optimized, data, worst_n)` writes the run report (the task passes
    `pfactory.report.stage.write_stage_report`; None: no report page, e.g. a champion's re-evaluation). `raw`: the raw dataset
    the prepared data came from (`open_raw`): None reopens the one its manifest names, False uses none (a
    champion's re-evaluation). With it, the layout's reader names the writer of the benchmark's own result
    files (`DatasetReader.results_writer`): KITTI result files and KITTI's official metric against its
    label_2 (`pfactory.evaluate.kitti_results`), nuScenes `report/results_nusc.json`
    (`nusc_submission`; kpis.json `nusc_results`). Raises `EvaluateInputError` on a bad input (before any
    work starts), `EvaluateTaskError` when a unit fails on a worker.
    """
    from pfactory.evaluate.inputs import resolve_inputs
    from pfactory.evaluate.predictions import PartWriter
    from pfactory.evaluate.report import write_timings
    from pfactory.storage.fsutil import atomic_directory

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    inputs = resolve_inputs(
        optimized, model if ev.reference else None, data, ev.split, ev.backend, ev.precision, ev.device,
        ev.slice_frames, ev.batch_size, ev.score_threshold,
    )  # fmt: skip
    benchmark = results_writer(data, ev.split, raw)  # the layout's result-file writer, or None
    timings["plan_s"] = time.perf_counter() - t_start
    results: dict[str, dict[int, Any]] = {k: {} for k in KINDS}
    runs: dict[str, dict[str, Any]] = {}

    with atomic_directory(out, stage="evaluate", inputs=(optimized, model, data)) as tmp:
        parts = PartWriter(tmp / "report")
        where = _run_models(ev, inputs, address, progress, parts, tmp / "report", results, runs, timings)
        doc = _score_and_report(
            ev, inputs, results, benchmark, tmp, parts, timings, write_report, optimized, data
        )
        timings["total_s"] = time.perf_counter() - t_start
        write_timings(tmp, where, runs, timings, results)
    return _metrics(ev, inputs, out, doc, where, runs, timings, active)


def _run_models(
    ev: EvaluateParams,
    inputs: Any,
    address: str | None,
    progress: bool,
    parts: Any,
    report: Path,
    results: dict[str, dict[int, Any]],
    runs: dict[str, dict[str, Any]],
    timings: dict[str, float],
) -> str:
    """Run the optimized model, then the reference (when `inputs` has one), over every unit on Dask.
    Each unit's predictions (and, once, the ground truth) are written under `report` and added to
    `parts` as it lands, then dropped: `results[kind][unit]` keeps the unit's frame ids, timings and
    worker (`UnitRecord`; the scoring reads the boxes back from `parts`), `runs[kind]` each model's run
    figures, `timings` `cluster_s` and `<kind>_s`. Returns where the cluster came from."""
    from pfactory.evaluate.distributed import dask_client, run_units
    from pfactory.evaluate.predictions import write_kitti

    done = dict.fromkeys(results, 0)
    with _progress(progress, inputs.frames) as advance:

        def on_result(res: Any) -> None:
            # Streamed: each unit's files are written as it lands (names depend only on frame ids); the
            # driver keeps no boxes (the parts hold them until scoring reads them back).
            results[res.kind][res.unit] = UnitRecord(res)
            write_kitti(report / "kitti" / res.kind, res.pred)
            parts.add(res.kind, res.unit, res.pred)
            if res.kind == "optimized":
                write_kitti(report / "kitti" / "ground_truth", res.gt)
                parts.add("ground_truth", res.unit, res.gt)
            advance(res.kind, len(res.frame_ids))
            done[res.kind] += len(res.frame_ids)
            emit_progress("evaluate", kind=res.kind, done=done[res.kind], total=inputs.frames)

        t0 = time.perf_counter()
        with dask_client(address, ev.workers, ev.threads_per_worker) as (client, where):
            timings["cluster_s"] = time.perf_counter() - t0
            specs = [inputs.optimized] + ([inputs.reference] if inputs.reference else [])
            for spec in specs:  # one model at a time: clean throughput figures per model
                stats = run_units(client, spec, inputs.data, inputs.units, on_result)
                runs[spec.kind] = stats.to_json()
                timings[f"{spec.kind}_s"] = stats.wall_s
    return where


def _score_and_report(
    ev: EvaluateParams,
    inputs: Any,
    results: dict[str, dict[int, Any]],
    benchmark: Any,
    tmp: Path,
    parts: Any,
    timings: dict[str, float],
    write_report: Callable[..., Any] | None,
    optimized: Path,
    data: Path,
) -> dict[str, Any]:
    """Score `results` and write into `tmp` the benchmark's result files (or the placeholder), the
    reports, the run report (`write_report`, when given) and `report/predictions.parquet`; records
    `kpi_s` and `report_s` in `timings`. Returns the kpis document."""
    from pfactory.evaluate.kitti_results import RESULTS_DIR, write_no_results
    from pfactory.evaluate.report import write_reports

    report = tmp / "report"
    t0 = time.perf_counter()
    doc, kpis, ref_kpis, gt, preds = score(ev, inputs, results, parts)
    if benchmark is not None:
        doc.update(benchmark.write(tmp, preds["optimized"]))
    if not (tmp / RESULTS_DIR).is_dir():  # the stage's declared DVC outputs exist for every dataset
        write_no_results(tmp)
    timings["kpi_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_reports(ev, inputs, tmp, doc, kpis, ref_kpis)
    if write_report is not None:
        write_report(report, doc, gt, preds["optimized"], optimized, data, ev.worst_frames)
    parts.finish(report / "predictions.parquet")
    timings["report_s"] = time.perf_counter() - t0
    return doc


def _metrics(
    ev: EvaluateParams,
    inputs: Any,
    out: Path,
    doc: dict[str, Any],
    where: str,
    runs: dict[str, dict[str, Any]],
    timings: dict[str, float],
    active: Any,
) -> dict[str, Any]:
    """`evaluate`'s flat metrics dict (module docstring); logs to MLflow when `active` is a run."""
    from pfactory.evaluate.report import mlflow_scalars

    scalars = mlflow_scalars(doc, {k: round(v, 3) for k, v in timings.items()}, runs)
    metrics: dict[str, Any] = {
        "mAP": doc["mAP"],
        "NDS": doc["NDS"],
        "frames": inputs.frames,
        "data_hash": inputs.data_hash,
        "split": ev.split,
        "kpis_path": str(out / af.KPIS),
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
        log_mlflow(out, scalars, inputs)
        metrics["mlflow_run_id"] = active.info.run_id
    return metrics


def open_raw(data: Path, raw: Path | Literal[False] | None) -> tuple[Any, str | None]:
    """The raw dataset prepared `data` came from, opened by its layout's reader, and a one-line note when
    the benchmark's result files cannot be written from it; `(None, None)` for `raw=False`.

    `raw` None: the root its manifest names (`source.root`, relative to the working directory as prepare was
    given it); when that data is gone, cannot be opened, is on object storage, or its content hash differs
    from `source.sha256`, the note says so and the result is None (the evaluation itself needs only the shards).
    The content hash is `checked_source_digest`'s: every file is read again unless the listing (names, sizes,
    modification times) is one whose digest prepare or an earlier check remembered. An explicit `raw` (`--raw`)
    must open as the manifest's layout (`EvaluateInputError` otherwise, before any work); a content hash that
    differs is noted, and the files are still written from it."""
    from pfactory.config import plugins
    from pfactory.evaluate.inputs import EvaluateInputError
    from pfactory.prepare.shards import open_prepared
    from pfactory.sensors.datasets import open_dataset, reader_class
    from pfactory.sensors.digest import checked_source_digest
    from pfactory.sensors.errors import DatasetError
    from pfactory.storage.objects import is_url

    if raw is False:
        return None, None
    where = f"{Path(data) / af.PREPARED_MANIFEST}"
    source = open_prepared(data).manifest.get("source", {})
    layout, want = source.get("layout"), source.get("sha256")
    if raw is not None:
        title = str(layout)
        try:
            title = reader_class(title)[0].title or title
            dataset = open_dataset(raw, layout=layout)
        except (DatasetError, plugins.PluginError) as e:
            raise EvaluateInputError(
                f"{raw}: the raw {title} dataset the data was prepared from ({where}: source.layout {layout!r}), "
                f"to write the benchmark's result files (--raw): {e}"
            ) from None
        got, _ = checked_source_digest(dataset)
        note = (
            None
            if got == want
            else (
                f"the raw data {raw} (--raw) differs from what {where} was prepared from (content sha256 "
                f"{got[:12]}, recorded {str(want)[:12]}): its result files are written from it anyway"
            )
        )
        return dataset, note
    root = source.get("root")
    if not root:
        return None, f"{where} names no raw data (source.root): no benchmark result files; pass --raw"
    if is_url(root):
        return (
            None,
            f"the raw data {root} ({where}) is on object storage: no benchmark result files; pass --raw",
        )
    if not Path(root).is_dir():
        return None, f"the raw data {root} named by {where} is gone: no benchmark result files; pass --raw"
    try:
        dataset = open_dataset(Path(root), layout=layout)
    except (DatasetError, plugins.PluginError) as e:
        return None, f"the raw data {root} named by {where} cannot be opened ({e}): no benchmark result files"
    got, _ = checked_source_digest(dataset)
    if got != want:
        return None, (
            f"the raw data {root} has changed since {where} was prepared (content sha256 {got[:12]}, recorded "
            f"{str(want)[:12]}): no benchmark result files; pass --raw to write them from it anyway"
        )
    return dataset, None


def results_writer(data: Path, split: str, raw: Path | Literal[False] | None) -> Any:
    """The writer of the benchmark's own result files for `split` of prepared `data` (`open_raw`'s dataset,
    its reader's `results_writer`), built now so that a wrong raw dataset fails before any work; None when
    there is no raw dataset or the layout has no writer. The note of `open_raw` goes to stderr, one line."""
    dataset, note = open_raw(data, raw)
    if note:
        print(f"evaluate: {note}", file=sys.stderr)
    writer = type(dataset).result_writer() if dataset is not None else None
    return None if writer is None else writer(dataset, Path(data), split)


class UnitRecord:
    """What the driver keeps of a `UnitResult` once its files are written: unit, kind, frame ids, timings,
    worker and pid (report/timings.json, the frame checks of the scoring); no boxes."""

    __slots__ = ("frame_ids", "kind", "pid", "timings", "unit", "worker")

    def __init__(self, res: Any) -> None:
        for k in self.__slots__:
            setattr(self, k, getattr(res, k))


def log_mlflow(out: Path, scalars: dict[str, float], inputs: Any) -> None:
    """Metrics, kpis.json, plots, reports and the predictions table (the KITTI text files are left out:
    predictions.parquet holds the same boxes, and thousands of small files slow the artifact store)."""
    import mlflow

    mlflow.log_metrics(scalars)
    mlflow.set_tags({"eval.data_hash": inputs.data_hash, "eval.artifact": inputs.optimized.name})
    mlflow.log_artifact(str(out / af.KPIS), artifact_path="eval")
    mlflow.log_artifacts(str(out / "pr"), artifact_path="eval/pr")
    report = out / "report"
    for p in sorted(report.iterdir()):
        if p.is_file():
            mlflow.log_artifact(str(p), artifact_path="eval/report")
    if (report / "worst").is_dir():
        mlflow.log_artifacts(str(report / "worst"), artifact_path="eval/report/worst")


def evaluate_to_kpis(ev: EvaluateParams, optimized: Path, data: Path) -> dict[str, Any]:
    """kpis.json of `optimized` on `data` without the PyTorch reference or MLflow, its files in a temporary
    folder (promotion re-evaluating a champion). Same scale-out as the stage: `ev.dask_address` or a
    LocalCluster of `ev.workers`."""
    import tempfile

    from pfactory.runtime.project import configure_environment

    configure_environment()  # Dask scratch inside the project, offline MLflow
    with tempfile.TemporaryDirectory(prefix="pfactory-reeval-") as tmp:
        out = Path(tmp) / "eval"
        evaluate(
            ev, Path(optimized), None, Path(data), out, ev.dask_address, sys.stderr.isatty(), None, raw=False
        )
        return af.kpis(out)
