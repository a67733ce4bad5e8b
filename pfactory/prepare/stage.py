"""Raw dataset -> training-ready shards: the body of the `prepare` stage (streaming).

In: a raw dataset directory (any registered layout: `pfactory.sensors.datasets`) and `PrepareParams`. Out, in `out/`
(built in a staging sibling and renamed into place on success):
`manifest.json`, `rejected.jsonl`, `train/shard-*.parquet`, `val/shard-*.parquet`
(format: `pfactory.prepare.shards`).

Flow, one frame at a time in dataset order, with bounded buffers:
1. *read*: `pfactory.sensors.validate.inspect_frame` checks every part of the frame (the same
   checks as `factory data check`, except that images are checked by header and end marker
   only: DALI decodes them in step 3 and refuses what it cannot decode, so no image is
   decoded twice) and reads it; a frame with any problem is refused here.
   The frame's raw files are hashed (sha256) for the manifest.
2. *lidar* (`pfactory.prepare.lidar`), in this Python thread, while DALI works on the images of
   the frames before it;
3. *camera* (`pfactory.prepare.camera`): (frame, camera) pairs are queued and run through DALI
   in batches of `batch_size` pairs, so multi-camera frames batch naturally; an image DALI
   cannot decode, or whose decoded size differs from its header, refuses its frame;
4. *write*: frames leave in dataset order once all their images are back, go to the split
   chosen by a hash of the frame id, and are written as row groups of `batch_size` frames into
   shards of at most `shard_max_frames` (`SplitWriter`).
Memory is bounded by one DALI batch in flight, the frames waiting for it and one row group
per split -- it does not grow with the dataset (measured: benchmarks/bench_prepare.py).

Interruption: nothing is written to `out/` until the run completes (`pfactory.storage.fsutil.atomic_directory`,
which also refuses an `out` that is not prepare's own output or overlaps `raw`); a killed run leaves only
a staging directory `.<out>.<pid>-*.tmp`, removed by the next run once its process is gone. A re-run
restarts cleanly and, since every step is deterministic, writes the same bytes as an uninterrupted run
(tests/tasks/test_prepare.py kills one mid-run).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.prepare.camera import (
    CameraBatchError,
    CameraPipeline,
    ResizeGeometry,
    decoder_name,
    open_camera,
    resize_geometry,
)
from pfactory.prepare.errors import RejectFractionExceeded
from pfactory.prepare.lidar import LidarResult, process_lidar, reference_transform
from pfactory.prepare.params import NOT_IN_MANIFEST, PrepareParams
from pfactory.prepare.shards import (
    MANIFEST,
    REJECTED,
    SCHEMA_VERSION,
    SPLITS,
    PreparedFrame,
    ShardInfo,
    SplitWriter,
    arrow_schema,
)
from pfactory.sensors.checks import rel_path
from pfactory.sensors.datasets import open_dataset
from pfactory.sensors.digest import cached_listing, hash_frame, remember_if_unchanged, tables_digest
from pfactory.sensors.errors import DatasetError
from pfactory.sensors.frame import Frame
from pfactory.storage.fsutil import atomic_directory, sha256_bytes, sha256_file

PARTS = ("read", "hash", "lidar", "read_wait", "camera_wait", "write")
STAGE = "prepare"


def split_of(frame_id: str, val_fraction: float) -> str:
    """ "val" for a `val_fraction` share of frame ids, chosen by sha256 of the id (stable)."""
    h = int.from_bytes(hashlib.sha256(frame_id.encode("utf-8")).digest()[:8], "big")
    return "val" if h / 2.0**64 < val_fraction else "train"


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)`, or None off glibc.

    Why: frames allocate and free ~1-2 MB NumPy arrays in several threads; glibc raises its
    mmap threshold after such frees and then serves them from per-thread heaps that it does not
    hand back, so the resident set crept up with the frame count (measured on 600 KITTI frames:
    556 -> 674 MiB; with a trim every 16 frames it stays at 450-500 MiB, peak 695 -> 559 MiB, at
    no measurable cost in frames/s). Python's and Arrow's own allocations were flat throughout.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return lambda: trim(0)


# ----------------------------------------------------------------------------------------------
# Input hashing


def frame_files(dataset: Any, frame_id: str) -> list[tuple[str, Path]]:
    """The raw files one frame is made of (those that exist): `(name in the dataset, path)`, as the
    reader lists them (`DatasetReader.frame_files`: KITTI `velodyne/000001.bin`, nuScenes the table's
    `filename`), so the hash does not depend on where the dataset lives or on symlinks."""
    return dataset.frame_files(frame_id)


@dataclass(frozen=True)
class RawOrigin:
    """Where a prepare run's raw data comes from: the manifest's `source` besides its frame count and
    content hash (`source.sha256`), so that evaluate can reopen it (`pfactory.evaluate.raw_source`)."""

    layout: str  # the reader's name (entry point of `pfactory.datasets`)
    root: str  # the raw dataset's path or URL as given to prepare: a relative path stays relative
    plugin: dict[str, Any]  # the layout's plugin record (`PluginInfo.record`; files_sha256 for plugins only)

    def record(self) -> dict[str, Any]:
        """The manifest's `source` entries (besides frames and sha256)."""
        return {"layout": self.layout, "root": self.root, "plugin": self.plugin}


def raw_origin(raw: str | Path, layout: str) -> RawOrigin:
    """The `RawOrigin` of raw data at `raw` (a directory or URL) read by the reader `layout`. The root is
    spelled as given (posix form for a local path) so that the manifest stays byte-identical between reruns
    and machines; the plugin record has a files hash for an installed plugin only (a built-in reader's code
    is the project's, which DVC tracks as the stage's deps: hashing it here would change the prepared
    output with every edit of an unrelated module of pfactory/sensors)."""
    from pfactory.config import plugins
    from pfactory.storage.objects import is_url

    info = plugins.info(plugins.DATASETS, layout)
    if info.builtin:
        record = {
            "name": info.name,
            "target": info.target,
            "source": info.source,
            "dist": info.dist,
            "version": info.version,
        }
    else:
        record = info.record()
    root = str(raw) if is_url(raw) else Path(raw).as_posix()
    return RawOrigin(layout, root, record)


# ----------------------------------------------------------------------------------------------
# The streaming loop


@dataclass
class _Pending:
    """A frame whose images are in the camera queue or in flight."""

    index: int
    frame: Frame
    input_sha256: str
    T_ref_from_lidar: np.ndarray
    lidar: LidarResult
    geometry: list[ResizeGeometry]
    images: list[np.ndarray | None]
    remaining: int
    problem: dict[str, str] | None = None


@dataclass
class PrepareResult:
    """What a prepare run wrote and measured."""

    out: Path
    manifest: dict[str, Any]
    rejected: list[dict[str, str]]
    metrics: dict[str, float]


@dataclass
class _Run:
    """One prepare run's state: camera queue, frames waiting for their images, refusals, timers.

    Only the main thread touches it, except `read_frame`, which reads nothing but the dataset
    and params (the read workers run it).
    """

    dataset: Any
    root: Path
    params: PrepareParams
    staging: Path
    camera: CameraPipeline
    writers: dict[str, SplitWriter]
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    pending: deque[_Pending] = field(default_factory=deque)
    queue: deque[tuple[_Pending, int, bytes]] = field(default_factory=deque)
    inflight: list[tuple[_Pending, int, bytes]] | None = None
    rejected: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    cameras: set[str] = field(default_factory=set)
    images: int = 0
    points_in: int = 0
    points_out: int = 0

    # -- camera queue -----------------------------------------------------------------------
    def pump(self, drain: bool = False) -> None:
        """Keep DALI busy: submit full batches (and, when draining, the rest)."""
        B = self.camera.batch_size
        while len(self.queue) >= B or (drain and self.queue):
            if self.inflight is not None:
                self.collect()
            batch = [self.queue.popleft() for _ in range(min(B, len(self.queue)))]
            self.submit(batch)
        if drain and self.inflight is not None:
            self.collect()

    def submit(self, batch: list[tuple[_Pending, int, bytes]]) -> None:
        sizes = [(p.geometry[c].out_h, p.geometry[c].out_w) for p, c, _ in batch]
        try:
            self.camera.submit([data for _, _, data in batch], sizes)
        except CameraBatchError:  # refused at feed time: find the culprit image by image
            self._collect_each(batch)
            return
        self.inflight = batch

    def collect(self) -> None:
        batch, self.inflight = self.inflight, None
        assert batch is not None
        t0 = time.perf_counter()
        try:
            out = self.camera.collect()
        except CameraBatchError:
            self.seconds["camera_wait"] += time.perf_counter() - t0
            self._collect_each(batch)
            return
        self.seconds["camera_wait"] += time.perf_counter() - t0
        for j, (p, c, _) in enumerate(batch):
            self._deliver(p, c, out.images[j], out.decoded_hw[j], None)
        self.flush()

    def _collect_each(self, batch: list[tuple[_Pending, int, bytes]]) -> None:
        """A batch failed: run its images one by one to find the one(s) DALI refuses."""
        t0 = time.perf_counter()
        sizes = [(p.geometry[c].out_h, p.geometry[c].out_w) for p, c, _ in batch]
        results = self.camera.run_each([data for _, _, data in batch], sizes)
        self.seconds["camera_wait"] += time.perf_counter() - t0
        for (p, c, _), r in zip(batch, results):
            if isinstance(r, str):
                self._deliver(p, c, None, None, r)
            else:
                self._deliver(p, c, r.images[0], r.decoded_hw[0], None)
        self.flush()

    def _deliver(self, p: _Pending, c: int, image, hw, error: str | None) -> None:
        cam = p.frame.cameras[c]
        p.remaining -= 1
        if p.problem is not None:
            return
        w, h = cam.image_size
        if error is not None:
            p.problem = self._problem(
                p, cam.image_path, f"{cam.name} image", f"an image DALI decodes ({error})"
            )
        elif (int(hw[0]), int(hw[1])) != (h, w):
            p.problem = self._problem(
                p,
                cam.image_path,
                f"{cam.name} image size",
                f"the {w}x{h} of its header once decoded, got {int(hw[1])}x{int(hw[0])}",
            )
        else:
            p.images[c] = image
            self.images += 1

    def _problem(self, p: _Pending, file: Path, field_: str, reason: str) -> dict[str, str]:
        return {
            "frame_id": p.frame.frame_id,
            "file": rel_path(file, self.root, resolve=True),
            "reason": f"{field_}: expected {reason}",
        }

    # -- output -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Write every leading pending frame whose images are all back (dataset order)."""
        while self.pending and self.pending[0].remaining == 0:
            p = self.pending.popleft()
            if p.problem is not None:
                self.rejected.append((p.index, p.problem))
                continue
            t0 = time.perf_counter()
            self.writers[split_of(p.frame.frame_id, self.params.val_fraction)].add(self._row(p))
            self.seconds["write"] += time.perf_counter() - t0  # row building + Parquet writes

    def _row(self, p: _Pending) -> PreparedFrame:
        f, lid = p.frame, p.lidar
        T_lidar_from_ref = np.linalg.inv(p.T_ref_from_lidar)
        K = np.stack([g.intrinsics(c.K) for g, c in zip(p.geometry, f.cameras)]).reshape(-1, 3, 3)
        T = np.stack([c.T_cam_from_lidar @ T_lidar_from_ref for c in f.cameras]).reshape(-1, 4, 4)
        P = K @ T[:, :3, :]  # [C, 3, 4]: reference frame -> padded-image pixels
        self.points_out += len(lid.points)
        return PreparedFrame(
            frame_id=f.frame_id,
            split=split_of(f.frame_id, self.params.val_fraction),
            source=f.source,
            input_sha256=p.input_sha256,
            T_ref_from_lidar=p.T_ref_from_lidar,
            points=lid.points,
            n_points_raw=lid.n_points_raw,
            cam_names=[c.name for c in f.cameras],
            cam_image=[im for im in p.images if im is not None],
            cam_P=P,
            cam_K=K,
            cam_T=T,
            cam_orig_size=np.array([c.image_size for c in f.cameras], dtype=np.int32).reshape(-1, 2),
            cam_resized_size=np.array([(g.out_w, g.out_h) for g in p.geometry], dtype=np.int32).reshape(
                -1, 2
            ),
            cam_scale=np.array([(g.sx, g.sy) for g in p.geometry], dtype=np.float64).reshape(-1, 2),
            boxes=lid.boxes,
            labels=lid.labels,
            names=lid.names,
            difficulty=lid.difficulty,
            num_points_in_box=lid.num_points_in_box,
        )

    # -- one frame ----------------------------------------------------------------------------
    def read_frame(self, index: int, frame_id: str) -> _ReadResult:
        """Check, read, hash and run the lidar path of one frame (thread-safe: a worker runs it).

        The heavy parts (file reads, NumPy, sha256) release the GIL, so `num_threads` workers
        run them in parallel with the main thread and DALI. Images are not decoded here
        (`decode_images=False`: header, size and end marker only); DALI's decode is the one
        decode, and `_deliver` refuses a frame whose image DALI cannot decode or whose decoded
        size differs from its header.
        """
        from pfactory.sensors.validate import inspect_frame

        prm = self.params
        t0 = time.perf_counter()
        fc = inspect_frame(self.dataset, frame_id, min_points=prm.min_points, decode_images=False)
        frame = fc.frame
        encoded: dict[Path, bytes] = {}
        if frame is not None:
            for cam in frame.cameras:
                encoded[Path(cam.image_path)] = Path(cam.image_path).read_bytes()
        t1 = time.perf_counter()
        digest = hash_frame(frame_files(self.dataset, frame_id), encoded)
        t2 = time.perf_counter()
        rr = _ReadResult(index, frame_id, digest, {"read": t1 - t0, "hash": t2 - t1})
        if not fc.ok or frame is None:
            first = fc.problems[0]
            reason = f"{first['field']}: expected {first['reason']}"
            if len(fc.problems) > 1:
                more = "; ".join(
                    f"{q['file']}: {q['field']}: expected {q['reason']}" for q in fc.problems[1:]
                )
                reason += f" (and {len(fc.problems) - 1} more: {more})"
            rr.problem = {"frame_id": frame_id, "file": first["file"], "reason": reason}
            return rr
        rr.frame, rr.encoded = frame, encoded
        rr.T_ref = reference_transform(self.dataset, frame_id, prm.reference_frame)
        rr.lidar = process_lidar(
            frame.points,
            frame.boxes,
            rr.T_ref,
            prm.pc_range,
            prm.ego_radius_m,
            prm.voxel_size,
            prm.class_map,
            prm.classes,
        )
        rr.seconds["lidar"] = time.perf_counter() - t2
        roi = roi_problem(frame, rr.lidar, prm, self.root)
        if roi is not None:
            rr.problem = {
                "frame_id": frame_id,
                "file": roi["file"],
                "reason": f"{roi['field']}: expected {roi['reason']}",
            }
            rr.frame, rr.lidar = None, None
        return rr

    def accept(self, rr: _ReadResult) -> None:
        """Main thread: record a refusal, or queue the frame's images for DALI."""
        for k, v in rr.seconds.items():
            self.seconds[k] += v
        if rr.problem is not None:
            self.rejected.append((rr.index, rr.problem))
            return
        frame, lidar = rr.frame, rr.lidar
        assert frame is not None and lidar is not None and rr.T_ref is not None
        self.points_in += lidar.n_points_raw
        frame.points = np.zeros((0, 4), np.float32)  # drop the raw sweep (~2 MB): not needed any more
        geometry = [resize_geometry(c.image_size, tuple(self.params.image_size)) for c in frame.cameras]
        p = _Pending(
            rr.index,
            frame,
            rr.digest,
            rr.T_ref,
            lidar,
            geometry,
            [None] * len(frame.cameras),
            len(frame.cameras),
        )
        self.cameras.update(c.name for c in frame.cameras)
        self.pending.append(p)
        for c, cam in enumerate(frame.cameras):
            self.queue.append((p, c, rr.encoded[Path(cam.image_path)]))
        if not frame.cameras:
            self.flush()


def roi_problem(frame: Frame, lidar: LidarResult, params: PrepareParams, root: Path) -> dict[str, str] | None:
    """The problem of a frame with fewer than `min_points` points inside the ROI (all points at the origin,
    all outside `pc_range`), or None. Such a frame would become a row with no points and all its boxes,
    teaching the detector that objects are invisible. (`factory data check` applies it too.)"""
    if lidar.n_points_roi >= params.min_points:
        return None
    return {
        "frame_id": frame.frame_id,
        "file": rel_path(frame.lidar_path or ".", root, resolve=True),
        "field": "points",
        "reason": (
            f"at least {params.min_points} points (prepare.min_points) inside prepare.pc_range {params.pc_range} "
            f"and beyond prepare.ego_radius_m {params.ego_radius_m:g} m, got {lidar.n_points_roi} of "
            f"{lidar.n_points_raw}"
        ),
    }


def roi_problems(dataset: Any, frame_ids: list[str], params: PrepareParams) -> list[dict[str, str]]:
    """`roi_problem` of each of `frame_ids` (frames that read cleanly) of an open dataset."""
    out = []
    for fid in frame_ids:
        frame = dataset.read(fid)
        lidar = process_lidar(
            frame.points, frame.boxes, reference_transform(dataset, fid, params.reference_frame),
            params.pc_range, params.ego_radius_m, None, params.class_map, params.classes,
        )  # fmt: skip
        problem = roi_problem(frame, lidar, params, Path(dataset.root))
        if problem is not None:
            out.append(problem)
    return out


@dataclass
class _ReadResult:
    """What a read worker hands to the main thread for one frame."""

    index: int
    frame_id: str
    digest: str
    seconds: dict[str, float]
    problem: dict[str, str] | None = None
    frame: Frame | None = None
    encoded: dict[Path, bytes] = field(default_factory=dict)
    T_ref: np.ndarray | None = None
    lidar: LidarResult | None = None


def new_run(
    dataset: Any,
    params: PrepareParams,
    staging: Path | None,
    writers: dict,
    threads: int,
    cached: bool = False,
) -> _Run:
    """A `_Run` over `dataset` whose frames go to `writers` (split -> an object with `add(PreparedFrame)`):
    the shards' `SplitWriter`s in one process, a unit's piece writers on a Dask worker (`cached`: reuse this
    process's DALI pipeline across units, `camera_pipeline`)."""
    camera = camera_pipeline(params, threads) if cached else _camera(params, threads)
    return _Run(dataset, Path(dataset.root), params, staging, camera, writers)  # type: ignore[arg-type]


def _camera(params: PrepareParams, threads: int) -> CameraPipeline:
    """DALI's camera pipeline, or Pillow's where DALI is not installed (`camera.open_camera`)."""
    W, H = params.image_size
    return open_camera(  # type: ignore[return-value]  (PillowCamera: the same interface)
        (W, H), params.image_mean, params.image_std, params.batch_size, threads, params.device
    )


_CAMERAS: dict[tuple, CameraPipeline] = {}


def camera_pipeline(params: PrepareParams, threads: int) -> CameraPipeline:
    """The DALI camera pipeline of `params` with `threads` threads, built once per process (a Dask worker
    runs many units: the pipeline is built at its first batch and reused)."""
    key = (
        CameraPipeline, tuple(params.image_size), tuple(params.image_mean), tuple(params.image_std),
        params.batch_size, threads, params.device,
    )  # fmt: skip
    if key not in _CAMERAS:
        _CAMERAS[key] = _camera(params, threads)
    return _CAMERAS[key]


def stream_frames(
    run: _Run,
    ids: list[str],
    first_index: int,
    threads: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Run frames `ids` (global indices `first_index`, ...) through `run`: checks + read + lidar on
    `threads` read workers, camera on DALI, rows to `run.writers` in dataset order. Returns the
    `frame_id \t input sha256` lines of the frames, in order (the manifest's source digest)."""
    digests = []
    # Read-ahead: at most `read_ahead` frames are being read/checked by the workers, so memory
    # stays bounded; results are taken in dataset order.
    read_ahead = 2 * threads
    trim = _malloc_trim()
    B = run.params.batch_size
    with ThreadPoolExecutor(threads, thread_name_prefix="prepare-read") as pool:
        futures: deque[Future[_ReadResult]] = deque()
        next_id = 0
        for i in range(len(ids)):
            while next_id < len(ids) and len(futures) < read_ahead:
                futures.append(pool.submit(run.read_frame, first_index + next_id, ids[next_id]))
                next_id += 1
            t0 = time.perf_counter()
            rr = futures.popleft().result()
            run.seconds["read_wait"] += time.perf_counter() - t0
            digests.append(f"{rr.frame_id}\t{rr.digest}")
            run.accept(rr)
            run.pump()
            if trim is not None and i % B == B - 1:
                trim()  # keep the resident set flat (see `_malloc_trim`)
            if progress is not None:
                progress(i + 1, len(ids))
    run.pump(drain=True)
    run.flush()
    assert not run.pending and not run.queue, "frames left behind in the camera queue"
    return digests


def prepare_dataset(
    raw: str | Path,
    out: str | Path,
    params: PrepareParams,
    progress: Callable[[int, int], None] | None = None,
) -> PrepareResult:
    """Prepare `raw` into `out` in this process (see the module docstring); returns the manifest and
    metrics. `pfactory.prepare.scaleout` is the same work in units on a Dask cluster, same bytes.

    Raises DatasetError when `raw` is not a dataset, and RejectFractionExceeded (after
    writing everything, with `"passed": false` in the manifest) when too many frames are refused.
    """
    from pfactory.sensors.validate import dataset_frame_ids

    t_start = time.perf_counter()
    raw, out = Path(raw), Path(out)
    dataset = open_dataset(raw)
    ids = dataset_frame_ids(dataset)
    if not ids:
        raise DatasetError(raw, "frames", "at least one frame, found none")
    W, H = params.image_size
    schema = arrow_schema((3, H, W))
    listing = cached_listing(dataset)  # the files as they are before reading (None: no digest cache, no stat)
    with atomic_directory(out, stage=STAGE, inputs=[raw]) as tmp:
        writers = {s: SplitWriter(tmp, s, schema, params.shard_max_frames, params.batch_size) for s in SPLITS}
        run = new_run(dataset, params, tmp, writers, params.num_threads)
        digests = stream_frames(run, ids, 0, params.num_threads, progress)
        t0 = time.perf_counter()
        shards = {s: w.close() for s, w in writers.items()}
        run.seconds["write"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        for infos in shards.values():
            for s in infos:
                s.bytes = (tmp / s.file).stat().st_size
                s.sha256 = sha256_file(tmp / s.file)
        manifest, rejected = write_outputs(
            tmp,
            params,
            raw_origin(raw, dataset.layout),
            ids,
            digests,
            tables_digest(dataset),
            shards,
            run.rejected,
            run.cameras,
        )
        run.seconds["hash"] += time.perf_counter() - t0
    # The files unchanged while read: evaluate's check of these files then needs no second read of them.
    remember_if_unchanged(dataset, listing, manifest["source"]["sha256"])
    counts = {"images": run.images, "points_in": run.points_in, "points_out": run.points_out}
    return finish(out, manifest, rejected, ids, params, counts, run.seconds, time.perf_counter() - t_start)


def write_outputs(
    tmp: Any,
    params: PrepareParams,
    origin: RawOrigin,
    ids: list[str],
    digests: list[str],
    tables: str | None,
    shards: dict[str, list[ShardInfo]],
    rejected_at: list[tuple[int, dict[str, str]]],
    cameras: set[str],
) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """Write `rejected.jsonl`, then `manifest.json` (last: its presence marks a complete output) into the
    build directory `tmp` (a Path, or anything with `write_bytes(rel, data)`: `pfactory.storage.objects`).

    `origin`: where the raw data comes from (`raw_origin`); `rejected_at`: (global frame index, refusal)
    pairs in any order; `digests`: `frame_id \t sha256` lines in dataset order; `shards` with their bytes
    and sha256 filled in."""
    rejected = [r for _, r in sorted(rejected_at, key=lambda x: x[0])]
    data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rejected).encode()
    put = tmp.write_bytes if not isinstance(tmp, Path) else (lambda rel, b: (tmp / rel).write_bytes(b))
    put(REJECTED, data)
    n_ok = sum(s.frames for infos in shards.values() for s in infos)
    passed = len(rejected) <= params.max_reject_fraction * len(ids)
    input_digest = sha256_bytes(("\n".join(digests) + f"\ntables\t{tables}").encode())
    manifest = _manifest(
        params, origin, ids, input_digest, shards, rejected, sha256_bytes(data), sorted(cameras), passed
    )
    assert n_ok + len(rejected) == len(ids), "every frame is either in a shard or refused"
    put(MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return manifest, rejected


def finish(
    out: Any,
    manifest: dict[str, Any],
    rejected: list[dict[str, str]],
    ids: list[str],
    params: PrepareParams,
    counts: dict[str, int],
    seconds: dict[str, float],
    total: float,
    extra: dict[str, float] | None = None,
) -> PrepareResult:
    """The run's `PrepareResult` (metrics), or RejectFractionExceeded when it did not pass."""
    metrics = {
        "frames_total": len(ids),
        "frames_train": manifest["counts"]["train"],
        "frames_val": manifest["counts"]["val"],
        "frames_rejected": len(rejected),
        **counts,
        "seconds_total": total,
        "frames_per_s": len(ids) / total if total > 0 else 0.0,
        **{f"seconds_{k}": v for k, v in seconds.items()},
        **(extra or {}),
    }
    result = PrepareResult(out, manifest, rejected, metrics)
    if not manifest["passed"]:
        raise RejectFractionExceeded(
            len(rejected), len(ids), params.max_reject_fraction, f"{out}/{REJECTED}", result
        )
    return result


def _manifest(
    params: PrepareParams,
    origin: RawOrigin,
    ids: list[str],
    input_digest: str,
    shards: dict[str, list[ShardInfo]],
    rejected: list[dict[str, str]],
    rejected_sha: str,
    cameras: list[str],
    passed: bool,
) -> dict[str, Any]:
    """manifest.json: deterministic (no times; the raw root as given) so reruns are byte-identical."""
    from pfactory.runtime.lineage import package_versions

    W, H = params.image_size
    versions = package_versions(("nvidia-dali-cuda120", "pyarrow", "numpy", "pillow"))
    counts = {s: sum(i.frames for i in shards[s]) for s in SPLITS}
    manifest: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "passed": passed,
        "counts": {**counts, "rejected": len(rejected), "total": len(ids)},
        "source": {**origin.record(), "frames": len(ids), "sha256": input_digest},
        "image": {
            "shape": [3, H, W],
            "dtype": "float16",
            "layout": "CHW",
            "mean": params.image_mean,
            "std": params.image_std,
            "normalization": "(rgb / 255 - mean) / std; padding right/bottom with 0 (the mean colour)",
            "decoder": decoder_name(params.device),
        },
        "reference_frame": params.reference_frame,
        "cameras": cameras,
        "classes": params.classes,
        "splits": {
            s: {
                "frames": counts[s],
                "shards": [
                    {
                        "file": i.file,
                        "frames": i.frames,
                        "row_groups": i.row_groups,
                        "bytes": i.bytes,
                        "sha256": i.sha256,
                    }
                    for i in shards[s]
                ],
            }
            for s in SPLITS
        },
        "rejected": {"file": REJECTED, "count": len(rejected), "sha256": rejected_sha},
        "params": params.model_dump(mode="json", exclude=set(NOT_IN_MANIFEST)),
        "versions": versions,
    }
    if not passed:
        manifest["failure"] = (
            f"{len(rejected)} of {len(ids)} frames refused, more than max_reject_fraction "
            f"{params.max_reject_fraction}"
        )
    return manifest
