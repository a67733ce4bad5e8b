"""Preemption of a real training process: SIGTERM mid-run -> the checkpoint is written, the process exits 143
within 10 s, and the resumed run's loss curve equals an uninterrupted run's at every step (data order, RNG
states, optimizer and schedule restored); the time-based checkpoint cadence (`train.checkpoint_every_minutes`);
with a DVC remote (a local directory, and S3 on moto's server on 127.0.0.1), the checkpoints go to the remote
too and another machine (another folder with only the remote in common) resumes from the copy there.

The trainer runs on the small in-memory dataset of tests/train/test_trainer.py (`fake_loader_factory`); the
killed run is a subprocess of this file (`python test_preemption.py train DATA OUT RESUME_DIR OVERRIDES`),
whose exit code is the stage's (`UserError.exit_code`, as `tasks._stage` maps it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # subprocess entry
    sys.path.insert(0, str(ROOT))

from tests.prepare.test_storage import BUCKET, s3  # noqa: E402, F401 - the moto S3 server fixture (module scope)
from tests.train.test_trainer import _env, fake_loader_factory, fake_prepared, tiny_params  # noqa: E402

# 24 train frames, batch 4: 6 steps an epoch, 120 in all (progress events come at most every 0.5 s). No step- or time-based checkpoint before the end:
# whatever the resumed run starts from was written by the SIGTERM handler.
NO_PERIODIC = {
    "epochs": 20,
    "val_every_epochs": 0,
    "checkpoint_every_steps": 1000,
    "checkpoint_every_minutes": 600.0,
}
TRAJECTORY_KEYS = ("step", "epoch", "lr", "loss", "heatmap", "reg", "grad_norm")  # not the timings


def train(data: Path, out: Path, resume_dir: Path | None = None, **over) -> dict:
    from pfactory.train.trainer import Trainer

    trainer = Trainer(tiny_params(**over), data, out, track=False, loader_factory=fake_loader_factory,
                      progress=False, resume_dir=resume_dir)  # fmt: skip
    return trainer.train()


def _curve(out: Path) -> list[dict]:
    rows = json.loads((out / "curves.json").read_text())
    return [{k: r[k] for k in TRAJECTORY_KEYS if k in r} for r in rows]


def _last_step(progress: Path) -> int:
    if not progress.is_file():
        return 0
    steps = [json.loads(line).get("step", 0) for line in progress.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


@pytest.mark.slow
def test_sigterm_checkpoints_exits_143_and_resumes_the_same_curve(tmp_path: Path) -> None:
    data = fake_prepared(tmp_path / "prepared", train=24)
    reference = tmp_path / "reference"
    train(data, reference, **NO_PERIODIC)

    out, resume_dir, progress = tmp_path / "out", tmp_path / "resume", tmp_path / "progress.jsonl"
    cmd = [sys.executable, str(Path(__file__).resolve()), "train", str(data), str(out), str(resume_dir),
           json.dumps(NO_PERIODIC)]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**_env(), "PFACTORY_PROGRESS_FILE": str(progress)})
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and _last_step(progress) < 72:  # 60 % of 120
            time.sleep(0.02)
        t_signal = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        exit_s = time.perf_counter() - t_signal
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"SIGTERM at step {_last_step(progress)}: exit {code} after {exit_s:.2f} s")
    assert code == 143, f"exit {code} (the run must stop on SIGTERM with 128 + 15)"
    assert exit_s < 10
    state = torch.load(resume_dir / "checkpoint.pt", weights_only=True)
    assert 72 <= state["step"] < 120 and not state["done"], state["step"]
    assert not (out / "checkpoint.pt").exists()  # the final checkpoint only; the resume one lives apart

    summary = train(data, out, resume_dir, **NO_PERIODIC)
    assert summary["resumed"] and summary["steps"] == 120
    assert len(_curve(out)) == 120 and _curve(out) == _curve(reference)  # every step and loss term, bitwise
    ref = torch.load(reference / "model.pt", weights_only=True)
    got = torch.load(out / "model.pt", weights_only=True)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    final = torch.load(out / "checkpoint.pt", weights_only=True)  # the DVC output, written at the end
    assert final["done"] and final["step"] == 120


def test_checkpoint_every_minutes(tmp_path: Path) -> None:
    """A checkpoint after every step when the time cadence is shorter than a step; none but the final one
    when neither cadence is reached."""
    data = fake_prepared(tmp_path / "prepared", train=8)  # 2 steps an epoch, 4 in all
    often = train(
        data, tmp_path / "often", epochs=2, checkpoint_every_steps=1000, checkpoint_every_minutes=1e-6
    )
    assert often["checkpoint"]["written"] == 4  # after steps 1, 2, 3 and the final one
    never = train(
        data, tmp_path / "never", epochs=2, checkpoint_every_steps=1000, checkpoint_every_minutes=600
    )
    assert never["checkpoint"]["written"] == 1
    assert 0 < never["checkpoint"]["fraction"] < 1


def _dvc_project(root: Path, url: str, endpoint: str | None = None) -> Path:
    """A DVC project (no git) at `root` whose default remote `shared` is `url`."""
    (root / ".dvc").mkdir(parents=True)
    extra = f"    endpointurl = {endpoint}\n" if endpoint else ""
    (root / ".dvc" / "config").write_text(
        f'[core]\n    no_scm = true\n    remote = shared\n[\'remote "shared"\']\n    url = {url}\n{extra}'
    )
    return root


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_checkpoints_go_to_the_dvc_remote_and_another_machine_resumes_from_them(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    """Machine A trains with a checkpoint every 6 steps, each uploaded in the background, and is SIGTERMed at
    ~60 %: exit 143 once the SIGTERM checkpoint is on the remote. Machine B (another folder, the remote in
    common) finds the run by name, downloads the checkpoint, resumes at its step: the same curve as an
    uninterrupted run. B uploads as it trains too: the cost is measured (`checkpoint.remote`)."""
    from pfactory.train.remote_checkpoint import REMOTE_ENV, RunRemote, target_env

    if kind == "s3":
        endpoint = request.getfixturevalue("s3")
        url = f"s3://{BUCKET}/ckpt-{tmp_path.name}"
    else:
        endpoint, url = None, str(tmp_path / "remote")
    data = fake_prepared(tmp_path / "prepared", train=24)
    reference = tmp_path / "reference"
    train(data, reference, **NO_PERIODIC)
    every6 = {**NO_PERIODIC, "checkpoint_every_steps": 6}  # not part of the trajectory: resuming ignores it

    a = _dvc_project(tmp_path / "a", url, endpoint)
    (a / "run.json").write_text(json.dumps({"run_id": "20260101T000000Z-pre-abc123", "name": "pre"}))
    (a / "params.yaml").write_text("train:\n  epochs: 20\n")
    env = {**_env(), "PFACTORY_PROGRESS_FILE": str(tmp_path / "progress.jsonl"),
           REMOTE_ENV: target_env(a, "20260101T000000Z-pre-abc123", a, a / "run.json", a / "params.yaml")}  # fmt: skip
    cmd = [sys.executable, str(Path(__file__).resolve()), "train", str(data), str(a / "out"), str(a / "resume"),
           json.dumps(every6)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and _last_step(tmp_path / "progress.jsonl") < 72:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    local = torch.load(a / "resume" / "checkpoint.pt", weights_only=True)
    stopped = int(local["step"])
    assert 72 <= stopped < 120 and not local["done"], stopped

    b = _dvc_project(tmp_path / "b", url, endpoint)
    remote = RunRemote(b)
    assert remote.find("pre") == "20260101T000000Z-pre-abc123" and remote.find("nope") is None
    marker = remote.get_checkpoint("20260101T000000Z-pre-abc123", b / "resume" / "checkpoint.pt")
    entry = remote.read_marker("20260101T000000Z-pre-abc123")["checkpoint"]
    assert entry["step"] == stopped and entry["path"] == "resume/checkpoint.pt", entry  # the SIGTERM one
    assert marker["record"]["name"] == "pre" and marker["params_yaml"] == "train:\n  epochs: 20\n"
    assert (b / "resume" / "checkpoint.pt").read_bytes() == (a / "resume" / "checkpoint.pt").read_bytes()
    keys = [remote.fs.name(p) for p in remote.fs.ls(remote.fs.join(remote.base, "20260101T000000Z-pre-abc123"))]
    assert sorted(keys) == sorted([entry["key"], "run.json"]), keys  # older checkpoints were removed

    os.environ[REMOTE_ENV] = target_env(b, "20260101T000000Z-pre-b", b, b / "run.json", b / "params.yaml")
    try:
        summary = train(data, b / "out", b / "resume", **every6)
    finally:
        del os.environ[REMOTE_ENV]
    assert summary["resumed"] and summary["resumed_at_step"] == stopped
    assert _curve(b / "out") == _curve(reference)  # every step and loss term, bitwise
    up = summary["checkpoint"]["remote"]
    assert up["errors"] == 0 and up["uploads"] >= 1, up
    loop_s = summary["train_seconds"]
    print(f"{kind}: SIGTERM checkpoint at step {stopped} on the remote; B resumed at {summary['resumed_at_step']}; "
          f"B's uploads: {up['uploads']} ({up['superseded']} superseded), {up['bytes'] / 1e6:.2f} MB, "
          f"{up['seconds']:.3f} s in the background, {up['blocking_s']:.4f} s on the training thread "
          f"({up['blocking_s'] / max(loop_s, 1e-9):.2%} of {loop_s:.1f} s)")  # fmt: skip
    assert up["blocking_s"] < 0.05 * loop_s + 0.5, up  # the loop only links and queues (and waits at the end)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        from pfactory.runtime.failures import UserError

        try:
            train(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), **json.loads(sys.argv[5]))
        except UserError as e:  # as tasks._stage does: the error's own exit code
            print(f"train: {e}", file=sys.stderr)
            sys.exit(e.exit_code)
