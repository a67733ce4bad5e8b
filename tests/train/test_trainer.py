"""The trainer (`pfactory.train`): determinism, kill/resume equality, DDP == single process, outputs,
tracking, profiling.

Most tests drive `Trainer(...).train()` with a small in-memory loader (`FakeLoader`: deterministic frames
with box-shaped point clusters, same protocol as `pfactory.prepare.loader`) and a tiny model, so each
run takes a few seconds on 2 cores (tests/tasks/test_train.py runs the real synth -> prepare ->
loader chain through the stage). Subprocess helpers (`python test_trainer.py ...`) reuse
this file, so the killed and the DDP runs train exactly what the in-process runs train.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # subprocess entry (python tests/train/test_trainer.py) imports tasks, kernels
    sys.path.insert(0, str(ROOT))

from pfactory.detectors.params import ModelSection, resolve  # noqa: E402

PC_RANGE = [0.0, -8.0, -3.0, 16.0, 8.0, 1.0]
from pfactory.metrics.cut import DetectionCut  # noqa: E402
from pfactory.train.params import TrainParams  # noqa: E402

IMAGE_HW = (32, 64)
CLASSES = ["Car", "Pedestrian", "Cyclist"]


# --------------------------------------------------------------------------------------------------
# A tiny deterministic dataset with the loader protocol
# --------------------------------------------------------------------------------------------------
def fake_prepared(root: Path, train: int = 16, val: int = 4) -> Path:
    """A prepared-directory stand-in: just the manifest fields the train stage reads."""
    root.mkdir(parents=True, exist_ok=True)
    manifest = {
        "schema_version": 1,
        "passed": True,
        "classes": CLASSES,
        "cameras": ["image_2"],
        "image": {"shape": [3, *IMAGE_HW]},
        "params": {"pc_range": PC_RANGE},  # the prepare stage's crop: the detector is built for it
        "splits": {"train": {"frames": train, "shards": []}, "val": {"frames": val, "shards": []}},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def _frame(split: str, index: int, epoch: int, augment: bool, points: int = 600) -> dict:
    """Frame `index` of `split`: 3 boxes with points on them + ground clutter (seeded by split, index)."""
    rng = np.random.default_rng([0 if split == "train" else 1, index])
    sizes = np.array([[4.0, 1.8, 1.5], [0.8, 0.7, 1.7], [1.8, 0.6, 1.7]])
    labels = rng.integers(0, 3, size=3)
    boxes = np.zeros((3, 7), np.float32)
    boxes[:, 0] = rng.uniform(2, 14, 3)
    boxes[:, 1] = rng.uniform(-6, 6, 3)
    boxes[:, 2] = -1.0 + sizes[labels, 2] / 2
    boxes[:, 3:6] = sizes[labels]
    boxes[:, 6] = rng.uniform(-np.pi, np.pi, 3)
    pts = []
    for b in boxes:
        local = rng.uniform(-0.5, 0.5, (points // 6, 3)) * b[3:6]
        c, s = np.cos(b[6]), np.sin(b[6])
        xyz = local @ np.array([[c, s, 0], [-s, c, 0], [0, 0, 1]]) + b[:3]
        pts.append(np.c_[xyz, np.full(len(xyz), 0.8)])
    ground = np.c_[rng.uniform(0, 16, (points // 2, 1)), rng.uniform(-8, 8, (points // 2, 1)),
                   np.full((points // 2, 1), -1.0), rng.uniform(0, 0.2, (points // 2, 1))]  # fmt: skip
    pts = np.concatenate([*pts, ground]).astype(np.float32)
    if augment and np.random.default_rng([7, epoch, index]).random() < 0.5:  # a flip, as the real loader's
        pts[:, 1] *= -1
        boxes[:, 1] *= -1
        boxes[:, 6] *= -1
    image = rng.standard_normal((1, 3, *IMAGE_HW)).astype(np.float32)
    return {"points": pts, "boxes": boxes, "labels": labels, "image": image, "id": f"{split}-{index:04d}"}


def camera_proj(batch: int, image_wh: tuple[int, int], f: float = 30.0) -> torch.Tensor:
    """[B, 1, 3, 4] a forward-looking pinhole camera at the lidar origin (camera z = lidar x)."""
    wi, hi = image_wh
    K = torch.tensor([[f, 0.0, wi / 2 - 0.5], [0.0, f, hi / 2 - 0.5], [0.0, 0.0, 1.0]])
    T = torch.tensor([[0.0, -1.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # camera <- lidar
    return (K @ T).expand(batch, 1, 3, 4).contiguous()


class FakeLoader:
    """`len`, `set_epoch`, `skip_batches`, iteration of padded batch dicts: the real loader's protocol."""

    def __init__(
        self, split: str, frames: int, batch_size: int, shuffle: bool, augment: bool, seed: int
    ) -> None:
        self.split, self.frames, self.batch_size = split, frames, batch_size
        self.shuffle, self.augment, self.seed = shuffle, augment, seed
        self.epoch, self._skip = 0, 0

    def __len__(self) -> int:
        return math.ceil(self.frames / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._skip = epoch, 0

    def skip_batches(self, k: int) -> None:
        self._skip = k

    def __iter__(self):
        order = np.arange(self.frames)
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.frames)
        for start in range(self._skip * self.batch_size, self.frames, self.batch_size):
            fr = [
                _frame(self.split, int(i), self.epoch, self.augment)
                for i in order[start : start + self.batch_size]
            ]
            b = len(fr)
            p = max(len(f["points"]) for f in fr)
            points = torch.zeros(b, p, 4)
            for i, f in enumerate(fr):
                points[i, : len(f["points"])] = torch.from_numpy(f["points"])
            yield {
                "points": points,
                "num_points": torch.tensor([len(f["points"]) for f in fr]),
                "images": torch.from_numpy(np.stack([f["image"] for f in fr])),
                "proj": camera_proj(b, (IMAGE_HW[1], IMAGE_HW[0])),
                "cam_valid": torch.ones(b, 1, dtype=torch.bool),
                "boxes": torch.from_numpy(np.stack([f["boxes"] for f in fr])),
                "labels": torch.from_numpy(np.stack([f["labels"] for f in fr])).long(),
                "num_boxes": torch.full((b,), 3),
                "frame_ids": [f["id"] for f in fr],
            }


def fake_loader_factory(data, split, batch_size, shuffle, augment, seed, device, num_threads) -> FakeLoader:
    manifest = json.loads((Path(data) / "manifest.json").read_text())
    return FakeLoader(
        split, manifest["splits"][split]["frames"], batch_size, shuffle, augment is not None, seed
    )


def tiny_params(**train_over) -> SimpleNamespace:
    section = {"painted_pillars": dict(pillar_size_m=0.4, image_channels=8, point_channels=16,
                                       bev_channels=[16, 16, 32], up_channels=16, head_channels=16, max_detections=20)}  # fmt: skip
    model = resolve(ModelSection.model_validate(section), "test")
    train = TrainParams(**{"epochs": 2, "batch_size": 4, "lr": 3e-3, "checkpoint_every_steps": 3,
                           "torch_threads": 1, **train_over})  # fmt: skip
    return SimpleNamespace(model=model, train=train, evaluate=DetectionCut())


def train_fake(data: Path, out: Path, track: bool = False, **train_over) -> dict:
    from pfactory.train.trainer import Trainer

    trainer = Trainer(tiny_params(**train_over), data, out, track=track, loader_factory=fake_loader_factory,
                      progress=False)  # fmt: skip
    return trainer.train()


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


def _script(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


def _env() -> dict[str, str]:
    here = str(Path(__file__).resolve().parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), here, os.environ.get("PYTHONPATH", "")])}


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------
def test_same_seed_same_loss_curve(tmp_path: Path) -> None:
    data = fake_prepared(tmp_path / "prepared")
    a = train_fake(data, tmp_path / "a")
    train_fake(data, tmp_path / "b")
    ca = json.loads((tmp_path / "a" / "curves.json").read_text())
    cb = json.loads((tmp_path / "b" / "curves.json").read_text())
    assert len(ca) == 8 and [r["loss"] for r in ca] == [r["loss"] for r in cb]  # bit-identical
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["steps"] == 8 and a["epochs"] == 2 and a["val"]["mAP"] >= 0
    c = train_fake(data, tmp_path / "c", seed=1)
    assert c["final_loss"] != a["final_loss"]


def test_outputs_load_and_describe_the_model(tmp_path: Path) -> None:
    from pfactory.detectors.io import load_model

    data = fake_prepared(tmp_path / "prepared")
    summary = train_fake(data, tmp_path / "out", val_every_epochs=1)
    out = tmp_path / "out"
    for name in (
        "checkpoint.pt",
        "model.pt",
        "model_config.json",
        "curves.json",
        "val_curves.json",
        "metrics.json",
    ):
        assert (out / name).is_file(), name
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)  # plain types only: loads safely
    assert ckpt["done"] and ckpt["step"] == 8 and set(ckpt["rng"]) >= {"torch", "numpy", "python"}
    model, config = load_model(out)
    assert config["image_size"] == [IMAGE_HW[1], IMAGE_HW[0]] and config["classes"] == CLASSES
    assert model.params.model_dump(exclude={"classes", "pc_range"}) == tiny_params().model.selected.model_dump()
    assert config["arch"] == "painted_pillars" and config["plugin"] is None and config["pc_range"] == PC_RANGE
    val = json.loads((out / "val_curves.json").read_text())
    assert [r["epoch"] for r in val] == [1, 2] and "Car/ap_2.0" in val[-1]
    assert summary["samples_per_s"] > 0 and 0 <= summary["data_wait_fraction"] < 1
    assert {"data", "forward", "backward", "optimizer", "validate"} <= set(summary["timings_s"])
    # A second run on the same directory resumes the finished checkpoint: no step is re-trained.
    again = train_fake(data, out, val_every_epochs=1)
    assert again["resumed"] and again["steps"] == 8 and again["val"] == summary["val"]
    assert [r["epoch"] for r in json.loads((out / "val_curves.json").read_text())] == [1, 2]
    # Other trajectory params: the checkpoint is not resumed.
    other = train_fake(data, out, lr=1e-3)
    assert not other["resumed"]


def test_kill_at_a_random_step_and_resume_matches_uninterrupted(tmp_path: Path) -> None:
    data = fake_prepared(tmp_path / "prepared", train=24)
    over = {"epochs": 3, "checkpoint_every_steps": 2}  # 18 steps, a checkpoint every 2
    reference = tmp_path / "reference"
    train_fake(data, reference, **over)

    out = tmp_path / "killed"
    rng = random.Random(int(time.time()))  # a different kill point on every run...
    kill_after_step = rng.randint(2, 14)
    print(f"killing after checkpointed step >= {kill_after_step}")  # ...reported for reproduction
    proc = subprocess.Popen(_script("train", str(data), str(out), json.dumps(over)), env=_env())
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            ckpt = out / "checkpoint.pt"
            if ckpt.is_file() and torch.load(ckpt, weights_only=True)["step"] >= kill_after_step:
                time.sleep(rng.uniform(0.0, 0.15))  # land anywhere between checkpoints (~0.1 s apart)
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    killed_at = torch.load(out / "checkpoint.pt", weights_only=True)["step"]
    # Killed mid-run, or (rarely) after the final checkpoint while validating and writing: both resume.
    assert 2 <= killed_at <= 18

    summary = train_fake(data, out, **over)
    assert summary["resumed"]
    ref, got = _weights(reference), _weights(out)
    assert set(ref) == set(got)
    mismatched = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not mismatched, (
        f"killed at step {killed_at}: {len(mismatched)} tensors differ, e.g. {mismatched[:3]}"
    )
    ref_curve = json.loads((reference / "curves.json").read_text())
    got_curve = json.loads((out / "curves.json").read_text())
    assert [r["loss"] for r in ref_curve] == [r["loss"] for r in got_curve]


def test_two_process_gloo_ddp_matches_one_process(tmp_path: Path) -> None:
    data = fake_prepared(tmp_path / "prepared")
    # Global batch 4: 2 frames per process. fp32: the test asserts the DDP maths to float32 rounding; under
    # bf16 autocast (the default on a CPU with AVX512-BF16) every layer output rounds to 8 mantissa bits,
    # oneDNN blocks a batch of 2 and of 4 differently, and 4 Adam steps amplify those roundings.
    over = {"epochs": 1, "torch_threads": 1, "bf16": False}
    single = tmp_path / "single"
    train_fake(data, single, **over)
    ddp = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).resolve()), "train", str(data), str(ddp), json.dumps(over)]  # fmt: skip
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    a = json.loads((single / "curves.json").read_text())
    b = json.loads((ddp / "curves.json").read_text())
    assert len(a) == len(b) == 4
    # Same maths, different reduction order (gradients summed by gloo): equal to float32 rounding.
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=1e-4)
    wa, wb = _weights(single), _weights(ddp)
    diff = torch.cat([(wa[k].float() - wb[k].float()).abs().flatten() for k in wa])  # [num weights]
    # Adam moves a weight by up to ~lr per step whatever its gradient's size, so a gradient at rounding
    # level (a few biases here) may step the other way: bounded by steps x lr; the rest agree tightly.
    assert diff.max() <= 4 * 3e-3, float(diff.max())
    assert (diff > 1e-4).float().mean() < 1e-3, f"{int((diff > 1e-4).sum())} of {diff.numel()} weights differ"
    assert json.loads((ddp / "metrics.json").read_text())["world_size"] == 2


def test_mlflow_run_has_params_step_metrics_and_artifacts(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)  # configure_environment keeps its scratch under the cwd's project
    data = fake_prepared(tmp_path / "prepared")
    summary = train_fake(data, tmp_path / "out", track=True, epochs=1, log_every_steps=1)
    import mlflow

    run = mlflow.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.model.painted_pillars.pillar_size_m"] == "0.4" and "train.train.lr" in run.data.params
    assert run.data.params["train.model.arch"] == "painted_pillars"
    for key in ("train/loss", "train/heatmap", "train/reg", "train/lr", "train/samples_per_s",
                "train/data_wait_fraction", "train/peak_memory_mb", "time/forward_s", "val/mAP", "val/Car/ap_2.0"):  # fmt: skip
        assert key in run.data.metrics, key
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2, 3, 4]
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "model")}
    assert {"model/checkpoint.pt", "model/model.pt", "model/model_config.json"} <= artifacts


def test_profile_writes_a_chrome_trace(tmp_path: Path, capsys) -> None:
    from pfactory.train.profile import profile_train

    data = fake_prepared(tmp_path / "prepared")
    trace = profile_train(tiny_params(), data, 2, tmp_path / "prof", loader_factory=fake_loader_factory)
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"forward", "backward", "optimizer", "data"} <= names
    assert "Self CPU" in capsys.readouterr().out  # the top-ops table


# --------------------------------------------------------------------------------------------------
# Subprocess entry: python test_trainer.py train DATA OUT OVERRIDES_JSON (plain or under torchrun)
# --------------------------------------------------------------------------------------------------
if __name__ == "__main__":
    if sys.argv[1] == "train":
        train_fake(Path(sys.argv[2]), Path(sys.argv[3]), **json.loads(sys.argv[4]))
