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
  ref    uninterrupted (the `reference` fixture: its own project).
The runs differ only in `train.checkpoint_every_steps` (not part of the trajectory, so resuming ignores it; a DVC
param, so no run restores another's train from the run-cache). Every resumed loss curve equals ref's at every
step; the final KPIs are equal.

Then the pipeline as a schedule runs it: deployed (`factory deploy`, served from the project) on a real
`prefect server` on 127.0.0.1, a flow run triggered, its train process SIGKILLed once after a checkpoint:
Prefect's retry of the train task resumes at the checkpoint's step and the flow run completes. And a run
that travels: two clones sharing only a DVC remote (a local directory), SIGTERM in clone A, `factory run
--resume NAME` in clone B, which has no such workspace, continues from the checkpoint on the remote.
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

from tests.flows.pipeline_project import clean_env, dvc, make_project, tiny_args

pytestmark = [pytest.mark.slow, pytest.mark.full]
TRAJECTORY_KEYS = ("step", "epoch", "lr", "loss", "heatmap", "reg", "grad_norm")
EPOCHS = ["-S", "train.epochs=6"]


def _start(project: Path, name: str, *extra: str) -> subprocess.Popen:
    log = open(project / f"{name}.stderr", "w")  # noqa: SIM115 - the child writes to it
    return subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "run", *extra, "--name", name, "--json"],
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


def _resumed_at(ws: Path) -> int:
    """The step train's last attempt resumed at: its log line (`train: resumed from ... at step N of T`),
    checked against metrics.json."""
    lines = [ln for ln in (ws / "logs" / "train.log").read_text().splitlines() if "train: resumed from" in ln]
    assert lines, (ws / "logs" / "train.log").read_text()[-3000:]
    step = int(lines[-1].split(" at step ")[1].split()[0])
    metrics = json.loads((ws / "artifacts" / "model" / "metrics.json").read_text())
    assert metrics["resumed"] and metrics["resumed_at_step"] == step, metrics
    return step


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted run (its own project): the loss curve (36 steps) and KPIs the resumed runs end with."""
    project = make_project(tmp_path_factory.mktemp("reference") / "project")
    code, ref, err = _run(project, "ref", *tiny_args(), *EPOCHS, "--until", "evaluate",
                          "-S", "train.checkpoint_every_steps=5")  # fmt: skip
    assert code == 0, err[-3000:]
    ref_ws = Path(ref["workspace"])
    assert json.loads((ref_ws / "artifacts" / "model" / "metrics.json").read_text())["resumed"] is False
    curve = _curve(ref_ws)
    assert len(curve) == 36  # 6 epochs x 6 steps
    return {"curve": curve, "kpis": _kpis(ref_ws)}


def test_interrupted_runs_resume_to_the_uninterrupted_result(tmp_path: Path, reference: dict) -> None:
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

    for ws in (term_ws, kill_ws, retry_ws):
        assert _curve(ws) == reference["curve"], ws.name  # every step, every loss term
    assert _kpis(term_ws) == reference["kpis"] and _kpis(kill_ws) == reference["kpis"]
    print(f"kill: resumed from step {killed_at}; retry: resumed from step >= {retried_from}; "
          f"{time.time() - t0:.0f} s in all")  # fmt: skip


def _api(url: str, body: dict | None = None) -> object:
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def _descendant_train(pid: int) -> psutil.Process | None:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return None
    for k in kids:
        try:
            if "tasks.train" in " ".join(k.cmdline()):
                return k
        except psutil.Error:
            continue
    return None


def test_a_scheduled_runs_killed_train_is_resumed_by_prefects_retry(
    tmp_path: Path, prefect_server, reference: dict
) -> None:
    """The pipeline deployed and served (`factory deploy`) on a real Prefect server, one flow run triggered; its
    train process SIGKILLed once a checkpoint exists: the train task's retry (Prefect's, run_count 2) resumes at
    the checkpoint's step, the flow run is Completed, the loss curve equals the uninterrupted run's."""
    project = make_project(tmp_path / "project")
    args = [*tiny_args(), *EPOCHS, "-S", "train.checkpoint_every_steps=3"]
    params = {"stages": ["synth", "prepare", "train"], "name": "scheduled", "checkout": False}
    cmd = [sys.executable, "-m", "factory.cli", "deploy", "--name", "resume-nightly", "--cron", "0 3 * * *", *args,
           "--parameters", json.dumps(params)]  # fmt: skip
    log = project / "serve.log"
    with open(log, "wb") as f:
        serve = subprocess.Popen(cmd, cwd=project, env={**clean_env(project), **prefect_server.env}, stdout=f,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    api = prefect_server.url
    try:
        dep, deadline = None, time.monotonic() + 180
        while dep is None:
            try:
                dep = _api(f"{api}/deployments/name/perception-factory/resume-nightly")
            except OSError:
                assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(1)
        fr = _api(f"{api}/deployments/{dep['id']}/create_flow_run", {"name": "scheduled-run"})

        deadline, victim, step = time.monotonic() + 900, None, 0
        while victim is None:
            assert time.monotonic() < deadline and serve.poll() is None, log.read_text()[-3000:]
            ws = _workspace(project, "scheduled")
            ckpt = ws / "artifacts" / ".state" / "resume" / "train" / "checkpoint.pt" if ws else None
            if ckpt is not None and ckpt.is_file() and _train_progress(ws)[0] >= 0.5 * 36:
                import torch

                step = torch.load(ckpt, weights_only=True)["step"]
                victim = _descendant_train(serve.pid)
            time.sleep(0.05)
        victim.kill()  # SIGKILL: no checkpoint of its own; the periodic one is what the retry has
        t_kill = time.monotonic()

        deadline = time.monotonic() + 900
        while (state := _api(f"{api}/flow_runs/{fr['id']}")["state_type"]) not in (
            "COMPLETED", "FAILED", "CRASHED", "CANCELLED"
        ):  # fmt: skip
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert state == "COMPLETED", log.read_text()[-4000:]
        tasks = _api(f"{api}/task_runs/filter", {"flow_runs": {"id": {"any_": [fr["id"]]}}})
        train = [t for t in tasks if t["name"].rsplit("-", 1)[0] == "train"]
        assert [(t["run_count"], t["state_type"]) for t in train] == [(2, "COMPLETED")], tasks
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
    resumed_at = _resumed_at(ws)
    assert resumed_at >= step > 0, (resumed_at, step)  # the retry continued from the checkpoint, not step 0
    assert _curve(ws) == reference["curve"]
    assert json.loads((ws / "logs" / "run.json").read_text())["state"] == "finished"
    print(f"scheduled: train SIGKILLed after its step-{step} checkpoint; Prefect's retry resumed at step "
          f"{resumed_at}; Completed {time.monotonic() - t_kill:.0f} s after the kill")  # fmt: skip


def test_a_run_interrupted_on_one_machine_resumes_on_another_through_the_dvc_remote(
    tmp_path: Path, reference: dict
) -> None:
    """Two clones sharing only a DVC remote (a local directory). A: SIGTERM during train, exit 143, the
    checkpoint of that moment on the remote. B (no such workspace): `factory run --resume NAME` makes the run's
    workspace from the remote, restores synth and prepare from it, resumes train at the checkpoint's step, and
    ends with the uninterrupted curve; the remote then says finished. A name the remote lacks: one line, exit 2."""
    from pfactory.train.remote_checkpoint import RunRemote

    shared = tmp_path / "dvc-remote"
    a, b = make_project(tmp_path / "a"), make_project(tmp_path / "b")
    for clone in (a, b):
        r = dvc(clone, "remote", "add", "-d", "shared", str(shared))
        assert r.returncode == 0, r.stderr

    proc = _start(a, "travel", *tiny_args(), *EPOCHS, "--until", "train", "-S", "train.checkpoint_every_steps=4")
    _wait_for_train(a, "travel", proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(300)
    err = (a / "travel.stderr").read_text()
    assert proc.returncode == 143, err[-3000:]
    ws_a = _workspace(a, "travel")
    import torch

    stopped = torch.load(ws_a / "artifacts" / ".state" / "resume" / "train" / "checkpoint.pt",
                         weights_only=True)["step"]  # fmt: skip
    marker = RunRemote(a).read_marker(ws_a.name)
    assert marker["checkpoint"]["step"] == stopped and marker["record"]["state"] == "interrupted", marker
    assert (shared / "pfactory-runs" / ws_a.name / marker["checkpoint"]["key"]).is_file()

    code, out, err = _run(b, "travel-b", "--resume", "travel")
    assert code == 0, err[-3000:]
    ws_b = Path(out["workspace"])
    assert ws_b.parent == b / "artifacts" / "runs" and ws_b.name == ws_a.name  # the same run, in clone B
    assert {s: out["stages"][s]["how"] for s in ("synth", "prepare")} == {
        "synth": "run-cache",
        "prepare": "run-cache",
    }, out["stages"]  # restored from the remote (A pushed them when it stopped), not recomputed
    assert _resumed_at(ws_b) == stopped > 0
    assert _curve(ws_b) == reference["curve"]
    after = RunRemote(b).read_marker(ws_a.name)
    assert after["record"]["state"] == "finished" and "checkpoint" not in after, after
    assert not list((shared / "pfactory-runs" / ws_a.name).glob("checkpoint-*"))

    r = subprocess.run([sys.executable, "-m", "factory.cli", "run", "--resume", "nosuch"], cwd=b, env=clean_env(b),
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "--resume nosuch" in lines[0] and "DVC remote 'shared'" in lines[0], lines
    up = json.loads((ws_b / "artifacts" / "model" / "metrics.json").read_text())["checkpoint"]
    print(f"travel: SIGTERM in A at step {stopped}; B resumed at step {stopped} from the remote; B's checkpoints: "
          f"{up}")  # fmt: skip


def test_resume_refuses_what_it_cannot_continue(tmp_path: Path) -> None:
    """No interrupted run, an unknown name, -S with --resume, a run name without --resume: one line, exit 2."""
    project = make_project(tmp_path / "project")
    env = clean_env(project)

    def factory(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "factory.cli", *args], cwd=project, env=env,
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
