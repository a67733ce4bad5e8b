"""prepare on Dask (`pfactory.prepare.scaleout`): the same bytes as one process, whatever the scheduling.

- 1 and 2 workers, two unit sizes, with planted corruptions: every file (shards, rejected.jsonl,
  manifest.json) is byte-identical to the single-process run's, and exactly the bad frames are refused;
- a worker SIGKILLed while it runs a unit: the unit is redone elsewhere, the output is still identical;
- `ShardPlanner`: shards planned from units completing in any order are the rows a sequential writer takes;
- a unit that fails on a worker (not a data problem) fails the stage naming the unit, publishing nothing.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import numpy as np
import pytest

from pfactory.prepare.stage import prepare_dataset
from tests.prepare.conftest import small_params


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by relative path."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def plant(root: Path) -> set[str]:
    """Corrupt 4 frames of a synthetic KITTI dataset; returns their ids."""
    t = root / "training"
    png = (t / "image_2" / "000002.png").read_bytes()
    (t / "image_2" / "000002.png").write_bytes(png[: len(png) // 2])  # truncated image
    pts = np.fromfile(t / "velodyne" / "000009.bin", dtype=np.float32).reshape(-1, 4)
    pts[7, 0] = np.inf
    pts.tofile(t / "velodyne" / "000009.bin")  # a non-finite point
    (t / "calib" / "000013.txt").unlink()  # a missing part
    (t / "label_2" / "000020.txt").write_text("Car 0 0 0 1 2 3\n")  # a short label line
    return {"000002", "000009", "000013", "000020"}


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> tuple[Path, set[str]]:
    """24 synthetic KITTI frames (208x64), 4 of them corrupted."""
    from pfactory.synth.dataset import generate_dataset

    raw = tmp_path_factory.mktemp("raw") / "synth"
    generate_dataset(raw, frames=24, seed=9, cameras=1, image_size=(208, 64), workers=1)
    return raw, plant(raw)


@pytest.fixture(scope="module")
def expected(planted, tmp_path_factory) -> dict[str, str]:
    """The single-process output (today's path, 2 DALI threads)."""
    out = tmp_path_factory.mktemp("one") / "prepared"
    prepare_dataset(planted[0], out, small_params())
    return tree(out)


@pytest.fixture(autouse=True)
def _dask_scratch(tmp_path, monkeypatch):
    monkeypatch.setenv("DASK_TEMPORARY_DIRECTORY", str(tmp_path / "dask"))


def test_one_and_two_workers_write_the_bytes_of_one_process(planted, expected, tmp_path) -> None:
    import json

    from pfactory.prepare.scaleout import prepare_data

    raw, bad = planted
    for address, unit in (("local:1", 5), ("local:2", 3)):
        out = tmp_path / f"{address.replace(':', '')}-{unit}"
        result = prepare_data(raw, out, small_params(unit_frames=unit), address)
        assert tree(out) == expected, address
        m = result.metrics
        assert m["units"] == -(-24 // unit) and m["workers_used"] == int(address[-1])
        assert m["frames_rejected"] == len(bad) and m["frames_train"] + m["frames_val"] == 24 - len(bad)
        rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
        assert [r["frame_id"] for r in rejected] == sorted(bad)
    assert any(k.endswith(".parquet") for k in expected) and "manifest.json" in expected


def test_a_worker_killed_mid_unit_is_redone_and_the_output_is_identical(planted, expected, tmp_path) -> None:
    from pfactory.prepare.scaleout import prepare_data
    from tests.cluster_helpers import killing_a_worker, local_cluster

    # The victim's first unit imports DALI and builds its pipeline (seconds): it is surely mid-unit.
    with (
        local_cluster(tmp_path / "dask") as (cluster, client),
        killing_a_worker(client, lambda k: "unit" in k) as killed,
    ):
        result = prepare_data(
            planted[0], tmp_path / "killed", small_params(unit_frames=4), cluster.scheduler_address
        )
    assert killed.get("keys"), "the victim never ran a unit: the kill did not happen mid-run"
    assert tree(tmp_path / "killed") == expected
    assert result.metrics["units"] == 6


def test_shard_plan_does_not_depend_on_the_completion_order() -> None:
    from pfactory.prepare.scaleout import ShardPlanner

    rng = random.Random(17)
    for _ in range(50):
        n_units, M = rng.randint(1, 12), rng.randint(1, 7)
        counts = [{"train": rng.randint(0, 9), "val": rng.randint(0, 3)} for _ in range(n_units)]
        # What a sequential writer does: the split's rows in unit order, cut every M rows.
        want = {}
        for s in ("train", "val"):
            rows = [(u, i) for u in range(n_units) for i in range(counts[u][s])]
            want.update({(s, k): rows[k * M : (k + 1) * M] for k in range(-(-len(rows) // M))})
        order = list(range(n_units))
        rng.shuffle(order)
        planner, got = ShardPlanner(n_units, M), {}
        for u in order:
            for s, k, slices in planner.add(u, counts[u]):
                assert (s, k) not in got
                got[(s, k)] = [(unit, start + i) for unit, start, n in slices for i in range(n)]
        assert got == want, (counts, M, order)


def test_a_unit_failing_on_a_worker_names_it_and_publishes_nothing(planted, tmp_path, monkeypatch) -> None:
    import shutil

    import pfactory.prepare.rawdata as rawdata
    from pfactory.prepare.scaleout import PrepareTaskError, prepare_data

    # A dataset the driver can list but whose frames the workers cannot read: its directory is removed
    # between the listing and the work (a vanished mount, as seen from the workers).
    raw = tmp_path / "raw"
    shutil.copytree(planted[0], raw)
    listed = rawdata.RawSource(raw)
    shutil.rmtree(raw)
    monkeypatch.setattr(rawdata, "RawSource", lambda _raw: listed)
    with pytest.raises(PrepareTaskError, match=r"prepare unit 0 \(frames 000000\.\.000003 of .*raw\)"):
        prepare_data(raw, tmp_path / "out", small_params(unit_frames=4), "local:1")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*.tmp"))
