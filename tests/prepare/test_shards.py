"""Shard format: exact round trip, deterministic bytes, schema-version refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pfactory.prepare.errors import SchemaError
from pfactory.prepare.shards import (
    META_VERSION,
    SCHEMA_VERSION,
    PreparedFrame,
    SplitWriter,
    arrow_schema,
    frames_to_table,
    open_prepared,
    open_shard,
    table_to_frames,
)

SHAPE = (3, 4, 6)


def _frame(i: int, n_cams: int, n_pts: int, n_boxes: int) -> PreparedFrame:
    rng = np.random.default_rng(i)
    return PreparedFrame(
        frame_id=f"{i:06d}",
        split="train",
        source="kitti",
        input_sha256="ab" * 32,
        T_ref_from_lidar=np.eye(4) + rng.normal(size=(4, 4)) * 1e-3,
        points=rng.normal(size=(n_pts, 4)).astype(np.float32),
        n_points_raw=n_pts + 7,
        cam_names=[f"CAM_{k}" for k in range(n_cams)],
        cam_image=[rng.normal(size=SHAPE).astype(np.float16) for _ in range(n_cams)],
        cam_P=rng.normal(size=(n_cams, 3, 4)),
        cam_K=rng.normal(size=(n_cams, 3, 3)),
        cam_T=rng.normal(size=(n_cams, 4, 4)),
        cam_orig_size=rng.integers(1, 2000, size=(n_cams, 2)).astype(np.int32),
        cam_resized_size=rng.integers(1, 200, size=(n_cams, 2)).astype(np.int32),
        cam_scale=rng.uniform(size=(n_cams, 2)),
        boxes=rng.normal(size=(n_boxes, 7)).astype(np.float32),
        labels=rng.integers(-1, 3, size=n_boxes).astype(np.int16),
        names=[f"cls{k}" for k in range(n_boxes)],
        difficulty=rng.integers(-1, 3, size=n_boxes).astype(np.int8),
        num_points_in_box=rng.integers(0, 99, size=n_boxes).astype(np.int32),
    )


def _assert_same(a: PreparedFrame, b: PreparedFrame) -> None:
    for k, v in a.__dict__.items():
        w = getattr(b, k)
        if isinstance(v, np.ndarray):
            assert v.dtype == w.dtype or k == "labels", k
            np.testing.assert_array_equal(np.asarray(v).reshape(np.shape(w)), w, err_msg=k)
        elif k == "cam_image":
            assert len(v) == len(w) and all(np.array_equal(x, y) for x, y in zip(v, w))
        else:
            assert v == w, k


def test_round_trip_is_exact_including_empty_rows() -> None:
    frames = [_frame(0, 2, 50, 3), _frame(1, 0, 0, 0), _frame(2, 6, 1, 1), _frame(3, 1, 1000, 0)]
    table = frames_to_table(frames, arrow_schema(SHAPE))
    back = table_to_frames(table, SHAPE)
    for a, b in zip(frames, back):
        _assert_same(a, b)


def test_split_writer_bounds_shards_and_row_groups(tmp_path: Path) -> None:
    schema = arrow_schema(SHAPE)
    w = SplitWriter(tmp_path, "train", schema, max_frames=5, row_group_frames=2)
    frames = [_frame(i, 1, 10 + i, i % 3) for i in range(12)]
    for f in frames:
        w.add(f)
    shards = w.close()
    assert [(s.file, s.frames, s.row_groups) for s in shards] == [
        ("train/shard-00000.parquet", 5, 3),
        ("train/shard-00001.parquet", 5, 3),
        ("train/shard-00002.parquet", 2, 1),
    ]
    back = [f for s in shards for f in table_to_frames(pq.read_table(tmp_path / s.file), SHAPE)]
    for a, b in zip(frames, back):
        _assert_same(a, b)
    # Same frames, same order -> same bytes.
    w2 = SplitWriter(tmp_path / "again", "train", schema, max_frames=5, row_group_frames=2)
    for f in frames:
        w2.add(f)
    for s in w2.close():
        assert (tmp_path / s.file).read_bytes() == (tmp_path / "again" / s.file).read_bytes()


def test_newer_schema_versions_are_refused(tmp_path: Path) -> None:
    schema = arrow_schema(SHAPE)
    newer = schema.with_metadata({**schema.metadata, META_VERSION: str(SCHEMA_VERSION + 1).encode()})
    pq.write_table(frames_to_table([_frame(0, 1, 3, 1)], schema).cast(newer), tmp_path / "s.parquet")
    with pytest.raises(SchemaError, match=f"version {SCHEMA_VERSION + 1}.*up to {SCHEMA_VERSION}"):
        open_shard(tmp_path / "s.parquet")
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(SchemaError, match="Upgrade pfactory"):
        open_prepared(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": SCHEMA_VERSION, "passed": False}))
    with pytest.raises(SchemaError, match="failed"):
        open_prepared(tmp_path)
    with pytest.raises(SchemaError, match=r"no manifest\.json"):
        open_prepared(tmp_path / "nowhere")
