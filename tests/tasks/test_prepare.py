"""The prepare stage end to end: real frames read back, planted corruptions, SIGKILL, lineage.

Acceptance checks of the issue:
- real KITTI frames and the real nuScenes camera/lidar files prepare correctly: the shards are
  read back and points, boxes, labels, images and projections are compared with the raw frames
  through computations written independently of the lidar/camera modules;
- a dataset with planted corruptions is prepared with exactly those frames in rejected.jsonl and
  every other frame in the shards; too many refusals fail the stage (exit code 1);
- a run killed with SIGKILL after some shards were written leaves nothing a later stage would read,
  and the next run completes with bytes identical to an uninterrupted run;
- same input and params -> byte-identical output; MLflow gets the dataset input and metrics.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
# `tasks` is the repo's stage package; pytest puts tests/ on sys.path, where tests/tasks/ would
# otherwise be found as a namespace package of the same name (as in test_train.py).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flows.params import Params  # noqa: E402
from pfactory.prepare.camera import pil_reference, resize_geometry  # noqa: E402
from pfactory.prepare.errors import RejectFractionExceeded, SchemaError  # noqa: E402
from pfactory.prepare.params import PrepareParams  # noqa: E402
from pfactory.prepare.shards import open_prepared  # noqa: E402
from pfactory.prepare.stage import prepare_dataset, split_of  # noqa: E402
from pfactory.sensors.datasets import open_dataset  # noqa: E402
from pfactory.sensors.geometry import quaternion_to_matrix  # noqa: E402

GREY = 1.0 / (255.0 * 0.229)  # one grey level in normalized units (largest channel step)
SMALL = {"image_size": [104, 32], "batch_size": 4, "shard_max_frames": 4}


def _frames(out: Path) -> dict[str, object]:
    ds = open_prepared(out)
    return {f.frame_id: f for split in ("train", "val") for f in ds.iter_frames(split)}


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _expected_points(raw: np.ndarray, R: np.ndarray, pc_range: list[float], ego: float) -> np.ndarray:
    """The lidar path's points, written independently: rotate (float64), then one boolean mask."""
    xyz = raw[:, :3].astype(np.float64) @ R.T
    lo, hi = np.array(pc_range[:3]), np.array(pc_range[3:])
    keep = np.all((xyz >= lo) & (xyz < hi), axis=1) & (np.hypot(xyz[:, 0], xyz[:, 1]) >= ego)
    return np.concatenate([xyz[keep], raw[keep, 3:4]], 1)


def _check_camera(frame, cam_index: int, raw_cam, R: np.ndarray, params: PrepareParams) -> None:
    """Stored image vs the PIL reference, and stored P vs the raw calibration."""
    W, H = params.image_size
    data = Path(raw_cam.image_path).read_bytes()
    g = resize_geometry(Image.open(io.BytesIO(data)).size, (W, H))
    assert tuple(frame.cam_resized_size[cam_index]) == (g.out_w, g.out_h)
    assert tuple(frame.cam_orig_size[cam_index]) == raw_cam.image_size
    img = frame.cam_image[cam_index].astype(np.float32)
    ref = pil_reference(data, g, (W, H), params.image_mean, params.image_std)
    diff = np.abs(img - ref) / GREY
    assert diff[:, 1 : g.out_h - 1, 1 : g.out_w - 1].max() <= 1.1  # see tests/prepare/test_camera.py
    # Projection: a lidar point p, at R p in the reference frame, must land where the raw
    # calibration puts it, mapped into the resized image: u' = sx (u + 0.5) - 0.5.
    rng = np.random.default_rng(0)
    p_lidar = np.concatenate([rng.uniform(-30, 30, (500, 3)), np.ones((500, 1))], 1)
    uvw_raw = p_lidar @ (raw_cam.K @ raw_cam.T_cam_from_lidar[:3]).T
    p_ref = p_lidar[:, :3] @ R.T
    uvw = np.concatenate([p_ref, np.ones((500, 1))], 1) @ frame.cam_P[cam_index].T
    front = uvw_raw[:, 2] > 0.5
    uv_raw = uvw_raw[front, :2] / uvw_raw[front, 2:]
    expected = np.stack([g.sx * (uv_raw[:, 0] + 0.5) - 0.5, g.sy * (uv_raw[:, 1] + 0.5) - 0.5], 1)
    np.testing.assert_allclose(uvw[front, :2] / uvw[front, 2:], expected, atol=1e-6)


def test_real_kitti_frames_prepare_correctly(real_kitti_dir: Path, tmp_path: Path) -> None:
    # The default model input (416x128); no voxel down-sampling, so every cropped point is checked.
    params = PrepareParams(val_fraction=0.5, voxel_size=None)
    res = prepare_dataset(real_kitti_dir, tmp_path / "out", params)
    assert res.rejected == [] and res.metrics["frames_total"] == 6
    frames = _frames(tmp_path / "out")
    ds = open_dataset(real_kitti_dir)
    assert sorted(frames) == ds.frame_ids()
    index = {c: i for i, c in enumerate(params.classes)}
    n_labelled = 0
    for fid, f in frames.items():
        raw = ds.read(fid)
        assert f.split == split_of(fid, 0.5) and f.source == "kitti"
        np.testing.assert_array_equal(f.T_ref_from_lidar, np.eye(4))
        exp = _expected_points(raw.points, np.eye(3), params.pc_range, params.ego_radius_m)
        np.testing.assert_array_equal(f.points, exp.astype(np.float32))  # same points, same order
        assert f.n_points_raw == len(raw.points) and 30_000 < len(f.points) < len(raw.points)
        c = raw.boxes.boxes[:, :3]
        inside = np.all((c >= params.pc_range[:3]) & (c < params.pc_range[3:]), axis=1)
        np.testing.assert_allclose(f.boxes, raw.boxes.boxes[inside], atol=1e-5)
        names = [n for n, k in zip(raw.boxes.names, inside) if k]
        assert f.names == names
        assert f.labels.tolist() == [index.get(params.class_map.get(n, ""), -1) for n in names]
        assert f.difficulty.tolist() == raw.boxes.difficulty[inside].tolist()
        labelled = f.labels >= 0
        n_labelled += int(labelled.sum())
        assert (f.num_points_in_box[labelled] > 0).all()  # SOURCES.md: every object holds points
        assert f.cam_names == ["image_2"]
        _check_camera(f, 0, raw.cameras[0], np.eye(3), params)
    assert n_labelled == 8  # 3 Car... of 000001-000005 + 2 pedestrians (Truck, Misc: -1)
    manifest = res.manifest
    assert manifest["counts"]["train"] + manifest["counts"]["val"] == 6
    for split in manifest["splits"].values():
        for s in split["shards"]:
            from pfactory.storage.fsutil import sha256_file

            assert sha256_file(tmp_path / "out" / s["file"]) == s["sha256"]


def test_real_nuscenes_files_prepare_correctly(nuscenes_tables, tmp_path: Path) -> None:
    nus = nuscenes_tables
    # Default params: the 40-point stub sweep of the "mono3d" sample is not a scan -> refused.
    res = prepare_dataset(nus.root, tmp_path / "default", PrepareParams(max_reject_fraction=0.5))
    assert [r["frame_id"] for r in res.rejected] == [nus.mono3d_token]
    bad = res.rejected[0]
    assert set(bad) == {"frame_id", "file", "reason"}
    assert (
        bad["file"].endswith("__LIDAR_TOP__1533201470948018.pcd.bin")
        and "at least 100 points" in bad["reason"]
    )

    # All around the car, with the stub accepted and mmdetection3d's class names mapped.
    params = PrepareParams(
        min_points=1,
        pc_range=[-60.0, -60.0, -5.0, 60.0, 60.0, 5.0],
        class_map={"car": "Car", "pedestrian": "Pedestrian"},
        val_fraction=0.0,
        voxel_size=None,
    )
    res = prepare_dataset(nus.root, tmp_path / "out", params)
    assert res.rejected == []
    frames = _frames(tmp_path / "out")
    ds = open_dataset(nus.root)
    assert set(frames) == {nus.demo_token, nus.mono3d_token}
    for fid, f in frames.items():
        raw = ds.read(fid)
        lidar_cs = ds.tables["calibrated_sensor"][ds.sample_data(fid)["LIDAR_TOP"]["calibrated_sensor_token"]]
        R = quaternion_to_matrix(lidar_cs["rotation"])
        np.testing.assert_allclose(f.T_ref_from_lidar[:3, :3], R, atol=1e-12)
        exp = _expected_points(raw.points, R, params.pc_range, params.ego_radius_m)
        assert len(f.points) == len(exp)
        np.testing.assert_allclose(f.points, exp, atol=1e-4)  # float32 rotation of 60 m ranges
        assert f.cam_names == sorted(c.name for c in raw.cameras) and len(f.cam_names) == 6
        for k, cam in enumerate(raw.cameras):
            _check_camera(f, k, cam, R, params)
        c = raw.boxes.boxes[:, :3] @ R.T
        inside = np.all((c >= params.pc_range[:3]) & (c < params.pc_range[3:]), axis=1)
        assert len(f.boxes) == int(inside.sum())
        np.testing.assert_allclose(f.boxes[:, :3], c[inside], atol=1e-4)
        np.testing.assert_allclose(f.boxes[:, 3:6], raw.boxes.boxes[inside, 3:6], atol=1e-5)
    mono = frames[nus.mono3d_token]
    assert len(mono.points) < 40 and len(mono.boxes) == 11
    assert sorted(mono.labels.tolist()) == [-1] * 7 + [0, 0, 1, 1]  # truck/cone -> -1; car; pedestrian


@pytest.fixture(scope="module")
def synth12(tmp_path_factory) -> Path:
    """12 synthetic KITTI frames (208x64 images)."""
    from pfactory.synth.dataset import generate_dataset

    out = tmp_path_factory.mktemp("raw") / "synth"
    generate_dataset(out, frames=12, seed=9, cameras=1, image_size=(208, 64))
    return out


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """One MLflow sqlite DB for this module's tests, in a fresh temporary directory.

    Creating an MLflow DB runs ~30 schema migrations, each fsynced: 9 s on this machine's disk,
    1.5 s on tmpfs -- so it is created once, on /dev/shm when there is one.
    """
    import tempfile

    shm = Path("/dev/shm")
    d = (
        Path(tempfile.mkdtemp(prefix="pfactory-mlflow-", dir=shm))
        if shm.is_dir() and os.access(shm, os.W_OK)
        else tmp_path_factory.mktemp("mlflow")
    )
    yield f"sqlite:///{d}/mlflow.db"
    shutil.rmtree(d, ignore_errors=True)


def _plant(root: Path) -> dict[str, str]:
    """Corrupt 5 of the 12 frames; returns frame id -> the part that was corrupted."""
    t = root / "training"
    png = (t / "image_2" / "000001.png").read_bytes()
    (t / "image_2" / "000001.png").write_bytes(png[: len(png) // 2])  # truncated image
    pts = np.fromfile(t / "velodyne" / "000003.bin", dtype=np.float32).reshape(-1, 4)
    pts[100, 1] = np.nan
    pts.tofile(t / "velodyne" / "000003.bin")  # a NaN coordinate
    (t / "calib" / "000005.txt").unlink()  # a missing part
    lines = (t / "label_2" / "000007.txt").read_text().splitlines()
    (t / "label_2" / "000007.txt").write_text("\n".join([lines[0].rsplit(" ", 1)[0], *lines[1:]]) + "\n")
    (t / "velodyne" / "000010.bin").write_bytes(b"")  # empty sweep
    return {
        "000001": "image_2/000001.png",
        "000003": "velodyne/000003.bin",
        "000005": "calib/000005.txt",
        "000007": "label_2/000007.txt",
        "000010": "velodyne/000010.bin",
    }


def test_planted_corruptions_are_refused_exactly(
    synth12: Path, tmp_path: Path, mlflow_uri: str, monkeypatch, capsys
) -> None:
    import tasks.prepare

    raw = tmp_path / "raw"
    shutil.copytree(synth12, raw)
    planted = _plant(raw)
    params = Params(prepare=PrepareParams(**SMALL, max_reject_fraction=0.5))
    metrics = tasks.prepare.run(params, raw, tmp_path / "out", track=False)
    rejected = [json.loads(line) for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [r["frame_id"] for r in rejected] == sorted(planted)
    for r in rejected:
        assert set(r) == {"frame_id", "file", "reason"}
        assert r["file"].endswith(planted[r["frame_id"]]), r
    frames = _frames(tmp_path / "out")
    assert sorted(frames) == sorted(f"{i:06d}" for i in range(12) if f"{i:06d}" not in planted)
    assert metrics["frames_rejected"] == 5 and metrics["frames_train"] + metrics["frames_val"] == 7

    # Over the limit (default 10 %): still written for inspection, but the stage fails.
    params = Params(prepare=PrepareParams(**SMALL))
    with pytest.raises(RejectFractionExceeded, match="5 of 12 frames refused"):
        tasks.prepare.run(params, raw, tmp_path / "failed", track=False)
    assert len((tmp_path / "failed" / "rejected.jsonl").read_text().splitlines()) == 5
    with pytest.raises(SchemaError, match="failed"):
        open_prepared(tmp_path / "failed")
    # ... and `python -m tasks.prepare` (what DVC runs) exits 1, its MLflow run FAILED with metrics.
    pfile = tmp_path / "params.yaml"
    pfile.write_text(
        yaml.safe_dump({"paths": {"raw": str(raw), "prepared": str(tmp_path / "stage")}, "prepare": SMALL})
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.chdir(tmp_path)  # the project root of this run (its params.yaml): artifacts land here
    with pytest.raises(SystemExit) as exit_info:
        tasks.prepare.main(["--params", str(pfile)])
    assert exit_info.value.code == 1
    assert "5 of 12 frames refused" in capsys.readouterr().err
    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    (run,) = mlflow.search_runs(
        experiment_names=["perception-factory"],
        filter_string="attributes.status = 'FAILED'",
        output_format="list",
    )
    assert run.data.metrics["prepare.frames_rejected"] == 5 and run.data.tags["prepare.passed"] == "False"


def test_same_input_and_params_give_identical_bytes(synth12: Path, tmp_path: Path) -> None:
    prepare_dataset(synth12, tmp_path / "a", PrepareParams(**SMALL, num_threads=2))
    prepare_dataset(synth12, tmp_path / "b", PrepareParams(**SMALL, num_threads=2))
    a, b = _tree_bytes(tmp_path / "a"), _tree_bytes(tmp_path / "b")
    assert a == b and any(k.endswith(".parquet") for k in a)
    # DALI's thread count changes scheduling, not results (num_threads is in the manifest's params).
    prepare_dataset(synth12, tmp_path / "c", PrepareParams(**SMALL, num_threads=1))
    c = _tree_bytes(tmp_path / "c")
    assert {k: v for k, v in c.items() if k.endswith(".parquet")} == {
        k: v for k, v in a.items() if k.endswith(".parquet")
    }


def test_killed_run_leaves_no_shard_and_rerun_is_identical(synth12: Path, tmp_path: Path) -> None:
    from pfactory.prepare.replicate import replicate_kitti

    raw = replicate_kitti(synth12, tmp_path / "raw", 48)  # ~36 frames still to go at the kill
    out = tmp_path / "out"
    code = (
        "import sys; from pfactory.prepare.params import PrepareParams; from pfactory.prepare.stage import prepare_dataset; "
        f"prepare_dataset(sys.argv[1], sys.argv[2], PrepareParams(**{SMALL!r}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(raw), str(out)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        staged: list[Path] = []
        while time.monotonic() < deadline:
            staged = list(tmp_path.glob(".out.*.tmp/train/shard-00002.parquet"))
            if staged or proc.poll() is not None:
                break
            time.sleep(0.005)
        assert staged and proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out.exists()  # nothing a later stage would read
    assert len(list(tmp_path.glob(".out.*.tmp"))) == 1

    prepare_dataset(raw, out, PrepareParams(**SMALL))  # the rerun
    assert not list(tmp_path.glob(".out.*.tmp"))  # the dead run's staging is cleared
    prepare_dataset(raw, tmp_path / "clean", PrepareParams(**SMALL))  # never interrupted
    assert _tree_bytes(out) == _tree_bytes(tmp_path / "clean")


def test_stage_logs_lineage_to_mlflow(synth12: Path, tmp_path: Path, monkeypatch, mlflow_uri: str) -> None:
    import mlflow

    import tasks.prepare

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.chdir(tmp_path)  # artifacts (configure_environment) go under tmp_path
    metrics = tasks.prepare.run(Params(prepare=PrepareParams(**SMALL)), synth12, tmp_path / "out")
    (run,) = mlflow.search_runs(
        experiment_names=["perception-factory"],
        filter_string="attributes.status = 'FINISHED'",
        output_format="list",
    )
    assert run.data.tags["stage"] == "prepare"
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.digest == metrics["raw_sha256"][:32] and inp.dataset.name == "synth"
    tags = {t.key: t.value for t in inp.tags}
    assert tags["sha256"] == metrics["raw_sha256"] and tags["mlflow.data.context"] == "prepare"
    assert run.data.tags["prepare.prepared_sha256"] == metrics["prepared_sha256"]
    for key in (
        "frames_train",
        "frames_val",
        "frames_rejected",
        "frames_per_s",
        "seconds_read",
        "seconds_write",
    ):
        assert run.data.metrics[f"prepare.{key}"] == pytest.approx(metrics[key], rel=1e-3, abs=1e-3)
    assert run.data.params["prepare.batch_size"] == "4"


def test_an_image_dali_refuses_mid_batch_refuses_only_its_frame(
    synth12: Path, tmp_path: Path, monkeypatch
) -> None:
    """The stage's recovery path: DALI fails a batch -> images re-run one by one -> one refusal."""
    import pfactory.prepare.camera as camera_module
    import pfactory.prepare.stage as prep
    from pfactory.prepare.camera import CameraBatchError, CameraPipeline

    bad = (synth12 / "training" / "image_2" / "000006.png").read_bytes()

    class Flaky(CameraPipeline):
        """Decodes like DALI, except that it fails (at collect, as DALI does) on one image."""

        def submit(self, encoded, resized_hw):
            self._has_bad = any(bytes(e) == bad for e in encoded)
            super().submit(encoded, resized_hw)

        def collect(self):
            out = super().collect()
            if self._has_bad:
                self._pipe = None
                raise CameraBatchError(
                    "Error in CPU operator `nvidia.dali.fn.decoders.image`,\nencountered:\n\nboom"
                )
            return out

    prepare_dataset(synth12, tmp_path / "ok", PrepareParams(**SMALL))
    monkeypatch.setattr(prep, "CameraPipeline", Flaky)
    monkeypatch.setattr(camera_module, "CameraPipeline", Flaky)  # what `camera.open_camera` builds
    res = prepare_dataset(synth12, tmp_path / "flaky", PrepareParams(**SMALL, max_reject_fraction=0.2))
    assert res.rejected == [
        {
            "frame_id": "000006",
            "file": "image_2/000006.png",
            "reason": "image_2 image: expected an image DALI decodes (DALI nvidia.dali.fn.decoders.image failed: boom)",
        }
    ]
    ok, flaky = _frames(tmp_path / "ok"), _frames(tmp_path / "flaky")
    assert sorted(flaky) == sorted(set(ok) - {"000006"})
    for fid, f in flaky.items():
        np.testing.assert_array_equal(f.cam_image[0], ok[fid].cam_image[0])
        np.testing.assert_array_equal(f.points, ok[fid].points)
