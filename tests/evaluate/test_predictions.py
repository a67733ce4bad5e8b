"""KITTI result lines that `factory kpi` reads back exactly, and a Parquet table independent of arrival order."""

from __future__ import annotations

import random

import numpy as np
import pyarrow.parquet as pq
import pytest

from pfactory.evaluate.predictions import PartWriter, frames_table, kitti_lines, write_kitti
from pfactory.metrics.detection import FrameDetections
from pfactory.metrics.kpi_cli import DEFAULT_KITTI_CLASS_MAP, load_kitti_frame


def _frame(fid: str, n: int, seed: int, scores: bool) -> FrameDetections:
    rng = np.random.default_rng(seed)
    boxes = np.column_stack(
        [
            rng.uniform(0, 70, n), rng.uniform(-40, 40, n), rng.uniform(-2, 1, n),
            rng.uniform(0.3, 5, (n, 3)), rng.uniform(-np.pi, np.pi, n),
        ]
    ).astype(np.float32).astype(np.float64)  # fmt: skip
    names = rng.choice(["Car", "Pedestrian", "Cyclist"], n)
    s = np.sort(rng.uniform(0.05, 1, n).astype(np.float32))[::-1].astype(np.float64) if scores else None
    return FrameDetections(fid, boxes, names, s)


@pytest.mark.parametrize("scores", [True, False])
def test_kitti_lines_round_trip_through_factory_kpi_reader(tmp_path, scores) -> None:
    f = _frame("000007", 40, 1, scores)
    write_kitti(tmp_path, [f])
    back = load_kitti_frame(tmp_path / "000007.txt", "000007", DEFAULT_KITTI_CLASS_MAP, with_score=scores)
    assert back.names.tolist() == f.names.tolist()
    # x, y, sizes and scores are copied, not computed: exact. z and yaw go through +-h/2 and -yaw - pi/2.
    np.testing.assert_array_equal(back.boxes[:, [0, 1, 3, 4, 5]], f.boxes[:, [0, 1, 3, 4, 5]])
    np.testing.assert_allclose(back.boxes[:, 2], f.boxes[:, 2], rtol=0, atol=1e-12)
    dyaw = (back.boxes[:, 6] - f.boxes[:, 6] + np.pi) % (2 * np.pi) - np.pi
    assert np.abs(dyaw).max() < 1e-12
    if scores:
        np.testing.assert_array_equal(back.scores, f.scores)
    assert len(kitti_lines(f).splitlines()[0].split()) == (16 if scores else 15)


def test_empty_frame_writes_an_empty_file_and_bad_ids_are_refused(tmp_path) -> None:
    write_kitti(tmp_path, [_frame("a", 0, 0, True)])
    assert (tmp_path / "a.txt").read_text() == ""
    with pytest.raises(ValueError, match="cannot be a file name"):
        write_kitti(tmp_path, [_frame("x/y", 1, 0, True)])


def test_parts_merge_to_the_same_bytes_in_any_arrival_order(tmp_path) -> None:
    units = {u: [_frame(f"{u:03d}{k}", 3 + k, u * 10 + k, True) for k in range(2)] for u in range(6)}
    gts = {u: [_frame(f.frame_id, 2, 99 + u, False) for f in frames] for u, frames in units.items()}
    outs = []
    for trial in range(2):
        order = list(units)
        random.Random(trial).shuffle(order)
        w = PartWriter(tmp_path / f"t{trial}")
        for u in order:
            w.add("optimized", u, units[u])
            w.add("ground_truth", u, gts[u])
        out = tmp_path / f"t{trial}" / "predictions.parquet"
        w.finish(out)
        assert not (tmp_path / f"t{trial}" / ".parts").exists()
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    rows = pq.read_table(tmp_path / "t0" / "predictions.parquet").to_pylist()
    assert [r["kind"] for r in rows[:2]] == ["ground_truth"] * 2 and rows[-1]["kind"] == "optimized"
    assert all(r["score"] is None for r in rows if r["kind"] == "ground_truth")
    opt = [(r["frame_id"], r["rank"]) for r in rows if r["kind"] == "optimized"]
    assert opt == sorted(opt) and len(opt) == sum(len(f.boxes) for fs in units.values() for f in fs)


def test_frames_table_refuses_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        frames_table("candidate", [])
