"""Work units (row-group runs of one shard), the split hash, and params validation."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from pfactory.evaluate.inputs import EvaluateInputError, plan_units, split_hash
from pfactory.evaluate.params import EvaluateParams
from pfactory.prepare.shards import META_VERSION, SCHEMA_VERSION


def _shard(path, row_groups: list[int]) -> dict:
    """A Parquet file with the shard schema-version tag and the given row-group sizes."""
    schema = pa.schema(
        [pa.field("frame_id", pa.string())], metadata={META_VERSION: str(SCHEMA_VERSION).encode()}
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(path, schema) as w:
        for i, n in enumerate(row_groups):
            w.write_table(
                pa.table({"frame_id": [f"{i}-{k}" for k in range(n)]}, schema=schema), row_group_size=n
            )
    return {"file": f"val/{path.name}", "frames": sum(row_groups), "sha256": path.name}


def test_units_are_whole_row_groups_of_one_shard_up_to_slice_frames(tmp_path) -> None:
    shards = [_shard(tmp_path / "val/a.parquet", [4, 4, 3]), _shard(tmp_path / "val/b.parquet", [5, 1])]
    units = plan_units(tmp_path, shards, 8)
    got = [(u.shard, u.rg_start, u.rg_stop, u.row_start, u.row_stop) for u in units]
    assert got == [
        ("val/a.parquet", 0, 2, 0, 8),
        ("val/a.parquet", 2, 3, 8, 11),
        ("val/b.parquet", 0, 2, 11, 17),
    ]
    # A row group larger than the slice is still one unit (never a frame), and units never span shards.
    small = plan_units(tmp_path, shards, 2)
    assert [u.frames for u in small] == [4, 4, 3, 5, 1] and [u.index for u in small] == list(range(5))


def test_a_shard_that_disagrees_with_the_manifest_is_refused(tmp_path) -> None:
    shard = _shard(tmp_path / "val/a.parquet", [2, 2])
    shard["frames"] = 5
    with pytest.raises(EvaluateInputError, match=r"a.parquet: 4 rows, but manifest.json lists 5 frames"):
        plan_units(tmp_path, [shard], 4)


def test_split_hash_follows_the_shard_hashes() -> None:
    a = [{"file": "val/s0.parquet", "sha256": "aa"}, {"file": "val/s1.parquet", "sha256": "bb"}]
    assert split_hash(a) == split_hash([dict(s) for s in a])
    assert split_hash(a) != split_hash([a[0], {**a[1], "sha256": "bc"}])
    assert split_hash(a) != split_hash(a[::-1])


def test_params_validate_edges_and_addresses() -> None:
    assert EvaluateParams().range_buckets_m == ((0.0, 20.0), (20.0, 40.0), (40.0, math.inf))
    assert EvaluateParams(range_edges_m=[0, 30]).range_buckets_m == ((0.0, 30.0), (30.0, math.inf))
    for bad in ([10, 20], [0, 20, 20]):
        with pytest.raises(ValidationError, match="strictly increasing"):
            EvaluateParams(range_edges_m=bad)
    with pytest.raises(ValidationError, match="finite number"):  # every params float is finite (section.py)
        EvaluateParams(range_edges_m=[0, math.inf])
    with pytest.raises(ValidationError, match="'local:N' with N >= 1"):
        EvaluateParams(dask_address="local:0")
    assert EvaluateParams(dask_address="tcp://10.0.0.1:8786").dask_address == "tcp://10.0.0.1:8786"
    with pytest.raises(ValidationError):
        EvaluateParams(score_threshold=0)  # 0 would keep the runtime's padding entries
    with pytest.raises(ValidationError):
        EvaluateParams(workers=2, nodes=3)
