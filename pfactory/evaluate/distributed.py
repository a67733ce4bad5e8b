"""Batch inference on a Dask cluster: one task per work unit (row groups of a shard), models cached per process.

Driver side (the stage's process):
    with dask_client(address, workers, threads) as (client, where):
        stats = run_units(client, spec, data, units, on_result)   # on_result(UnitResult) as each unit lands
`dask_client` opens a `LocalCluster` (worker processes with a nanny each, `host=127.0.0.1`, no dashboard,
scratch under `DASK_TEMPORARY_DIRECTORY`) for `address` None or "local:N", or connects to a scheduler
address. `run_units` submits every unit, streams results back with `as_completed` and hands each one to
`on_result` in *completion* order; callers make their files order-independent (pfactory.evaluate.predictions).

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

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pfactory.evaluate.inputs import DataSpec, RunnerSpec, WorkUnit

_MODELS: dict[tuple, Any] = {}
_SOURCES: dict[tuple[str, str], Any] = {}
_LOAD_LOCK = threading.Lock()  # two task threads must not build the same model twice
_RUN_LOCK = threading.Lock()  # one forward pass at a time per process (it already uses every thread)


class EvaluateTaskError(RuntimeError):
    """A work unit failed on a worker; the message names the unit (shard, row groups) and the cause."""


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
# Cluster


@contextlib.contextmanager
def dask_client(address: str | None, workers: int, threads_per_worker: int) -> Iterator[tuple[Any, str]]:
    """`(Client, description)` for `address`: None / "local:N" -> a LocalCluster of `workers` / N worker
    processes (closed on exit); anything else -> a connection to that scheduler (left running)."""
    from distributed import Client, LocalCluster

    if address is None or address.startswith("local:"):
        n = workers if address is None else int(address.removeprefix("local:"))
        scratch = os.environ.get("DASK_TEMPORARY_DIRECTORY")  # configure_environment: inside the project
        cluster = LocalCluster(
            n_workers=n,
            threads_per_worker=threads_per_worker,
            processes=True,  # one GIL and one ORT/PyTorch pool per worker
            host="127.0.0.1",
            dashboard_address=None,
            local_directory=scratch,
            # Task errors reach the driver as exceptions; what the workers log at close (heartbeats
            # racing the scheduler's shutdown: CommClosedError tracebacks) is noise.
            silence_logs=logging.CRITICAL,
        )
        try:
            with Client(cluster) as client:
                yield client, f"local:{n}"
        finally:
            cluster.close()
    else:
        import dask

        try:  # connect timeout: Dask's `distributed.comm.timeouts.connect` (30 s by default)
            client = Client(address, timeout=dask.config.get("distributed.comm.timeouts.connect"))
        except OSError as e:
            raise ConnectionError(
                f"evaluate.dask_address {address!r}: no Dask scheduler answered ({e})"
            ) from e
        with client:
            yield client, address


def cluster_slots(client: Any) -> int:
    """Worker threads of the cluster (sum of nthreads)."""
    return sum(client.nthreads().values()) or 1


def preload(client: Any, spec: RunnerSpec, data: DataSpec) -> dict[str, float]:
    """Build `spec`'s model and the split reader on every current worker now (`{address: seconds}`), so
    timed work starts warm (benchmarks). The stage does not need it: each worker loads on its first unit."""
    return client.run(_preload, spec, data)


def _preload(spec: RunnerSpec, data: DataSpec) -> float:
    t0 = time.perf_counter()
    import torch  # noqa: F401  (what infer_unit imports first)

    _load_model(spec, _worker_threads())
    _source(data)
    return time.perf_counter() - t0


def worker_pids(client: Any) -> dict[str, int]:
    """Process id of every worker (`{address: pid}`)."""
    return client.run(os.getpid)


# ------------------------------------------------------------------------------------------------
# Worker side


def _worker_threads() -> int:
    try:
        from distributed import get_worker

        return int(get_worker().state.nthreads)
    except (ImportError, ValueError, AttributeError):  # not inside a Dask worker (direct call, tests)
        return 1


def _load_model(spec: RunnerSpec, threads: int) -> tuple[Any, float]:
    """The cached runner of `spec` in this process, and the seconds spent building it (0 when cached)."""
    key = (spec.kind, spec.path, spec.sha256, spec.device, threads)
    with _LOAD_LOCK:
        if key in _MODELS:
            return _MODELS[key], 0.0
        t0 = time.perf_counter()
        from pfactory.fsutil import sha256_file

        if spec.kind == "optimized":
            from pfactory.inference.runtime import load_runner

            runner = load_runner(
                Path(spec.path), spec.backend, spec.precision, spec.device, threads, verify=True
            )
            got = getattr(runner, "path", None)
            if got is not None and sha256_file(got) != spec.sha256:
                raise EvaluateTaskError(f"{got}: changed since the evaluation started (sha256)")
        else:
            from pfactory.inference.runtime import TorchRunner
            from pfactory.model.io import WEIGHTS

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
            from pfactory.data.source import BatchSource

            # shuffle_window 1: the reader keeps 2 decoded row groups, a unit walks them in order.
            _SOURCES[key] = BatchSource(
                data.root, data.split, data.batch_size, False, None, 0, shuffle_window=1
            )
        return _SOURCES[key]


def infer_unit(spec: RunnerSpec, data: DataSpec, unit: WorkUnit) -> UnitResult:
    """Run `spec`'s model over the rows of `unit` (module docstring). Runs on a worker."""
    t_start = time.perf_counter()  # first call in a process: the imports below count as model load
    import torch

    from pfactory.data.loader import collate
    from pfactory.inference.calibration import batch_to_feed
    from pfactory.model.inference import frames_from_batch

    threads = _worker_threads()
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
    worker = ""
    with contextlib.suppress(ImportError, ValueError):
        from distributed import get_worker

        worker = get_worker().address
    return UnitResult(unit.index, spec.kind, ids, gts, preds, timings, worker, os.getpid())


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

    A task that raises cancels the rest and raises `EvaluateTaskError` with the worker's message.
    """
    from distributed import as_completed

    slots = cluster_slots(client)
    tag = uuid.uuid4().hex[:8]  # keys unique per run: a shared scheduler may hold an older run's keys
    t0 = time.perf_counter()
    futures = [
        client.submit(infer_unit, spec, data, u, key=f"evaluate-{spec.kind}-{tag}-{u.index:05d}", pure=False)
        for u in units
    ]
    compute = load = 0.0
    frames = 0
    used: set[str] = set()
    try:
        for fut in as_completed(futures):
            try:
                res: UnitResult = fut.result()
            except EvaluateTaskError:
                raise
            except Exception as e:  # KilledWorker (a unit killed its workers 3 times), lost scheduler, ...
                raise EvaluateTaskError(f"{spec.name}: task {fut.key} failed: {type(e).__name__}: {e}") from e
            compute += res.timings["compute_s"]
            load += res.timings["load_s"]
            frames += len(res.frame_ids)
            used.add(res.worker)
            on_result(res)
    except BaseException:
        client.cancel(futures)
        raise
    return RunStats(time.perf_counter() - t0, len(units), frames, slots, compute, load, sorted(used))
