"""Boxes read back from the driver's Parquet parts (pfactory.evaluate.columns) score exactly as the frames
they were written from: the same flat arrays as `flatten_frames` of the frames sorted by id (the devkit's
tie order), the same KPIs to the bit, the same frames back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pfactory.evaluate.columns import SplitBoxes, flat_pair
from pfactory.evaluate.predictions import PartWriter
from pfactory.metrics.detection import FrameDetections, KpiParams, evaluate_detections, evaluate_flat
from pfactory.metrics.matching import flatten_frames

CLASSES = ("Car", "Pedestrian", "Cyclist")


def _frames(rng: np.random.Generator, ids: list[str], pred: bool) -> list[FrameDetections]:
    """Random frames around a few shared centres (so matches happen), some empty, a class that is not
    evaluated, scores on a coarse grid (ties inside and across frames)."""
    out = []
    for fid in ids:
        n = int(rng.integers(0, 7))
        xy = rng.integers(0, 4, size=(n, 2)) * 3.0 + rng.normal(0, 0.6 if pred else 0.0, size=(n, 2))
        boxes = np.column_stack(
            [xy, rng.normal(size=n), rng.uniform(0.5, 4, size=(n, 3)), rng.uniform(-3, 3, n)]
        )
        names = rng.choice([*CLASSES, "Van"], size=n)
        scores = np.round(rng.uniform(0, 1, n), 1) if pred else None
        if pred:
            order = np.argsort(-scores, kind="stable")  # the worker's order: descending score in a frame
            boxes, names, scores = boxes[order], names[order], scores[order]
        out.append(FrameDetections(fid, boxes, names, scores))
    return out


def _write_units(tmp_path, rng, n_units: int) -> tuple[PartWriter, list[list[str]], dict[str, list]]:
    """Units of frames with unsorted ids, their parts written in a shuffled order, as the driver does."""
    ids = [f"{i:06d}" for i in rng.permutation(n_units * 5)]
    units = [ids[u * 5 : (u + 1) * 5] for u in range(n_units)]
    parts = PartWriter(tmp_path / "report")
    frames: dict[str, list] = {"ground_truth": [], "optimized": []}
    for u in rng.permutation(n_units):
        for kind in frames:
            f = _frames(rng, units[u], pred=kind != "ground_truth")
            frames[kind] += f
            parts.add(kind, int(u), f)
    return parts, units, frames


def _same_flat(a, b) -> None:
    for k in ("frame", "cls", "boxes", "score", "box"):
        x, y = getattr(a, k), getattr(b, k)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), k
    assert a.frame_index == b.frame_index


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parts_read_back_score_as_the_frames_sorted_by_id(tmp_path, seed) -> None:
    rng = np.random.default_rng(seed)
    parts, units, frames = _write_units(tmp_path, rng, 6)
    ids = [f for u in units for f in u]
    gt = SplitBoxes.read(parts, "ground_truth", ids)
    pred = SplitBoxes.read(parts, "optimized", ids)
    by_id = {k: sorted(v, key=lambda f: f.frame_id) for k, v in frames.items()}

    g_flat, p_flat = flat_pair(gt, pred, CLASSES)
    g_ref = flatten_frames(by_id["ground_truth"], CLASSES, is_pred=False)
    p_ref = flatten_frames(by_id["optimized"], CLASSES, is_pred=True, frame_index=g_ref.frame_index)
    _same_flat(g_flat, g_ref)
    _same_flat(p_flat, p_ref)
    assert len(gt.boxes) == sum(len(f.boxes) for f in frames["ground_truth"])  # other classes counted too

    params = KpiParams(classes=CLASSES, frame_score_threshold=0.3)
    got = evaluate_flat(g_flat, p_flat, params)
    want = evaluate_detections(by_id["ground_truth"], by_id["optimized"], params)
    assert json.dumps(got.metrics, sort_keys=True) == json.dumps(want.metrics, sort_keys=True)
    assert got.per_frame == want.per_frame
    assert got.pr_curves() == want.pr_curves()
    assert got.errors.frame_counts() == want.errors.frame_counts()

    back = list(pred.frames())
    assert [f.frame_id for f in back] == [f.frame_id for f in by_id["optimized"]]
    for a, b in zip(back, by_id["optimized"]):
        assert np.array_equal(a.boxes, b.boxes) and np.array_equal(a.scores, b.scores)
        assert a.names.tolist() == b.names.tolist()
    assert [f.scores for f in gt.frames()] == [None] * len(ids)
    assert pred.frames()[-1].frame_id == max(ids) and len(pred.frames()[1:3]) == 2


def test_a_row_of_a_frame_not_evaluated_or_a_part_written_twice_is_refused(tmp_path) -> None:
    rng = np.random.default_rng(3)
    parts, units, frames = _write_units(tmp_path, rng, 2)
    with pytest.raises(RuntimeError, match="not an evaluated frame"):
        SplitBoxes.read(parts, "optimized", units[0])
    one = next(f for f in frames["optimized"] if len(f.boxes))
    parts.add("optimized", 99, [one])  # the same frame's rows twice: ranks 0, 0, 1, 1, ...
    with pytest.raises(RuntimeError, match="ranks are not"):
        SplitBoxes.read(parts, "optimized", [f for u in units for f in u])


def test_no_parts_give_empty_frames(tmp_path) -> None:
    parts = PartWriter(tmp_path / "report")
    pred = SplitBoxes.read(parts, "optimized", ["b", "a"])
    assert pred.frame_ids == ["a", "b"] and pred.boxes.shape == (0, 7) and pred.scores.shape == (0,)
    assert [len(f.boxes) for f in pred.frames()] == [0, 0]
    g, p = flat_pair(SplitBoxes.read(parts, "ground_truth", ["a", "b"]), pred, CLASSES)
    assert g.frame_index == {"a": 0, "b": 1} and len(p.frame) == 0
