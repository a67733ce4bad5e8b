"""The prepared-shard format: one Parquet row per frame, its writer and its reader.

Layout of a prepared directory (`paths.prepared`):
```
manifest.json              schema version, counts per split, hashes of inputs and outputs, params
rejected.jsonl             one {"frame_id", "file", "reason"} per refused frame
train/shard-00000.parquet  <= prepare.shard_max_frames rows each, row groups of prepare.batch_size
val/shard-00000.parquet
```
Row schema (SCHEMA_VERSION 1); every geometric quantity is in the *reference frame* (the lidar
frame rotated to the ego vehicle's axes: x forward, y left, z up, origin at the lidar, metres):
| column | type | meaning |
|---|---|---|
| frame_id, split, source | string | id in the raw dataset, "train"/"val", "kitti"/"nuscenes" |
| input_sha256 | string | sha256 over the frame's raw files (relative path + content hash) |
| T_ref_from_lidar | fixed_size_list<float64, 16> | row-major 4x4 applied to the raw lidar points |
| points | list<fixed_size_list<float32, 4>> | `[P, 4]` (x, y, z, intensity in [0, 1]) after crop |
| n_points, n_points_raw | int32 | P, and the sweep's size before any filtering |
| cam_names | list<string> | `[C]` camera names (KITTI "image_2"; nuScenes CAM_*, sorted) |
| cam_image | list<binary> | `[C]` float16 little-endian `[3, H, W]` normalized images (CHW) |
| cam_P | list<fixed_size_list<float64, 12>> | `[C, 3, 4]` reference frame -> padded-image pixels |
| cam_K | list<fixed_size_list<float64, 9>> | `[C, 3, 3]` intrinsics of the resized image |
| cam_T | list<fixed_size_list<float64, 16>> | `[C, 4, 4]` T_cam_from_ref |
| cam_orig_size, cam_resized_size | list<fixed_size_list<int32, 2>> | `[C, 2]` (w, h) raw / before padding |
| cam_scale | list<fixed_size_list<float64, 2>> | `[C, 2]` (sx, sy) resized / raw |
| boxes | list<fixed_size_list<float32, 7>> | `[M, 7]` (x, y, z, l, w, h, yaw), centre in the ROI |
| labels | list<int16> | `[M]` index into manifest "classes"; -1 = not a training class |
| names | list<string> | `[M]` the dataset's class names |
| difficulty | list<int8> | `[M]` KITTI 0/1/2, -1 unknown |
| num_points_in_box | list<int32> | `[M]` stored points inside each box |

Why these types: fixed-size lists of float32 round-trip exactly and are zero-copy both ways
(`to_numpy` on the flat values), and any Parquet tool can read them, unlike an opaque blob.
Images are float16 because prepare's contract is *normalized* CHW: float16 halves the bytes
of float32 (3x128x416: 320 KiB instead of 640 KiB) and its rounding error (<= 2^-11 relative,
< 0.002 near |x| = 2) is under 1/8 of one 8-bit grey level after normalization (1/255/0.229 =
0.017), so nothing a uint8 source held is lost. Measurements and the compression choice: docs/DATA.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pfactory.prepare.errors import SchemaError
from pfactory.storage import artifacts as af
from pfactory.storage.fsutil import read_json_object

SCHEMA_VERSION = 1
MANIFEST = af.PREPARED_MANIFEST
REJECTED = af.REJECTED
SPLITS = ("train", "val")
META_VERSION = b"pfactory.schema_version"
META_IMAGE = b"pfactory.image_shape"
# zstd level 1 on every column, with Parquet's default dictionary encoding. Measured on real
# KITTI rows (CPU ms per frame, best of 3; docs/DATA.md): 0.58 MB, write 5.7, read 1.8 --
# against zstd without dictionaries 0.95 MB / 4.9 / 2.2 and uncompressed 1.35 MB / 2.5 / 1.2.
# KITTI's point coordinates are quantized, so dictionaries pay; the write is a small part of
# the stage next to the decode.
COMPRESSION = "zstd"
COMPRESSION_LEVEL = 1


def _fixed(inner: pa.DataType, n: int) -> pa.DataType:
    return pa.list_(inner, n)


def arrow_schema(image_shape: tuple[int, int, int]) -> pa.Schema:
    """The Arrow schema of a shard row (see the module docstring), with version metadata."""
    fields = [
        pa.field("frame_id", pa.string(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("input_sha256", pa.string(), nullable=False),
        pa.field("T_ref_from_lidar", _fixed(pa.float64(), 16), nullable=False),
        pa.field("points", pa.list_(_fixed(pa.float32(), 4)), nullable=False),
        pa.field("n_points", pa.int32(), nullable=False),
        pa.field("n_points_raw", pa.int32(), nullable=False),
        pa.field("cam_names", pa.list_(pa.string()), nullable=False),
        pa.field("cam_image", pa.list_(pa.binary()), nullable=False),
        pa.field("cam_P", pa.list_(_fixed(pa.float64(), 12)), nullable=False),
        pa.field("cam_K", pa.list_(_fixed(pa.float64(), 9)), nullable=False),
        pa.field("cam_T", pa.list_(_fixed(pa.float64(), 16)), nullable=False),
        pa.field("cam_orig_size", pa.list_(_fixed(pa.int32(), 2)), nullable=False),
        pa.field("cam_resized_size", pa.list_(_fixed(pa.int32(), 2)), nullable=False),
        pa.field("cam_scale", pa.list_(_fixed(pa.float64(), 2)), nullable=False),
        pa.field("boxes", pa.list_(_fixed(pa.float32(), 7)), nullable=False),
        pa.field("labels", pa.list_(pa.int16()), nullable=False),
        pa.field("names", pa.list_(pa.string()), nullable=False),
        pa.field("difficulty", pa.list_(pa.int8()), nullable=False),
        pa.field("num_points_in_box", pa.list_(pa.int32()), nullable=False),
    ]
    meta = {META_VERSION: str(SCHEMA_VERSION).encode(), META_IMAGE: ",".join(map(str, image_shape)).encode()}
    return pa.schema(fields, metadata=meta)


@dataclass
class PreparedFrame:
    """One prepared frame: what a shard row holds, as NumPy (shapes in the module docstring)."""

    frame_id: str
    split: str
    source: str
    input_sha256: str
    T_ref_from_lidar: np.ndarray  # [4, 4] float64
    points: np.ndarray  # [P, 4] float32, reference frame
    n_points_raw: int
    cam_names: list[str]
    cam_image: list[np.ndarray]  # C x [3, H, W] float16
    cam_P: np.ndarray  # [C, 3, 4] float64
    cam_K: np.ndarray  # [C, 3, 3] float64
    cam_T: np.ndarray  # [C, 4, 4] float64, T_cam_from_ref
    cam_orig_size: np.ndarray  # [C, 2] int32 (w, h)
    cam_resized_size: np.ndarray  # [C, 2] int32 (w, h)
    cam_scale: np.ndarray  # [C, 2] float64 (sx, sy)
    boxes: np.ndarray  # [M, 7] float32
    labels: np.ndarray  # [M] int16
    names: list[str]
    difficulty: np.ndarray  # [M] int8
    num_points_in_box: np.ndarray  # [M] int32

    @property
    def n_points(self) -> int:
        return len(self.points)


# ----------------------------------------------------------------------------------------------
# NumPy <-> Arrow


def _list_of_fixed(arrays: list[np.ndarray], width: int, dtype: Any) -> pa.Array:
    """Rows of `[n_i, width]` arrays -> list<fixed_size_list<dtype, width>> (one copy)."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([a.shape[0] if a.ndim > 1 else len(a) // width for a in arrays], out=offsets[1:])
    flat = (
        np.concatenate([np.ascontiguousarray(a, dtype=dtype).reshape(-1) for a in arrays])
        if arrays
        else np.zeros(0, dtype)
    )
    values = pa.FixedSizeListArray.from_arrays(pa.array(flat), width)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def _list_of(arrays: list[np.ndarray], dtype: Any) -> pa.Array:
    """Rows of `[n_i]` arrays -> list<dtype>."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    flat = np.concatenate([np.asarray(a, dtype=dtype) for a in arrays]) if arrays else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def _list_of_binary(rows: list[list[np.ndarray]]) -> pa.Array:
    """Rows of lists of arrays -> list<binary> (each array's raw bytes)."""
    blobs = [a for row in rows for a in row]
    sizes = np.array([a.nbytes for a in blobs], dtype=np.int64)
    boffsets = np.zeros(len(blobs) + 1, dtype=np.int32)
    np.cumsum(sizes, out=boffsets[1:])
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in blobs)
    binary = pa.BinaryArray.from_buffers(
        pa.binary(), len(blobs), [None, pa.py_buffer(boffsets.tobytes()), pa.py_buffer(data)]
    )
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), binary)


def _list_of_str(rows: list[list[str]]) -> pa.Array:
    return pa.array(rows, type=pa.list_(pa.string()))


def frames_to_table(frames: list[PreparedFrame], schema: pa.Schema) -> pa.Table:
    """Prepared frames -> one Arrow table with `schema` (column order and types fixed)."""
    cols = {
        "frame_id": pa.array([f.frame_id for f in frames], pa.string()),
        "split": pa.array([f.split for f in frames], pa.string()),
        "source": pa.array([f.source for f in frames], pa.string()),
        "input_sha256": pa.array([f.input_sha256 for f in frames], pa.string()),
        "T_ref_from_lidar": pa.FixedSizeListArray.from_arrays(
            pa.array(np.concatenate([f.T_ref_from_lidar.reshape(-1) for f in frames]).astype(np.float64)), 16
        ),
        "points": _list_of_fixed([f.points for f in frames], 4, np.float32),
        "n_points": pa.array([f.n_points for f in frames], pa.int32()),
        "n_points_raw": pa.array([f.n_points_raw for f in frames], pa.int32()),
        "cam_names": _list_of_str([f.cam_names for f in frames]),
        "cam_image": _list_of_binary([f.cam_image for f in frames]),
        "cam_P": _list_of_fixed([f.cam_P.reshape(-1, 12) for f in frames], 12, np.float64),
        "cam_K": _list_of_fixed([f.cam_K.reshape(-1, 9) for f in frames], 9, np.float64),
        "cam_T": _list_of_fixed([f.cam_T.reshape(-1, 16) for f in frames], 16, np.float64),
        "cam_orig_size": _list_of_fixed([f.cam_orig_size.reshape(-1, 2) for f in frames], 2, np.int32),
        "cam_resized_size": _list_of_fixed([f.cam_resized_size.reshape(-1, 2) for f in frames], 2, np.int32),
        "cam_scale": _list_of_fixed([f.cam_scale.reshape(-1, 2) for f in frames], 2, np.float64),
        "boxes": _list_of_fixed([f.boxes.reshape(-1, 7) for f in frames], 7, np.float32),
        "labels": _list_of([f.labels for f in frames], np.int16),
        "names": _list_of_str([f.names for f in frames]),
        "difficulty": _list_of([f.difficulty for f in frames], np.int8),
        "num_points_in_box": _list_of([f.num_points_in_box for f in frames], np.int32),
    }
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def fixed_rows(col: pa.ChunkedArray | pa.Array, width: int, dtype: Any) -> list[np.ndarray]:
    """list<fixed_size_list<dtype, width>> -> per-row `[n_i, width]` views (zero-copy)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy()
    flat_fixed = arr.values  # FixedSizeListArray over all rows (sliced to this array)
    base = flat_fixed.offset * width
    values = flat_fixed.values.to_numpy(zero_copy_only=False)[base:].astype(dtype, copy=False)
    mat = values.reshape(-1, width) if width else values
    return [mat[offsets[i] : offsets[i + 1]] for i in range(len(arr))]


def prim_rows(col: pa.ChunkedArray | pa.Array, dtype: Any) -> list[np.ndarray]:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(arr))]


def image_rows(col: pa.ChunkedArray | pa.Array, image_shape: tuple[int, int, int]) -> list[list[np.ndarray]]:
    """list<binary> image column -> per row, per camera `[3, H, W]` float16 views (zero-copy)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy()
    blobs = arr.values
    out = []
    for i in range(len(arr)):
        out.append(
            [
                np.frombuffer(blobs[j].as_buffer(), dtype="<f2").reshape(image_shape)
                for j in range(offsets[i], offsets[i + 1])
            ]
        )
    return out


def table_to_frames(table: pa.Table, image_shape: tuple[int, int, int]) -> list[PreparedFrame]:
    """A shard table (or row group) -> prepared frames (arrays are views into the table)."""
    n = table.num_rows
    c = table.column
    pts = fixed_rows(c("points"), 4, np.float32)
    boxes = fixed_rows(c("boxes"), 7, np.float32)
    P = fixed_rows(c("cam_P"), 12, np.float64)
    K = fixed_rows(c("cam_K"), 9, np.float64)
    T = fixed_rows(c("cam_T"), 16, np.float64)
    osz = fixed_rows(c("cam_orig_size"), 2, np.int32)
    rsz = fixed_rows(c("cam_resized_size"), 2, np.int32)
    scl = fixed_rows(c("cam_scale"), 2, np.float64)
    labels = prim_rows(c("labels"), np.int16)
    diff = prim_rows(c("difficulty"), np.int8)
    npib = prim_rows(c("num_points_in_box"), np.int32)
    imgs = image_rows(c("cam_image"), image_shape)
    T_ref = c("T_ref_from_lidar").combine_chunks().flatten().to_numpy().reshape(n, 4, 4)
    ids, splits, sources, sha = (c(k).to_pylist() for k in ("frame_id", "split", "source", "input_sha256"))
    cam_names, names, n_raw = (
        c("cam_names").to_pylist(),
        c("names").to_pylist(),
        c("n_points_raw").to_pylist(),
    )
    return [
        PreparedFrame(
            frame_id=ids[i],
            split=splits[i],
            source=sources[i],
            input_sha256=sha[i],
            T_ref_from_lidar=T_ref[i],
            points=pts[i],
            n_points_raw=n_raw[i],
            cam_names=cam_names[i],
            cam_image=imgs[i],
            cam_P=P[i].reshape(-1, 3, 4),
            cam_K=K[i].reshape(-1, 3, 3),
            cam_T=T[i].reshape(-1, 4, 4),
            cam_orig_size=osz[i],
            cam_resized_size=rsz[i],
            cam_scale=scl[i],
            boxes=boxes[i],
            labels=labels[i],
            names=names[i],
            difficulty=diff[i],
            num_points_in_box=npib[i],
        )
        for i in range(n)
    ]


# ----------------------------------------------------------------------------------------------
# Writing


@dataclass
class ShardInfo:
    """One written shard: path relative to the prepared dir, row count, row groups, hash."""

    file: str
    frames: int
    row_groups: int
    bytes: int = 0
    sha256: str = ""


@dataclass
class SplitWriter:
    """Streams prepared frames of one split into shards of at most `max_frames` rows.

    Rows are buffered and written as a row group every `row_group_frames` rows, so memory
    holds at most one row group per split. Shard boundaries and row groups depend only on
    the sequence of frames added: the same frames in the same order give the same bytes.
    """

    root: Path
    split: str
    schema: pa.Schema
    max_frames: int
    row_group_frames: int
    first_shard: int = 0  # number of the first shard written (a Dask shard task writes shard k alone)
    shards: list[ShardInfo] = field(default_factory=list)
    _buffer: list[PreparedFrame] = field(default_factory=list)
    _writer: pq.ParquetWriter | None = None
    _in_shard: int = 0
    write_seconds: float = 0.0

    def add(self, frame: PreparedFrame) -> None:
        self._buffer.append(frame)
        if (
            len(self._buffer) >= self.row_group_frames
            or self._in_shard + len(self._buffer) >= self.max_frames
        ):
            self._flush()

    def _flush(self) -> None:
        import time

        if not self._buffer:
            return
        t0 = time.perf_counter()
        if self._writer is None:
            rel = f"{self.split}/shard-{self.first_shard + len(self.shards):05d}.parquet"
            (self.root / self.split).mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(
                self.root / rel, self.schema, compression=COMPRESSION, compression_level=COMPRESSION_LEVEL
            )
            self.shards.append(ShardInfo(rel, 0, 0))
        table = frames_to_table(self._buffer, self.schema)
        self._writer.write_table(table, row_group_size=len(self._buffer))
        info = self.shards[-1]
        info.frames += len(self._buffer)
        info.row_groups += 1
        self._in_shard += len(self._buffer)
        self._buffer = []
        if self._in_shard >= self.max_frames:
            self._close_shard()
        self.write_seconds += time.perf_counter() - t0

    def _close_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._in_shard = 0

    def close(self) -> list[ShardInfo]:
        """Flush and close; returns the shards written (without hashes; see `finalize`)."""
        self._flush()
        self._close_shard()
        return self.shards


# ----------------------------------------------------------------------------------------------
# Reading


@dataclass
class PreparedDataset:
    """A prepared directory opened for reading: its manifest and the shards of each split."""

    root: Path
    manifest: dict[str, Any]

    @property
    def image_shape(self) -> tuple[int, int, int]:
        c, h, w = self.manifest["image"]["shape"]
        return (int(c), int(h), int(w))

    @property
    def cameras(self) -> list[str]:
        return list(self.manifest["cameras"])

    @property
    def classes(self) -> list[str]:
        return list(self.manifest["classes"])

    def shard_paths(self, split: str) -> list[Path]:
        if split not in self.manifest["splits"]:
            raise KeyError(f"{self.root}: no split {split!r}; has {sorted(self.manifest['splits'])}")
        return [self.root / s["file"] for s in self.manifest["splits"][split]["shards"]]

    def num_frames(self, split: str) -> int:
        return int(self.manifest["splits"][split]["frames"])

    def iter_frames(self, split: str, columns: list[str] | None = None):
        """Yield every `PreparedFrame` of `split` in stored order, one row group at a time."""
        for path in self.shard_paths(split):
            pf = open_shard(path)
            for rg in range(pf.num_row_groups):
                yield from table_to_frames(pf.read_row_group(rg, columns=columns), self.image_shape)


def check_schema_version(found: Any, where: str | Path) -> None:
    """Refuse data written by a newer pfactory (an older version is readable: none exists yet)."""
    try:
        v = int(found)
    except (TypeError, ValueError):
        raise SchemaError(
            f"{where}: no readable schema version (got {found!r}); not prepared data?"
        ) from None
    if v > SCHEMA_VERSION:
        raise SchemaError(
            f"{where}: prepared with shard schema version {v}, but this pfactory reads versions up to "
            f"{SCHEMA_VERSION}. Upgrade pfactory, or re-run `factory prepare` with this version."
        )


def open_shard(path: str | Path) -> pq.ParquetFile:
    """Open one shard file, refusing a newer schema version; SchemaError naming the file when it is not a
    Parquet file (truncated, replaced, planted)."""
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise SchemaError(f"{path}: not a readable Parquet shard ({' '.join(str(e).split())[:160]})") from None
    meta = pf.schema_arrow.metadata or {}
    check_schema_version(meta.get(META_VERSION, b"").decode() or None, path)
    return pf


def open_prepared(root: str | Path) -> PreparedDataset:
    """Open a prepared directory: reads `manifest.json`, checks its schema version and status."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raw = (
            (root / "training" / "velodyne").is_dir()
            or (root / "velodyne").is_dir()
            or (root / "samples").is_dir()
        )
        hint = (
            f"it is a raw dataset: prepare it first (factory prepare --raw {root} --out DIR) and pass DIR"
            if raw
            else "it does not exist; run `factory prepare`"
            if not root.exists()
            else "it is not a directory"
            if not root.is_dir()
            else "run `factory prepare`"
        )
        raise SchemaError(f"{root}: no {MANIFEST}; not a prepared directory ({hint})")
    manifest = read_json_object(path, SchemaError)
    check_schema_version(manifest.get("schema_version"), path)
    if not manifest.get("passed", True):
        raise SchemaError(f"{path}: the prepare run that wrote it failed: {manifest.get('failure')}")
    return PreparedDataset(root, manifest)
