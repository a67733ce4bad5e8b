"""Batch inference on a Dask cluster: one task per work unit (row groups of a shard), models cached per process.

Driver side (the stage's process):
    with dask_client(address, workers, threads) as (client, where):
        stats = run_units(client, spec, data, units, on_result)   # on_result(UnitResult) as each unit lands
`dask_client` and the loop under `run_units` are `pfactory.runtime.cluster`'s (shared with the prepare stage): a
`LocalCluster` for `address` None or "local:N", else a connection to that scheduler; every unit submitted,
results streamed back and handed to `on_result` in *completion* order; callers make their files
order-independent (pfactory.evaluate.predictions).

Worker side: `infer_unit(spec, data, unit)` reads the unit's rows with the loader's reader and batching
(`BatchSource` + `collate` + `batch_to_feed`: exactly the feeds optimize's parity check used), runs the
model and returns per-frame ground truth and detections (`FrameDetections`, reference frame, float64).
The model is built once per worker process (`_MODELS`, keyed by kind, path, sha256 and threads) and reused by
every later task; its intra-op threads = the worker's Dask threads, and one inference runs at a time per
process (`_RUN_LOCK`) so a second task thread overlaps its Parquet decode with the first one's compute.

A worker that dies mid-run: its nanny restarts it and the scheduler hands its unfinished units to the live
workers; a unit is a pure function of (model file, shard rows), so the redone result is the same bytes.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pfactory.evaluate.inputs import DataSpec, RunnerSpec, WorkUnit
from pfactory.runtime import cluster
from pfactory.runtime.failures import EXIT_FAILED, UserError

_MODELS: dict[tuple, Any] = {}
_SOURCES: dict[tuple[str, str], Any] = {}
_LOAD_LOCK = threading.Lock()  # two task threads must not build the same model twice
_RUN_LOCK = threading.Lock()  # one forward pass at a time per process (it already uses every thread)


class EvaluateTaskError(UserError, RuntimeError):
    """A work unit failed on a worker; the message names the unit (shard, row groups) and the cause."""

    exit_code = EXIT_FAILED


@dataclass
class UnitResult:
    """What one task sends back: per-frame GT and detections of a unit, and where/how long it ran."""

    unit: int
    kind: str
    frame_ids: list[str]
    gt: list[Any]  # FrameDetections, ground truth of the training classes
    pred: list[Any]  # FrameDetections with scores (>= data.score_threshold)
    timings: dict[str, float] = field(default_factory=dict)  # load_s, read_s, infer_s, compute_s
    worker: str = ""
    pid: int = 0


@dataclass
class RunStats:
    """Driver-side figures of one `run_units` call."""

    wall_s: float
    tasks: int
    frames: int
    slots: int  # worker threads of the cluster when the run started
    compute_s: float  # sum over tasks of the worker-measured time (model load included)
    load_s: float  # sum of model-load times (0 for tasks that found the model cached)
    workers_used: list[str]

    @property
    def throughput_fps(self) -> float:
        return self.frames / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def overhead_per_task_s(self) -> float:
        """Scheduling overhead per task: (wall x slots - compute) / tasks, i.e. task wall minus compute,
        averaged: submission, transfer of results, idle slots while others finish."""
        return max(0.0, (self.wall_s * self.slots - self.compute_s) / max(self.tasks, 1))

    def to_json(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 4),
            "tasks": self.tasks,
            "frames": self.frames,
            "slots": self.slots,
            "compute_s": round(self.compute_s, 4),
            "load_s": round(self.load_s, 4),
            "throughput_fps": round(self.throughput_fps, 3),
            "overhead_per_task_ms": round(1000 * self.overhead_per_task_s, 3),
            "workers_used": len(self.workers_used),
        }


# ------------------------------------------------------------------------------------------------
# Cluster (pfactory.runtime.cluster: shared with the prepare stage)


def dask_client(address: str | None, workers: int, threads_per_worker: int) -> Any:
    """`pfactory.runtime.cluster.dask_client` for evaluate (errors name `evaluate.dask_address`)."""
    return cluster.dask_client(address, workers, threads_per_worker, "evaluate.dask_address")


def preload(client: Any, spec: RunnerSpec, data: DataSpec) -> dict[str, float]:
    """Build `spec`'s model and the split reader on every current worker now (`{address: seconds}`), so
    timed work starts warm (benchmarks). The stage does not need it: each worker loads on its first unit."""
    return client.run(_preload, spec, data)


def _preload(spec: RunnerSpec, data: DataSpec) -> float:
    t0 = time.perf_counter()
    import torch  # noqa: F401  (what infer_unit imports first)

    _load_model(spec, cluster.worker_threads())
    _source(data)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------
# Worker side


def _load_model(spec: RunnerSpec, threads: int) -> tuple[Any, float]:
    """The cached runner of `spec` in this process, and the seconds spent building it (0 when cached)."""
    key = (spec.kind, spec.path, spec.sha256, spec.device, threads)
    with _LOAD_LOCK:
        if key in _MODELS:
            return _MODELS[key], 0.0
        t0 = time.perf_counter()
        from pfactory.storage.fsutil import sha256_file

        if spec.kind == "optimized":
            from pfactory.optimize.runtime import load_runner

            runner = load_runner(
                Path(spec.path), spec.backend, spec.precision, spec.device, threads, verify=True
            )
            got = getattr(runner, "path", None)
            if got is not None and sha256_file(got) != spec.sha256:
                raise EvaluateTaskError(f"{got}: changed since the evaluation started (sha256)")
        else:
            from pfactory.detectors.io import WEIGHTS
            from pfactory.optimize.runtime import TorchRunner

            weights = Path(spec.path) / WEIGHTS
            if sha256_file(weights) != spec.sha256:
                raise EvaluateTaskError(f"{weights}: changed since the evaluation started (sha256)")
            runner = TorchRunner(Path(spec.path), "auto" if spec.device == "auto" else spec.device, threads)
        _MODELS[key] = runner
        return runner, time.perf_counter() - t0


def _source(data: DataSpec) -> Any:
    """The split's `BatchSource` of this process (shard metadata read once)."""
    key = (data.root, data.split)
    with _LOAD_LOCK:
        if key not in _SOURCES:
            from pfactory.prepare.source import BatchSource

            # shuffle_window 1: the reader keeps 2 decoded row groups, a unit walks them in order.
            _SOURCES[key] = BatchSource(
                data.root, data.split, data.batch_size, False, None, 0, shuffle_window=1
            )
        return _SOURCES[key]


def infer_unit(spec: RunnerSpec, data: DataSpec, unit: WorkUnit) -> UnitResult:
    """Run `spec`'s model over the rows of `unit` (module docstring). Runs on a worker."""
    t_start = time.perf_counter()  # first call in a process: the imports below count as model load
    import torch

    from pfactory.detectors.inference import frames_from_batch
    from pfactory.optimize.calibration import batch_to_feed
    from pfactory.prepare.loader import collate

    threads = cluster.worker_threads()
    try:
        runner, load_s = _load_model(spec, threads)
        source = _source(data)
        if load_s > 0:
            load_s = time.perf_counter() - t_start
        path, rg, start, _ = source.groups[_group_of(source, unit.row_start)]
        if Path(path) != Path(data.root) / unit.shard or rg != unit.rg_start or start != unit.row_start:
            raise EvaluateTaskError(
                f"unit {unit.index}: rows {unit.row_start}.. are {path} row group {rg} here, expected "
                f"{unit.shard} row group {unit.rg_start} (the prepared data changed)"
            )
        read_s = infer_s = 0.0
        gts, preds, ids = [], [], []
        for b in range(unit.row_start, unit.row_stop, data.batch_size):
            t0 = time.perf_counter()
            rows = range(b, min(b + data.batch_size, unit.row_stop))
            batch = collate([source.sample(r, 0) for r in rows])  # no augmentation: identity transform
            feed = batch_to_feed(batch)
            t1 = time.perf_counter()
            with _RUN_LOCK:
                out = runner.run(feed)
            t2 = time.perf_counter()
            g, p = frames_from_batch(
                vars(batch),
                torch.from_numpy(out["boxes"]),  # [B, K, 7]
                torch.from_numpy(out["scores"]),  # [B, K]
                torch.from_numpy(out["labels"]),  # [B, K]
                data.classes,
                data.score_threshold,
            )
            gts += g
            preds += p
            ids += [str(f) for f in batch.frame_ids]
            read_s += t1 - t0
            infer_s += t2 - t1
    except EvaluateTaskError:
        raise
    except Exception as e:  # name the unit: the driver only sees the remote traceback otherwise
        raise EvaluateTaskError(
            f"{spec.name} on {unit.shard} row groups [{unit.rg_start}, {unit.rg_stop}): {type(e).__name__}: {e}"
        ) from e
    compute_s = time.perf_counter() - t_start
    timings = {"load_s": load_s, "read_s": read_s, "infer_s": infer_s, "compute_s": compute_s}
    return UnitResult(unit.index, spec.kind, ids, gts, preds, timings, cluster.worker_address(), os.getpid())


def _group_of(source: Any, row: int) -> int:
    import bisect

    return bisect.bisect_right(source._starts, row) - 1


# ------------------------------------------------------------------------------------------------
# Driver side


def run_units(
    client: Any,
    spec: RunnerSpec,
    data: DataSpec,
    units: list[WorkUnit],
    on_result: Callable[[UnitResult], None],
) -> RunStats:
    """Submit one task per unit, call `on_result` for each as it completes; returns the run's figures.

    A task that raises cancels the rest and raises `EvaluateTaskError` with the worker's message
    (`pfactory.runtime.cluster.run_tasks`).
    """
    load = 0.0
    frames = 0
    used: set[str] = set()

    done: set[int] = set()

    def got(_: cluster.Task, res: UnitResult) -> None:
        nonlocal load, frames
        done.add(res.unit)
        load += res.timings["load_s"]
        frames += len(res.frame_ids)
        used.add(res.worker)
        on_result(res)

    tasks = [cluster.Task(f"evaluate-{spec.kind}", u.index, infer_unit, (spec, data, u)) for u in units]
    loop = cluster.run_tasks(
        client, tasks, got, EvaluateTaskError, spec.name, lambda r: r.timings["compute_s"]
    )
    # Every unit planned came back, and with all its frames: a lost unit would silently lower the KPIs.
    missing = sorted({u.index for u in units} - done)
    expected = sum(u.frames for u in units)
    if missing or frames != expected:
        raise EvaluateTaskError(
            f"{spec.name}: {len(missing)} of {len(units)} work units never returned (units {missing[:10]}); "
            f"{frames} of {expected} frames scored: nothing is written from an incomplete evaluation"
        )
    return RunStats(loop.wall_s, len(units), frames, loop.slots, loop.compute_s, load, sorted(used))
