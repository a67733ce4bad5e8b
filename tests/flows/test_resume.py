"""`factory run --resume`: an interrupted pipeline run continues in its own workspace, and ends where an
uninterrupted run ends.

One tiny project (tests/flows/pipeline_project.py's TINY, 6 train epochs: 36 steps), runs through evaluate:
  term   `factory run` gets SIGTERM at ~60 % of train (the parent only: it must pass it on): exit 143 within
         10 s, ONE line saying `factory run --resume <id>`, train's checkpoint kept in the workspace; then
         `factory run --resume` (the newest interrupted run): exit 0, synth and prepare up to date, train resumed
         from its checkpoint, the same MLflow parent run;
  kill   the whole process tree SIGKILLed at ~60 % of train, then `factory run --resume kill`: exit 0, train
         resumed from its last periodic checkpoint;
  retry  only the train process SIGKILLed (through train): Prefect's retry of the stage task resumes it;
  ref    uninterrupted.
The runs differ only in `train.checkpoint_every_steps` (not part of the trajectory, so resuming ignores it; a DVC
param, so no run restores another's train from the run-cache). Every resumed loss curve equals ref's at every
step; the final KPIs are equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.flows.pipeline_project import clean_env, make_project, tiny_args

pytestmark = [pytest.mark.slow, pytest.mark.full]
TRAJECTORY_KEYS = ("step", "epoch", "lr", "loss", "heatmap", "reg", "grad_norm")
EPOCHS = ["-S", "train.epochs=6"]


def _start(project: Path, name: str, *extra: str) -> subprocess.Popen:
    log = open(project / f"{name}.stderr", "w")  # noqa: SIM115 - the child writes to it
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", *extra, "--name", name, "--json"],
        cwd=project, env=clean_env(project), stdout=subprocess.PIPE, stderr=log, text=True,
        start_new_session=True,
    )  # fmt: skip


def _run(project: Path, name: str, *extra: str) -> tuple[int, dict | None, str]:
    proc = _start(project, name, *extra)
    out, _ = proc.communicate(timeout=1200)
    err = (project / f"{name}.stderr").read_text()
    return proc.returncode, json.loads(out) if proc.returncode == 0 else None, err


def _workspace(project: Path, name: str) -> Path | None:
    found = sorted((project / "artifacts" / "runs").glob(f"*-{name}-*"))
    return found[-1] if found else None


def _train_progress(ws: Path | None) -> tuple[int, int]:
    """(step, total) of the newest train event in the workspace's progress file."""
    f = ws / "logs" / "progress.jsonl" if ws else None
    if f is None or not f.is_file():
        return 0, 1
    events = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    train = [e for e in events if e.get("stage") == "train" and "step" in e]
    return (train[-1]["step"], train[-1]["total"]) if train else (0, 1)


def _step_seconds(ws: Path) -> float:
    """Seconds of the slowest train step the progress file saw (batch / samples per second)."""
    events = [json.loads(x) for x in (ws / "logs" / "progress.jsonl").read_text().splitlines() if x.strip()]
    rates = [e["samples_per_s"] for e in events if e.get("stage") == "train" and e.get("samples_per_s")]
    return max((2 / r for r in rates), default=0.0)  # TINY: train.batch_size=2


def _train_process(proc: subprocess.Popen) -> psutil.Process | None:
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return None
    return next((k for k in kids if "tasks.train" in " ".join(k.cmdline())), None)


def _wait_for_train(project: Path, name: str, proc: subprocess.Popen, share: float = 0.6) -> int:
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
        step, total = _train_progress(_workspace(project, name))
        if step >= share * total:
            return step
        time.sleep(0.05)
    raise AssertionError(f"{name}: train never reached {share:.0%} (exit {proc.poll()})")


def _curve(ws: Path) -> list[dict]:
    rows = json.loads((ws / "artifacts" / "model" / "curves.json").read_text())
    return [{k: r[k] for k in TRAJECTORY_KEYS if k in r} for r in rows]


def _kpis(ws: Path) -> dict:
    k = json.loads((ws / "artifacts" / "eval" / "kpis.json").read_text())
    return {"mAP": k["mAP"], "NDS": k["NDS"], "classes": k["classes"]}


def test_interrupted_runs_resume_to_the_uninterrupted_result(tmp_path: Path) -> None:
    project = make_project(tmp_path / "project")
    base = [*tiny_args(), *EPOCHS, "--until", "evaluate"]
    t0 = time.time()

    # term: SIGTERM to `factory run` alone.
    proc = _start(project, "term", *base, "-S", "train.checkpoint_every_steps=2")
    step = _wait_for_train(project, "term", proc)
    train_pid = _train_process(proc)
    t_sig = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    exit_s = time.perf_counter() - t_sig
    err = (project / "term.stderr").read_text()
    term_ws = _workspace(project, "term")
    assert proc.returncode == 143, err[-3000:]
    step_s = _step_seconds(term_ws)
    assert exit_s < 10 + step_s, (exit_s, step_s)  # the step in progress finishes first (s on a loaded box)
    resume_lines = [ln for ln in err.splitlines() if "factory run --resume" in ln]
    assert resume_lines == [resume_lines[0]] and term_ws.name in resume_lines[0], err[-2000:]
    assert train_pid is None or not psutil.pid_exists(train_pid.pid)  # the stage stopped with it
    ckpt = term_ws / "artifacts" / ".state" / "resume" / "train" / "checkpoint.pt"
    import torch

    stopped_at = torch.load(ckpt, weights_only=True)["step"]
    assert stopped_at >= step
    record = json.loads((term_ws / "logs" / "run.json").read_text())
    assert record["state"] == "interrupted"
    print(
        f"term: SIGTERM at train step {step}; exit 143 after {exit_s:.2f} s; checkpoint at step {stopped_at}"
    )

    code, term, err = _run(project, "term-resume", "--resume")
    assert code == 0, err[-3000:]
    assert term["run_id"] == term_ws.name and term["mlflow_run_id"] == record["mlflow_run_id"]
    assert {s: term["stages"][s]["how"] for s in ("synth", "prepare")} == {
        "synth": "up to date",
        "prepare": "up to date",
    }
    assert term["stages"]["train"]["how"] == "ran"
    metrics = json.loads((term_ws / "artifacts" / "model" / "metrics.json").read_text())
    assert metrics["resumed"]
    assert json.loads((term_ws / "logs" / "run.json").read_text())["state"] == "finished"

    # kill: SIGKILL the whole tree; resume by name.
    proc = _start(project, "kill", *base, "-S", "train.checkpoint_every_steps=4")
    _wait_for_train(project, "kill", proc)
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        p.kill()
    proc.wait(30)
    kill_ws = _workspace(project, "kill")
    killed_at = torch.load(kill_ws / "artifacts" / ".state" / "resume" / "train" / "checkpoint.pt",
                           weights_only=True)["step"]  # fmt: skip
    code, kill, err = _run(project, "kill-resume", "--resume", "kill")
    assert code == 0, err[-3000:]
    assert kill["run_id"] == kill_ws.name and kill["stages"]["train"]["how"] == "ran"

    # retry: only the train process is SIGKILLed; the stage task's retry resumes it in the same run.
    proc = _start(
        project, "retry", *tiny_args(), *EPOCHS, "--until", "train", "-S", "train.checkpoint_every_steps=3"
    )
    _wait_for_train(project, "retry", proc)
    victim = _train_process(proc)
    retry_ws = _workspace(project, "retry")
    retried_from = torch.load(retry_ws / "artifacts" / ".state" / "resume" / "train" / "checkpoint.pt",
                              weights_only=True)["step"]  # fmt: skip
    victim.kill()
    proc.communicate(timeout=1200)
    err = (project / "retry.stderr").read_text()
    assert proc.returncode == 0, err[-3000:]
    assert "train: transient failure (killed); resuming" in err
    assert json.loads((retry_ws / "artifacts" / "model" / "metrics.json").read_text())["resumed"]

    # ref: uninterrupted.
    code, ref, err = _run(project, "ref", *base, "-S", "train.checkpoint_every_steps=5")
    assert code == 0, err[-3000:]
    ref_ws = Path(ref["workspace"])
    assert json.loads((ref_ws / "artifacts" / "model" / "metrics.json").read_text())["resumed"] is False
    reference = _curve(ref_ws)
    assert len(reference) == 36  # 6 epochs x 6 steps
    for ws in (term_ws, kill_ws, retry_ws):
        assert _curve(ws) == reference, ws.name  # every step, every loss term
    assert _kpis(term_ws) == _kpis(ref_ws) and _kpis(kill_ws) == _kpis(ref_ws)
    print(f"kill: resumed from step {killed_at}; retry: resumed from step >= {retried_from}; "
          f"{time.time() - t0:.0f} s in all")  # fmt: skip


def test_resume_refuses_what_it_cannot_continue(tmp_path: Path) -> None:
    """No interrupted run, an unknown name, -S with --resume, a run name without --resume: one line, exit 2."""
    project = make_project(tmp_path / "project")
    env = clean_env(project)

    def factory(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=project, env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip

    r = factory("run", "--resume")
    assert r.returncode == 2 and "no interrupted run" in r.stderr, r.stderr[-2000:]
    r = factory("run", "--resume", "nope")
    assert r.returncode == 2 and "--resume nope: no run with this id or name" in r.stderr, r.stderr[-2000:]
    r = factory("run", "--resume", "-S", "train.lr=0.1")
    assert r.returncode == 2 and "-S overrides are refused" in r.stderr
    r = factory("run", "nope")
    assert r.returncode == 2 and "--resume" in r.stderr
    runs = project / "artifacts" / "runs"
    assert not runs.exists() or not os.listdir(runs)  # nothing was started
