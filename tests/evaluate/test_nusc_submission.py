"""results_nusc.json (pfactory.evaluate.nusc_submission): the devkit's loaders accept it, and the devkit's
DetectionEval on the synthetic nuScenes set gives our numbers for the classes we train.

Tiny on purpose: 4 synthetic nuScenes frames at 96x54 px, prepared with an ROI covering every object
(~10 s on 2 cores, most of it the generator).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pfactory.evaluate.nusc_submission import (
    MAX_BOXES_PER_SAMPLE,
    NuscPoses,
    NuscSubmissionError,
    load_poses,
    split_frame_ids,
    submission,
    write_submission,
)
from pfactory.metrics.detection import FrameDetections, KpiParams, evaluate_detections

CLASSES = ("Car", "Pedestrian", "Cyclist")
NUSC = {"Car": "car", "Pedestrian": "pedestrian", "Cyclist": "bicycle"}


@pytest.fixture(scope="module")
def nus_prepared(tmp_path_factory) -> tuple[Path, Path]:
    from pfactory.prepare.params import PrepareParams
    from pfactory.prepare.stage import prepare_dataset
    from pfactory.synth.dataset import generate_dataset

    root = tmp_path_factory.mktemp("nusc_sub")
    generate_dataset(root / "raw", frames=4, seed=11, cameras=6, image_size=(96, 54))
    prepare_dataset(
        root / "raw",
        root / "prepared",
        PrepareParams(
            image_size=[32, 16], batch_size=2, val_fraction=0.5, max_reject_fraction=0.5,
            pc_range=[-80.0, -80.0, -5.0, 80.0, 80.0, 5.0], voxel_size=[0.4, 0.4, 0.4],
        ),
    )  # fmt: skip
    return root / "raw", root / "prepared"


def _ground_truth(prepared: Path) -> list[FrameDetections]:
    """The evaluate stage's GT: the prepared boxes of the training classes, in the reference frame."""
    from pfactory.prepare.shards import open_prepared

    ds = open_prepared(prepared)
    names = np.asarray(ds.classes)
    out = []
    for split in ("train", "val"):
        for f in ds.iter_frames(split):
            keep = f.labels >= 0
            out.append(FrameDetections(f.frame_id, f.boxes[keep].astype(np.float64), names[f.labels[keep]]))
    return sorted(out, key=lambda f: f.frame_id)


def _predictions(gt: list[FrameDetections], seed: int) -> list[FrameDetections]:
    """Noisy copies of the GT (some far off, some flipped, some of the wrong class) + false positives."""
    rng = np.random.default_rng(seed)
    out = []
    for f in gt:
        b = f.boxes.copy()
        n = len(b)
        b[:, :2] += rng.normal(0, 0.6, (n, 2))
        b[:, 3:6] *= rng.uniform(0.8, 1.25, (n, 3))
        b[:, 6] += rng.normal(0, 0.3, n) + np.pi * (rng.random(n) < 0.2)
        names = f.names.copy()
        swap = rng.random(n) < 0.15
        names[swap] = rng.choice(CLASSES, int(swap.sum()))
        k = 3
        fp = np.column_stack(
            [
                rng.uniform(-60, 60, (k, 2)),
                rng.uniform(-1, 0, k),
                rng.uniform(0.5, 4, (k, 3)),
                rng.uniform(-3, 3, k),
            ]
        )
        boxes = np.concatenate([b, fp])
        out.append(
            FrameDetections(
                f.frame_id,
                boxes,
                np.concatenate([names, rng.choice(CLASSES, k)]),
                np.round(rng.uniform(0.05, 1, n + k), 2),  # ties on purpose
            )
        )
    return out


def _devkit_config():
    from nuscenes.eval.detection.constants import DETECTION_NAMES
    from nuscenes.eval.detection.data_classes import DetectionConfig

    # No range limit: the prepared ROI holds every object; the stage's KPIs have no per-class limit either.
    return DetectionConfig(
        class_range={n: 1000.0 for n in DETECTION_NAMES}, dist_fcn="center_distance",
        dist_ths=[0.5, 1.0, 2.0, 4.0], dist_th_tp=2.0, min_recall=0.1, min_precision=0.1,
        max_boxes_per_sample=MAX_BOXES_PER_SAMPLE, mean_ap_weight=5,
    )  # fmt: skip


def test_submission_loads_and_devkit_scores_it_as_we_do(nus_prepared, tmp_path) -> None:
    pytest.importorskip("nuscenes", reason="nuscenes-devkit not installed (requirements/devkit.txt)")
    from nuscenes.eval.common.loaders import load_gt_of_sample_tokens, load_prediction
    from nuscenes.eval.detection.data_classes import DetectionBox
    from nuscenes.eval.detection.evaluate import DetectionEval
    from nuscenes.nuscenes import NuScenes

    raw, prepared = nus_prepared
    gt = _ground_truth(prepared)
    ids = [f.frame_id for f in gt]
    assert sorted(ids) == sorted(split_frame_ids(prepared, "train") + split_frame_ids(prepared, "val"))
    preds = _predictions(gt, seed=1)
    manifest = json.loads((prepared / "manifest.json").read_text())
    poses = load_poses(raw, ids, manifest["reference_frame"])
    path = tmp_path / "results_nusc.json"
    summary = write_submission(path, preds, poses)
    assert summary["samples"] == 4 and summary["boxes"] == sum(len(p.boxes) for p in preds)
    assert summary["left_out"] == {} and summary["capped"] == 0

    nusc = NuScenes(version="v1.0-synth", dataroot=str(raw), verbose=False)
    loaded, meta = load_prediction(str(path), MAX_BOXES_PER_SAMPLE, DetectionBox)
    assert set(loaded.sample_tokens) == set(ids) and meta["use_lidar"] is True
    gt_dev = load_gt_of_sample_tokens(nusc, ids, DetectionBox)
    # Precondition of the comparison: both sides hold the same ground truth. The devkit drops GT boxes
    # without lidar/radar points; none here (asserted), and the ROI covers every object.
    assert all(b.num_pts > 0 for t in ids for b in gt_dev[t])
    for cls, det in NUSC.items():
        assert sum(b.detection_name == det for t in ids for b in gt_dev[t]) == sum(
            (f.names == cls).sum() for f in gt
        )

    # DetectionEval on a custom split (the devkit reads it from <version>/splits.json).
    (raw / "v1.0-synth" / "splits.json").write_text(
        json.dumps({"synth_all": [s["name"] for s in nusc.scene]})
    )
    de = DetectionEval(
        nusc, _devkit_config(), str(path), "synth_all", str(tmp_path / "devkit"), verbose=False
    )
    metrics, _ = de.evaluate()
    ours = evaluate_detections(gt, preds, KpiParams(classes=CLASSES)).metrics["classes"]
    for cls, det in NUSC.items():
        for th in (0.5, 1.0, 2.0, 4.0):
            assert ours[cls]["ap"][str(th)] == pytest.approx(metrics.get_label_ap(det, th), abs=1e-12), (
                cls,
                th,
            )
        # GT positions: float32 in the prepared shards, float64 in the tables -> errors agree to ~1e-7.
        for key, dev_key in (("ate", "trans_err"), ("ase", "scale_err"), ("aoe", "orient_err")):
            assert ours[cls][key] == pytest.approx(metrics.get_label_tp(det, dev_key), abs=1e-6), (cls, key)
    assert max(ours[c]["ap"]["2.0"] for c in CLASSES) > 0.3, "the comparison must cover real matches"


def _poses(ids: list[str]) -> NuscPoses:
    T = np.eye(4)
    T[:3, :3] = [[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]  # 90 deg about z
    T[:3, 3] = [100.0, 200.0, 1.0]
    return NuscPoses(Path("."), {i: T for i in ids})


def test_box_goes_to_the_global_frame_and_classes_map_by_the_table() -> None:
    f = FrameDetections(
        "s0",
        [[1.0, 2.0, 0.5, 4.0, 2.0, 1.5, 0.0], [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]],
        ["Cyclist", "Tram"],
        [0.7, 0.9],
    )
    doc, summary = submission([f, FrameDetections("s1", np.zeros((0, 7)), [], [])], _poses(["s0", "s1"]))
    assert doc["results"]["s1"] == [] and summary["left_out"] == {"Tram": 1}
    (row,) = doc["results"]["s0"]
    np.testing.assert_allclose(row["translation"], [98.0, 201.0, 1.5])
    assert row["size"] == [2.0, 4.0, 1.5]  # w, l, h
    np.testing.assert_allclose(row["rotation"], [np.cos(np.pi / 4), 0, 0, np.sin(np.pi / 4)], atol=1e-12)
    assert (row["detection_name"], row["attribute_name"], row["velocity"]) == (
        "bicycle",
        "cycle.with_rider",
        [0.0, 0.0],
    )


def test_more_than_500_boxes_keeps_the_highest_scores() -> None:
    n = MAX_BOXES_PER_SAMPLE + 3
    boxes = np.tile([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0], (n, 1))
    scores = np.linspace(1.0, 0.01, n)
    doc, summary = submission([FrameDetections("s0", boxes, ["Car"] * n, scores)], _poses(["s0"]))
    got = [r["detection_score"] for r in doc["results"]["s0"]]
    assert summary["capped"] == 3 and got == scores[:MAX_BOXES_PER_SAMPLE].tolist()


def test_poses_need_the_raw_nuscenes_tables(nus_prepared, tmp_path) -> None:
    raw, _ = nus_prepared
    with pytest.raises(NuscSubmissionError, match="raw nuScenes dataset"):
        load_poses(tmp_path, ["x"], "ego_axes")
    with pytest.raises(NuscSubmissionError, match=r"sample\.json.*'not-a-sample'"):
        load_poses(raw, ["not-a-sample"], "ego_axes")
