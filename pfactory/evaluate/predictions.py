"""Detections -> files: KITTI result files (what `factory kpi` reads) and one Parquet table.

KITTI files: one `<frame_id>.txt` per frame, label_2 columns (+ a 16th, the score, for predictions), in
the camera-like frame `pfactory.metrics.kpi_cli` converts back without calibration:
    x_c = -y,  y_c = h/2 - z (bottom centre),  z_c = x,  (h, w, l) kept,  ry = -yaw - pi/2 (wrapped);
the exact inverse of `kitti_camera_to_lidar`, so `factory kpi --gt kitti/ground_truth --pred kitti/optimized`
gives the stage's numbers. Numbers are written with Python's shortest round-trip repr (not KITTI's usual
2 decimals), so the files hold the exact float64 values the KPIs were computed from. 2D boxes,
truncation and occlusion are unknown here and written as 0; alpha follows from the location and ry.

Parquet (`predictions.parquet`): one row per box, `kind` ("ground_truth" | "optimized" | "reference"),
`frame_id`, `rank` (order within the frame: descending score for predictions), `name`, `score` (null for
ground truth), `x y z l w h yaw` float64 in the prepared data's reference frame (x forward, y left, z up).
Rows arrive per unit as part files (`PartWriter.add`) and are merged sorted by (kind, frame_id, rank), so
the table is the same bytes whatever order the workers finished in.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pfactory.metrics.detection import FrameDetections

KINDS = ("ground_truth", "optimized", "reference")
SCHEMA = pa.schema(
    [
        pa.field("kind", pa.string(), nullable=False),
        pa.field("frame_id", pa.string(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("name", pa.string(), nullable=False),
        pa.field("score", pa.float64()),
        *(pa.field(k, pa.float64(), nullable=False) for k in ("x", "y", "z", "l", "w", "h", "yaw")),
    ]
)


def _num(v: float) -> str:
    return repr(float(v))


def _wrap(a: float) -> float:
    return (a + math.pi) % (2 * math.pi) - math.pi


def kitti_lines(frame: FrameDetections) -> str:
    """A frame's boxes as KITTI label/result lines (module docstring), in the frame's box order."""
    lines = []
    for i, (x, y, z, length, width, height, yaw) in enumerate(frame.boxes):
        xc, yc, zc = -y, height / 2 - z, x
        ry = _wrap(-yaw - math.pi / 2)
        alpha = _wrap(ry - math.atan2(xc, zc))
        cols = [frame.names[i], "0", "0", _num(alpha), "0", "0", "0", "0"]
        cols += [_num(v) for v in (height, width, length, xc, yc, zc, ry)]
        if frame.scores is not None:
            cols.append(_num(frame.scores[i]))
        lines.append(" ".join(cols))
    return "".join(line + "\n" for line in lines)


def write_kitti(folder: Path, frames: list[FrameDetections]) -> None:
    """`folder/<frame_id>.txt` for every frame (an empty file for a frame without boxes).

    Plain writes: `folder` lives in the stage's temporary build directory, which is renamed into place
    only when complete; a temp + rename + fsync per file would cost ~18k fsyncs on nuScenes-val."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in frames:
        if "/" in f.frame_id or f.frame_id in ("", ".", ".."):
            raise ValueError(f"frame id {f.frame_id!r} cannot be a file name")
        (folder / f"{f.frame_id}.txt").write_text(kitti_lines(f))


def frames_table(kind: str, frames: list[FrameDetections]) -> pa.Table:
    """Rows of `frames` (module docstring) as an Arrow table of `SCHEMA`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    n = [len(f.boxes) for f in frames]
    boxes = np.concatenate([f.boxes for f in frames]) if frames else np.zeros((0, 7))  # [N, 7]
    cols = {
        "kind": pa.array([kind] * sum(n), pa.string()),
        "frame_id": pa.array([f.frame_id for f, k in zip(frames, n) for _ in range(k)], pa.string()),
        "rank": pa.array(
            np.concatenate([np.arange(k, dtype=np.int32) for k in n]) if frames else [], pa.int32()
        ),
        "name": pa.array([str(s) for f in frames for s in f.names], pa.string()),
        "score": pa.array(
            np.concatenate([f.scores for f in frames])
            if kind != "ground_truth" and frames
            else [None] * sum(n),
            pa.float64(),
        ),
    }
    for j, k in enumerate(("x", "y", "z", "l", "w", "h", "yaw")):
        cols[k] = pa.array(boxes[:, j], pa.float64())
    return pa.Table.from_pydict(cols, schema=SCHEMA)


class PartWriter:
    """Per-unit Parquet parts under `root/.parts/`, merged into one sorted table by `finish`."""

    def __init__(self, root: Path) -> None:
        self.parts = Path(root) / ".parts"
        self.parts.mkdir(parents=True, exist_ok=True)

    def add(self, kind: str, unit: int, frames: list[FrameDetections]) -> None:
        # One part per (kind, unit): the driver receives each unit once, whichever worker computed it.
        tmp = self.parts / f".{kind}-{unit:06d}.tmp"
        pq.write_table(frames_table(kind, frames), tmp)
        tmp.replace(self.parts / f"{kind}-{unit:06d}.parquet")

    def tables(self, kind: str) -> Iterator[pa.Table]:
        """The parts of `kind` (rows of `SCHEMA`), one table per unit in unit order, read one at a time."""
        for p in sorted(self.parts.glob(f"{kind}-*.parquet")):
            yield pq.read_table(p, schema=SCHEMA)

    def finish(self, out: Path) -> pa.Table:
        """Merge every part into `out`, sorted by (kind order, frame_id, rank); removes the parts."""
        files = sorted(self.parts.glob("*.parquet"))
        table = (
            pa.concat_tables([pq.read_table(p, schema=SCHEMA) for p in files])
            if files
            else SCHEMA.empty_table()
        )
        # The kind's position in KINDS, computed in Arrow (no Python string per row).
        kind_idx = pc.index_in(table.column("kind"), value_set=pa.array(KINDS, pa.string())).cast(pa.int64())
        table = (
            table.append_column("_k", kind_idx)
            .sort_by([("_k", "ascending"), ("frame_id", "ascending"), ("rank", "ascending")])
            .drop_columns(["_k"])
        )
        tmp = out.with_name(f".{out.name}.tmp")
        pq.write_table(table, tmp, compression="zstd")
        tmp.replace(out)
        shutil.rmtree(self.parts)
        return table
