"""The prepare stage on a Dask cluster: work units of frame ids, shards assembled in order, same bytes.

`prepare_data(raw, out, params, dask_address)` is the stage's entry: with no cluster asked for (no
`--dask`, `prepare.dask_address` null, no Dask `scheduler-address` / `DASK_SCHEDULER_ADDRESS`,
`prepare.workers` 1) and local paths it is `prepare_dataset`, the
single-process streaming path (unchanged); otherwise `prepare_scaled` below. Both write the same bytes
(tests/prepare/test_scaleout.py compares every file).

Two kinds of task, both pure functions of their inputs that land their files atomically, so a task redone
after its worker died writes the same bytes:
1. **unit** (`prepare_unit`): a fixed-size run of `prepare.unit_frames` consecutive frame ids (dataset
   order). The worker opens the raw data (in place, or a scratch copy of the unit's files from object
   storage: `pfactory.prepare.rawdata.open_unit`), runs exactly the single-process path on them
   (`pfactory.prepare.stage.stream_frames`: the checks, the lidar path, the DALI camera path, refusals per
   frame) and writes the unit's rows of each split, in order, to an Arrow IPC *piece*
   `.pieces/unit-<u>-<split>.arrow` (lz4) in the build directory. It returns the unit's counts, refusals
   (with their global frame index), input digests and timings, not the rows.
2. **shard** (`write_shard`): once the units before it are known, the driver knows which rows land in
   which shard: shard k of a split holds that split's accepted frames [k M, (k+1) M) in dataset order
   (M = `prepare.shard_max_frames`), exactly what the single-process `SplitWriter` does. The task reads
   those rows from the pieces and writes them with a `SplitWriter` (row groups of `prepare.batch_size`),
   hashes the file and lands it. Shard tasks start while later units still run (`ShardPlanner`).
The driver then writes `rejected.jsonl` (sorted by frame index) and `manifest.json` (last), removes the
pieces, and the build directory is published (`pfactory.prepare.publish.build_output`).

Memory per worker: one unit's frames in flight (bounded by `unit_frames`, not the dataset), one piece per
shard task. What stays serial on the driver (docs/DATA.md cost model): listing the raw data, planning,
the manifest merge and, on object storage, the publish copies.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pfactory.prepare.params import PrepareParams
from pfactory.prepare.rawdata import RawSpec
from pfactory.prepare.shards import MANIFEST, REJECTED, SPLITS, ShardInfo, SplitWriter, arrow_schema
from pfactory.runtime.failures import EXIT_FAILED, UserError
from pfactory.storage.objects import Location, is_url

PIECES = ".pieces"
# Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536, which turns off glibc's adaptive mmap
# threshold: every ~1-2 MB array of a frame becomes an mmap + page faults + munmap. Measured on 64 KITTI
# frames in one process: 2.04 CPU-s (0.27 s system) without it, 3.20 CPU-s (1.37 s system) with it, +57%.
# The prepare path keeps its resident set flat with malloc_trim per batch instead (prepare._malloc_trim).
WORKER_ENV: dict[str, str | None] = {"MALLOC_TRIM_THRESHOLD_": None}


class PrepareTaskError(UserError, RuntimeError):
    """A work unit or shard failed on a worker (not a data problem: those refuse frames); names the task."""

    exit_code = EXIT_FAILED


# ----------------------------------------------------------------------------------------------
# Work items


@dataclass
class UnitJob:
    """One unit: frames `ids` (global indices `first`, ...) of the raw data `raw`, written into `build`."""

    raw: RawSpec
    build: Location
    params: PrepareParams
    tag: str  # run tag: per-process caches are per run
    index: int
    first: int
    ids: list[str]
    files: list[str] = field(default_factory=list)  # raw files to download (object storage)


@dataclass
class UnitOutcome:
    """What a unit sends back (no rows: they are in its pieces)."""

    index: int
    counts: dict[str, int]
    rejected: list[tuple[int, dict[str, str]]]
    digests: list[str]
    cameras: list[str]
    images: int
    points_in: int
    points_out: int
    seconds: dict[str, float]
    compute_s: float
    peak_rss: int
    worker: str
    pid: int


@dataclass
class ShardJob:
    """One shard: rows `slices` = [(unit, first row in its piece, rows)] of `split`, as shard `index`."""

    build: Location
    params: PrepareParams
    split: str
    index: int
    slices: list[tuple[int, int, int]]


@dataclass
class ShardOutcome:
    split: str
    index: int
    info: ShardInfo
    compute_s: float
    peak_rss: int
    worker: str
    pid: int


def piece_name(unit: int, split: str) -> str:
    return f"{PIECES}/unit-{unit:05d}-{split}.arrow"


# ----------------------------------------------------------------------------------------------
# Worker side


class PieceWriter:
    """The rows of one split of one unit -> an Arrow IPC file (lz4), a record batch per `batch` rows.

    Opened at the first row (a split without rows writes no piece), landed atomically at `close`."""

    def __init__(self, build: Location, rel: str, schema: Any, batch: int, stack: contextlib.ExitStack):
        self.build, self.rel, self.schema, self.batch, self.stack = build, rel, schema, batch, stack
        self.rows: list[Any] = []
        self.count = 0
        self._writer: Any = None
        self._landing: Any = None

    def add(self, frame: Any) -> None:
        self.rows.append(frame)
        if len(self.rows) >= self.batch:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        from pfactory.prepare.shards import frames_to_table

        if not self.rows:
            return
        if self._writer is None:
            self._landing = contextlib.ExitStack()
            self.stack.enter_context(self._landing)
            path = self._landing.enter_context(self.build.landing(self.rel))
            opts = pa.ipc.IpcWriteOptions(compression="lz4")
            self._writer = pa.ipc.new_file(str(path), self.schema, options=opts)
        self._writer.write_table(frames_to_table(self.rows, self.schema))
        self.count += len(self.rows)
        self.rows = []

    def close(self) -> int:
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._landing.close()  # lands the piece
        return self.count


def prepare_unit(job: UnitJob) -> UnitOutcome:
    """Prepare one unit's frames into its pieces (module docstring). Runs on a worker."""
    from pfactory.prepare.rawdata import open_unit
    from pfactory.prepare.stage import new_run, stream_frames
    from pfactory.runtime import cluster

    t0 = time.perf_counter()
    p = job.params
    W, H = p.image_size
    schema = arrow_schema((3, H, W))
    threads = p.threads_per_worker
    try:
        with open_unit(job.raw, job.tag, job.index, job.files) as dataset, contextlib.ExitStack() as stack:
            writers = {
                s: PieceWriter(job.build, piece_name(job.index, s), schema, p.batch_size, stack)
                for s in SPLITS
            }
            run = new_run(dataset, p, None, writers, threads, cached=True)
            digests = stream_frames(run, job.ids, job.first, threads)
            counts = {s: w.close() for s, w in writers.items()}
    except Exception as e:  # name the unit: the driver only sees the remote traceback otherwise
        last = job.ids[-1] if job.ids else "-"
        raise PrepareTaskError(
            f"prepare unit {job.index} (frames {job.ids[0]}..{last} of {job.raw.url}): {type(e).__name__}: {e}"
        ) from e
    return UnitOutcome(
        job.index,
        counts,
        run.rejected,
        digests,
        sorted(run.cameras),
        run.images,
        run.points_in,
        run.points_out,
        dict(run.seconds),
        time.perf_counter() - t0,
        cluster.peak_rss_bytes(),
        cluster.worker_address(),
        os.getpid(),
    )


def _read_piece(build: Location, rel: str) -> Any:
    import pyarrow as pa

    if not build.remote:
        with pa.memory_map(str(build.local_path(rel))) as src:
            return pa.ipc.open_file(src).read_all()
    with build.open(rel) as f:
        return pa.ipc.open_file(f).read_all()


def write_shard(job: ShardJob) -> ShardOutcome:
    """Write one shard from the pieces of its units (module docstring). Runs on a worker."""
    from pfactory.prepare.shards import table_to_frames
    from pfactory.runtime import cluster
    from pfactory.storage.fsutil import sha256_file
    from pfactory.storage.objects import scratch_dir

    t0 = time.perf_counter()
    p = job.params
    W, H = p.image_size
    schema = arrow_schema((3, H, W))
    where = job.build.local_path(PIECES) if not job.build.remote else scratch_dir()
    where.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="shard-", dir=where) as td:
            w = SplitWriter(
                Path(td), job.split, schema, p.shard_max_frames, p.batch_size, first_shard=job.index
            )
            for unit, start, n in job.slices:
                table = _read_piece(job.build, piece_name(unit, job.split)).slice(start, n)
                for frame in table_to_frames(table, (3, H, W)):
                    w.add(frame)
            (info,) = w.close()
            local = Path(td) / info.file
            info.bytes = local.stat().st_size
            info.sha256 = sha256_file(local)
            with job.build.landing(info.file) as dest:
                shutil.move(local, dest)
    except Exception as e:
        raise PrepareTaskError(
            f"prepare shard {job.split}/{job.index} (rows of units {[u for u, _, _ in job.slices]}): "
            f"{type(e).__name__}: {e}"
        ) from e
    return ShardOutcome(
        job.split,
        job.index,
        info,
        time.perf_counter() - t0,
        cluster.peak_rss_bytes(),
        cluster.worker_address(),
        os.getpid(),
    )


# ----------------------------------------------------------------------------------------------
# Driver side


class ShardPlanner:
    """Which rows make which shard, as units complete in any order.

    A unit's accepted frames of a split follow those of every earlier unit, so once units 0..u are all in,
    every shard whose rows lie within them is fixed: `add` returns those shards (split, index, slices) as soon
    as that is so, and the last partial shard of each split when the last unit is in."""

    def __init__(self, n_units: int, max_frames: int):
        self.n_units, self.max_frames = n_units, max_frames
        self.counts: dict[int, dict[str, int]] = {}
        self.prefix = 0  # units 0..prefix-1 are in
        self.total = dict.fromkeys(SPLITS, 0)  # frames of each split over those units
        self.segments: dict[str, list[tuple[int, int, int]]] = {s: [] for s in SPLITS}  # (unit, offset, n)
        self.emitted = dict.fromkeys(SPLITS, 0)

    def add(self, unit: int, counts: dict[str, int]) -> list[tuple[str, int, list[tuple[int, int, int]]]]:
        self.counts[unit] = counts
        while self.prefix in self.counts:
            for s in SPLITS:
                n = self.counts[self.prefix].get(s, 0)
                if n:
                    self.segments[s].append((self.prefix, self.total[s], n))
                    self.total[s] += n
            self.prefix += 1
        last = self.prefix == self.n_units
        M = self.max_frames
        out = []
        for s in SPLITS:
            while (self.emitted[s] + 1) * M <= self.total[s] or (
                last and self.emitted[s] * M < self.total[s]
            ):
                k = self.emitted[s]
                lo, hi = k * M, min((k + 1) * M, self.total[s])
                slices = [
                    (u, max(lo, a) - a, min(hi, a + n) - max(lo, a))
                    for u, a, n in self.segments[s]
                    if a < hi and a + n > lo
                ]
                out.append((s, k, slices))
                self.emitted[s] += 1
        return out


def prepare_data(
    raw: str | os.PathLike[str],
    out: str | os.PathLike[str],
    params: PrepareParams,
    dask_address: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Any:
    """The prepare stage's body: in this process, or on Dask (module docstring). Returns a PrepareResult.
    The scheduler: `dask_address` (`--dask`), else `params.dask_address`, else Dask's own config
    `scheduler-address` / `DASK_SCHEDULER_ADDRESS` (`pfactory.runtime.cluster.resolve_scheduler`)."""
    from pfactory.runtime.cluster import resolve_scheduler

    address = dask_address or params.dask_address
    in_process = resolve_scheduler(address, "prepare.dask_address")[0] is None and params.workers == 1
    if in_process and not is_url(raw) and not is_url(out):
        from pfactory.prepare.stage import prepare_dataset

        return prepare_dataset(raw, out, params, progress)
    return prepare_scaled(raw, out, params, address, progress)


def prepare_scaled(
    raw: str | os.PathLike[str],
    out: str | os.PathLike[str],
    params: PrepareParams,
    address: str | None,
    progress: Callable[[int, int], None] | None = None,
) -> Any:
    """Prepare `raw` into `out` on a Dask cluster (`address`: None / "local:N" / a scheduler address).

    Raises DatasetError (`raw` is not a dataset), OutputError (`out` cannot be written), ConnectionError (no
    scheduler), PrepareTaskError (a task failed on a worker: nothing is published) and, after publishing,
    RejectFractionExceeded -- as `prepare_dataset` does."""
    from pfactory.prepare.rawdata import RawSource

    t_start = time.perf_counter()
    source = RawSource(raw)
    try:
        return _prepare_scaled(source, raw, out, params, address, progress, t_start)
    finally:
        source.close()


def _prepare_scaled(
    source: Any,
    raw: str | os.PathLike[str],
    out: str | os.PathLike[str],
    params: PrepareParams,
    address: str | None,
    progress: Callable[[int, int], None] | None,
    t_start: float,
) -> Any:
    """`prepare_scaled`'s body on an open `source` (a RawSource): unit tasks, shard tasks as units come
    back, the merge into the manifest, the publish; returns `finish`'s PrepareResult."""
    from pfactory.prepare.publish import build_output
    from pfactory.prepare.stage import finish
    from pfactory.runtime import cluster
    from pfactory.sensors.errors import DatasetError

    ids = source.frame_ids
    if not ids:
        raise DatasetError(str(raw), "frames", "at least one frame, found none")
    t_list = time.perf_counter() - t_start
    U = params.unit_frames
    tag = uuid.uuid4().hex[:8]
    planner = ShardPlanner(-(-len(ids) // U), params.shard_max_frames)
    figures: dict[str, float] = {"seconds_list": t_list}

    with build_output(out, [raw]) as build:
        jobs = _unit_tasks(source, build, params, tag, ids)
        got = _Collected(build, params, planner, len(ids), progress)
        t0 = time.perf_counter()
        with cluster.dask_client(
            address, params.workers, params.threads_per_worker, "prepare.dask_address", WORKER_ENV
        ) as (client, _):  # the description: stderr + the MLflow tag prepare.cluster, never the manifest
            figures["seconds_cluster"] = time.perf_counter() - t0
            loop = cluster.run_tasks(
                client, jobs, got.on_result, PrepareTaskError, "prepare", lambda r: r.compute_s
            )
        assert len(got.units) == len(jobs), "every unit came back"

        t0 = time.perf_counter()
        manifest, rejected = _merge(build, params, source, ids, got)
        figures["seconds_merge"] = time.perf_counter() - t0
    figures["seconds_publish"] = time.perf_counter() - t0 - figures["seconds_merge"]

    seconds, counts, extra = _scaled_figures(got, loop, figures)
    return finish(out, manifest, rejected, ids, params, counts, seconds, time.perf_counter() - t_start, extra)


def _unit_tasks(source: Any, build: Location, params: PrepareParams, tag: str, ids: list[str]) -> list[Any]:
    """One `prepare-unit` cluster.Task per run of `params.unit_frames` consecutive frame ids."""
    from pfactory.runtime import cluster

    U = params.unit_frames
    jobs = []
    for i, start in enumerate(range(0, len(ids), U)):
        unit_ids = ids[start : start + U]
        job = UnitJob(source.spec, build, params, tag, i, start, unit_ids, source.unit_files(unit_ids))
        jobs.append(cluster.Task("prepare-unit", i, prepare_unit, (job,)))
    return jobs


@dataclass
class _Collected:
    """What the driver has back from its tasks: the units and shards by index, and the frames done
    (reported to `progress(done, n_frames)`); `on_result` starts the shards each unit completes."""

    build: Location
    params: PrepareParams
    planner: ShardPlanner
    n_frames: int
    progress: Callable[[int, int], None] | None
    units: dict[int, UnitOutcome] = field(default_factory=dict)
    shards: dict[str, dict[int, ShardOutcome]] = field(default_factory=lambda: {s: {} for s in SPLITS})
    done: int = 0

    def on_result(self, _: Any, res: Any) -> list[Any]:
        """Record a UnitOutcome or ShardOutcome; returns the shard tasks it makes ready (cluster.Task)."""
        from pfactory.runtime import cluster

        if isinstance(res, ShardOutcome):
            self.shards[res.split][res.index] = res
            return []
        self.units[res.index] = res
        self.done += sum(res.counts.values()) + len(res.rejected)
        if self.progress is not None:
            self.progress(self.done, self.n_frames)
        return [
            cluster.Task(
                f"prepare-shard-{s}", k, write_shard, (ShardJob(self.build, self.params, s, k, slices),)
            )
            for s, k, slices in self.planner.add(res.index, res.counts)
        ]


def _merge(
    build: Location, params: PrepareParams, source: Any, ids: list[str], got: _Collected
) -> tuple[Any, Any]:
    """Write `rejected.jsonl` and `manifest.json` from the units and shards, remove the pieces and any
    file the manifest does not list; returns `write_outputs`'s `(manifest, rejected)`."""
    from pfactory.prepare.stage import write_outputs

    units, shards = got.units, got.shards
    infos = {s: [shards[s][k].info for k in sorted(shards[s])] for s in SPLITS}
    manifest, rejected = write_outputs(
        build,
        params,
        source.origin,
        ids,
        [d for i in sorted(units) for d in units[i].digests],
        source.tables,
        infos,
        [r for u in units.values() for r in u.rejected],
        {c for u in units.values() for c in u.cameras},
    )
    build.remove_tree(PIECES)
    # Publish only what the manifest lists (a killed task may have left a temporary file behind).
    listed = {MANIFEST, REJECTED, *(i.file for s in SPLITS for i in infos[s])}
    for rel in build.files():
        if rel not in listed:
            build.remove(rel)
    return manifest, rejected


def _scaled_figures(
    got: _Collected, loop: Any, figures: dict[str, float]
) -> tuple[dict[str, float], dict[str, int], dict[str, Any]]:
    """`(seconds, counts, extra)` for `finish`: the units' stage seconds summed plus the shard writes,
    the image and point counts, and the cluster figures (`figures` and the task loop's)."""
    units, shards = got.units, got.shards
    seconds: dict[str, float] = {}
    for u in units.values():
        for k, v in u.seconds.items():
            seconds[k] = seconds.get(k, 0.0) + v
    seconds["shard_write"] = sum(o.compute_s for s in SPLITS for o in shards[s].values())
    rss = [u.peak_rss for u in units.values()] + [o.peak_rss for s in SPLITS for o in shards[s].values()]
    extra = {
        **figures,
        "seconds_tasks": loop.wall_s,
        "units": loop.by_prefix.get("prepare-unit", 0),
        "shard_tasks": loop.tasks - loop.by_prefix.get("prepare-unit", 0),
        "task_compute_s": loop.compute_s,
        "overhead_per_task_ms": 1000 * loop.overhead_per_task_s,
        "slots": loop.slots,
        "workers_used": len({u.worker for u in units.values()}),
        "peak_rss_worker_mb": max(rss) / 2**20 if rss else 0.0,
    }
    counts = {
        "images": sum(u.images for u in units.values()),
        "points_in": sum(u.points_in for u in units.values()),
        "points_out": sum(u.points_out for u in units.values()),
    }
    return seconds, counts, extra
