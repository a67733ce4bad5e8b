"""Infrastructure faults: the tracking server unreachable or killed, the Prefect server lost, a Dask worker
lost, a full disk, a corrupt DVC cache -- each a bounded, clear failure or a correct recovery.

- MLflow unreachable at start: a stage and `factory run` fail in seconds (not MLflow's ~4.5 min of retries),
  in a few lines naming the server, no traceback.
- MLflow killed mid-run (full matrix): the run ends promptly; with the server back, `factory run` again
  finishes, no run is left RUNNING, the rerun's records are complete and not duplicated.
- Prefect server lost mid-run (full matrix): the run ends (bounded), a rerun with the server back finishes
  and restores what was done.
- Disk full (a tmpfs of a few MB as the output's file system): one line naming the path, nothing published,
  no temp left, the input intact.
- A Dask worker SIGKILLed while evaluate runs on it: the unit reruns elsewhere, the KPIs are unchanged.
- A corrupt file in the DVC cache: a rerun never publishes it (the corruption is detected, not read).
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

from tests.faults.conftest import (
    FULL,
    REPO,
    clean_env,
    copy_dataset,
    factory,
    factory_subprocess,
    one_line_error,
)
from tests.faults.test_params_paths import _mount_tmpfs, tree_digest
from tests.local_services import free_port

PREPARE = ["-S", "prepare.batch_size=4"]


def test_mlflow_unreachable_at_start_stage(clean_kitti: Path, tmp_path: Path, ledger) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    env = clean_env(MLFLOW_TRACKING_URI=uri)
    proc, seconds, _ = factory_subprocess(
        "prepare", "--raw", str(clean_kitti), "--out", str(tmp_path / "out"), *PREPARE, env=env, timeout=300
    )
    lines = proc.stderr.strip().splitlines()
    ok = proc.returncode != 0 and seconds < 60 and "Traceback" not in proc.stderr and uri in proc.stderr
    ok = ok and len(lines) <= 3 and not (tmp_path / "out").exists()
    ledger.record("infra", "MLflow unreachable at start: factory prepare", ok,
                  detail=f"exit {proc.returncode} after {seconds:.1f} s: {lines[-1][:160] if lines else ''}")  # fmt: skip
    assert ok, (proc.returncode, seconds, proc.stderr[-3000:])


@pytest.mark.slow
def test_mlflow_unreachable_at_start_pipeline(tmp_path: Path, ledger) -> None:
    from tests.faults.pipeline import make_project, start_run, watch

    project = make_project(tmp_path / "project")
    uri = f"http://127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    run = start_run(project, "unreachable", env={"MLFLOW_TRACKING_URI": uri})
    watch(run, timeout=400)
    seconds = time.perf_counter() - t0
    err = run.log.read_text()
    ok = run.proc.returncode not in (0, None) and seconds < 120 and "Traceback" not in err and uri in err
    ok = ok and not run.seen  # no stage started
    ledger.record("infra", "MLflow unreachable at start: factory run", ok,
                  detail=f"exit {run.proc.returncode} after {seconds:.1f} s, {len(err.splitlines())} lines, "
                         f"stages started: {sorted(run.seen)}")  # fmt: skip
    assert ok, (run.proc.returncode, seconds, err[-3000:])


# ---------------------------------------------------------------------------------------------------------
# Disk full


@pytest.fixture
def tmpfs(tmp_path: Path):
    mounts = []

    def mount(name: str, size: str) -> Path:
        where = tmp_path / name
        if not _mount_tmpfs(where, size):
            pytest.skip("mounting a tmpfs needs root")
        mounts.append(where)
        return where

    yield mount
    for m in mounts:
        subprocess.run(["umount", str(m)], check=False)


def _disk_full_case(ledger, case: str, r, mnt: Path, protect: dict[Path, str], words: str) -> None:
    leftovers = sorted(
        str(p.relative_to(mnt)) for p in mnt.rglob("*") if not p.is_dir()
    )  # no file, half or whole
    changed = [str(p) for p, d in protect.items() if tree_digest(p) != d]
    ok = one_line_error(r) and "disk full" in r.err and words in r.err and not changed
    ok = ok and not leftovers
    ledger.record("infra", case, ok, lost=len(changed),
                  detail=(r.err.strip().splitlines() or [""])[-1][:200] + (f"; left {leftovers}" if leftovers else ""))  # fmt: skip
    assert ok, (r.text[-2000:], leftovers, changed)


def test_disk_full_prepare(clean_kitti: Path, tmp_path: Path, tmpfs, ledger) -> None:
    raw = copy_dataset(clean_kitti, tmp_path / "raw")
    before = tree_digest(raw)
    mnt = tmpfs("small", "256k")  # 6 frames at 416x128 are ~2 MB of shards
    out = mnt / "prepared"
    r = factory("prepare", "--raw", str(raw), "--out", str(out), *PREPARE)
    _disk_full_case(
        ledger, "disk full: factory prepare --out <256 KB tmpfs>", r, mnt, {raw: before}, str(out)
    )


def test_disk_full_train(clean_kitti: Path, tmp_path: Path, tmpfs, ledger) -> None:
    prepared = tmp_path / "prepared"
    r = factory("prepare", "--raw", str(clean_kitti), "--out", str(prepared), *PREPARE,
                "-S", "prepare.image_size=[104,32]", "-S", "prepare.val_fraction=0.34")  # fmt: skip
    assert r.code == 0, r.text
    before = tree_digest(prepared)
    mnt = tmpfs("small", "512k")  # the default model's weights are ~7 MB
    r = factory("train", "--data", str(prepared), "--out", str(mnt / "model"), "-S", "train.max_steps=1",
                "-S", "train.batch_size=2", "-S", "train.val_every_epochs=0")  # fmt: skip
    _disk_full_case(
        ledger, "disk full: factory train --out <512 KB tmpfs>", r, mnt, {prepared: before}, str(mnt)
    )


def test_disk_full_tracking_store(clean_kitti: Path, tmp_path: Path, tmpfs, ledger) -> None:
    """The MLflow sqlite store on a full file system: one line, the prepared output not published."""
    mnt = tmpfs("mlflow", "64k")
    env = clean_env(MLFLOW_TRACKING_URI=f"sqlite:///{mnt / 'mlflow.db'}")
    proc, _, _ = factory_subprocess(
        "prepare", "--raw", str(clean_kitti), "--out", str(tmp_path / "out"), *PREPARE, env=env
    )
    lines = proc.stderr.strip().splitlines()
    ok = (
        proc.returncode == 1
        and "Traceback" not in proc.stderr
        and "disk full" in proc.stderr
        and str(mnt / "mlflow.db") in proc.stderr  # the store's file, not the working directory
        and len(lines) <= 3
    )
    ledger.record("infra", "disk full: the MLflow store (sqlite on a 64 KB tmpfs)", ok,
                  detail=f"exit {proc.returncode}: {lines[-1][:160] if lines else ''}")  # fmt: skip
    assert ok, (proc.returncode, proc.stderr[-3000:])


# ---------------------------------------------------------------------------------------------------------
# Servers killed mid-run (full matrix: each is a whole tiny pipeline, twice)


def _kill_server(server) -> None:
    os.killpg(os.getpgid(server.proc.pid), signal.SIGKILL)
    server.proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.full  # a pipeline run killed mid-stage (~3.5 min); the screen's wording: tests/flows/test_failure.py
def test_mlflow_killed_in_a_stage_names_the_stage(tmp_path: Path, ledger) -> None:
    """The tracking server dies 1 s into train: train fails (exit 75, transient, retried) and the screen says
    so -- the flow's own MLflow calls that fail after it (ending the parent run FAILED) must not replace the
    stage's failure with a raw MlflowException 'in the flow, outside the stages'."""
    from tests.faults.pipeline import make_project, start_run, wait_for_stage, watch
    from tests.faults.servers import mlflow_server

    project = make_project(tmp_path / "project")
    with mlflow_server(tmp_path / "mlflow") as server:
        run = start_run(project, "mlflow-gone", "--until", "train", env={"MLFLOW_TRACKING_URI": server.url})
        assert wait_for_stage(run, "train", then_s=1), run.log.read_text()[-3000:]
        t_kill = time.perf_counter()
        _kill_server(server)
        watch(run, timeout=300)
        ended_s = time.perf_counter() - t_kill
    err = run.log.read_text()
    screen = err[err.find("✗") :] if "✗" in err else err
    ok = run.proc.returncode == 75 and "at stage train" in screen and "outside the stages" not in err
    ok = ok and "Traceback" not in err and ended_s < 120 and len(screen.splitlines()) <= 15
    ledger.record("infra", "MLflow server killed in train: the failure names the stage", ok,
                  detail=f"exit {run.proc.returncode} {ended_s:.0f} s after the kill; "
                         f"{(screen.splitlines() or [''])[0][:120]}")  # fmt: skip
    assert ok, (run.proc.returncode, ended_s, screen[-2000:])


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="full matrix only (PFACTORY_FAULTS_FULL=1): two tiny pipeline runs")
def test_mlflow_killed_mid_run_then_rerun(tmp_path: Path, ledger) -> None:
    from tests.faults.pipeline import finish, make_project, start_run, wait_for_stage, watch
    from tests.faults.servers import mlflow_server

    project = make_project(tmp_path / "project")
    with mlflow_server(tmp_path / "mlflow") as server:
        run = start_run(project, "mlflow-dies", env={"MLFLOW_TRACKING_URI": server.url})
        wait_for_stage(run, "train", then_s=2)
        t_kill = time.perf_counter()
        _kill_server(server)
        watch(run, timeout=600)
        ended_s = time.perf_counter() - t_kill
        err = run.log.read_text()
        server.restart()
        again = start_run(project, "mlflow-back", env={"MLFLOW_TRACKING_URI": server.url})
        watch(again)
        failures = []
        if run.proc.returncode == 0:
            failures.append("the run with a dead tracking server claimed success")
        if ended_s > 240:
            failures.append(f"the run took {ended_s:.0f} s to give up after the server died")
        if "outside the stages" in err or "at stage " not in err:
            failures.append("the failure screen does not name the stage that failed")
        try:
            result = finish(again)
        except AssertionError as e:
            result, failures = None, [*failures, f"rerun failed: {e}"]
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=server.url)
        exps = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(exps, max_results=1000)
        running = [r.info.run_name for r in runs if r.info.status == "RUNNING"]
        if running:
            failures.append(f"runs left RUNNING: {running}")
        if result is not None:
            parent = client.get_run(result["mlflow_run_id"])
            children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
            stages = [r.data.tags.get("stage") for r in children]
            if len(stages) != len(set(stages)) or "eval/mAP" not in parent.data.metrics:
                failures.append(f"the rerun's records are incomplete or duplicated: {stages}")
    ledger.record("infra", "MLflow server killed mid-run (in train), then a rerun", not failures,
                  detail=f"run ended {ended_s:.0f} s after the kill (exit {run.proc.returncode}, "
                         f"{len(err.splitlines())} lines); rerun {'ok' if result else 'failed'}")  # fmt: skip
    assert not failures, "\n".join(failures) + "\n" + err[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="full matrix only (PFACTORY_FAULTS_FULL=1): two tiny pipeline runs")
def test_prefect_server_lost_mid_run_then_rerun(tmp_path: Path, ledger) -> None:
    from tests.faults.pipeline import finish, make_project, start_run, wait_for_stage, watch
    from tests.faults.servers import prefect_server

    project = make_project(tmp_path / "project")
    with prefect_server(tmp_path / "prefect") as server:
        run = start_run(project, "prefect-dies", env=server.client_env)
        wait_for_stage(run, "train", then_s=2)
        t_kill = time.perf_counter()
        _kill_server(server)
        watch(run, timeout=900)
        ended_s = time.perf_counter() - t_kill
        err = run.log.read_text()
        server.restart()
        again = start_run(project, "prefect-back", env=server.client_env)
        watch(again)
        failures = []
        if ended_s > 300:
            failures.append(f"the run took {ended_s:.0f} s to end after the server died")
        if "outside the stages" in err:
            failures.append("the failure screen does not say that the Prefect server was lost")
        try:
            result = finish(again)
            redone = [s for s in ("synth", "prepare") if result["stages"][s]["how"] == "ran"]
            if redone:
                failures.append(f"the rerun recomputed {redone}")
        except AssertionError as e:
            result, failures = None, [*failures, f"rerun failed: {e}"]
    ledger.record("infra", "Prefect server killed mid-run (in train), then a rerun", not failures,
                  detail=f"run ended {ended_s:.0f} s after the kill (exit {run.proc.returncode}, "
                         f"{len(err.splitlines())} lines); rerun {'ok' if result else 'failed'}")  # fmt: skip
    assert not failures, "\n".join(failures) + "\n" + err[-3000:]


# ---------------------------------------------------------------------------------------------------------
# Corrupt DVC cache


@pytest.mark.slow
@pytest.mark.full  # needs the fault suite's baseline pipeline run (test_crashes.py)
def test_corrupt_dvc_cache_entry_is_never_published(baseline: dict, tmp_path: Path, ledger) -> None:
    """A shard flipped in a copy of the baseline's `.dvc/cache`: the next `factory run`, which restores
    prepare from the run-cache, must not hand the corrupt shard to train (or publish it)."""
    import hashlib

    from tests.faults.pipeline import copy_cache, digest, finish, half_written, make_project, start_run, watch

    project = make_project(tmp_path / "project")
    copy_cache(baseline["project"], project, ["synth", "prepare"])
    ws = Path(baseline["result"]["workspace"])
    manifest = json.loads((ws / "artifacts/prepared/manifest.json").read_text())
    shard = manifest["splits"]["train"]["shards"][0]
    data = (ws / "artifacts/prepared" / shard["file"]).read_bytes()
    md5 = hashlib.md5(data).hexdigest()
    cached = project / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
    assert cached.is_file(), cached
    cached.chmod(0o644)
    cached.write_bytes(data[:100] + bytes(b ^ 0xFF for b in data[100:200]) + data[200:])
    again = start_run(project, "after-corruption", "--until", "train")
    watch(again)
    err = again.log.read_text()
    wss = sorted((project / "artifacts" / "runs").glob("*after-corruption*"))
    bad = [p for w in wss for p in half_written(w)]
    try:
        result = finish(again)
    except AssertionError as e:
        result, bad = None, [*bad, f"the rerun failed: {str(e)[-300:]}"]
    same = result is not None and {
        k: v for k, v in digest(Path(result["workspace"])).items() if "prepared" in k
    } == {k: v for k, v in baseline["digest"].items() if "prepared" in k}
    ok = not bad and same
    how = (result or {}).get("stages", {}).get("prepare", {}).get("how", "?")
    ledger.record("infra", "corrupt file in the DVC cache, then factory run", ok, lost=len(bad),
                  detail=f"prepare {how} (the corrupt cached shard was not restored), outputs equal to the "
                         f"undisturbed run: {same}; problems: {bad or 'none'}")  # fmt: skip
    assert ok, (bad, same, err[-3000:])


# ---------------------------------------------------------------------------------------------------------
# Dask worker lost in evaluate


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL, reason="full matrix only: the same test runs in CI as tests/tasks/test_evaluate.py"
)
def test_dask_worker_killed_during_evaluate(tmp_path: Path, ledger) -> None:
    """Reuses the evaluate stage's own worker-kill test (tests/tasks/test_evaluate.py) and records it."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "pt"),
         "tests/tasks/test_evaluate.py::test_one_worker_and_a_killed_worker_reproduce_the_files"],
        cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    ok = proc.returncode == 0
    ledger.record("infra", "Dask worker SIGKILLed during evaluate", ok,
                  detail=f"the killed unit reran elsewhere, files identical ({time.perf_counter() - t0:.0f} s)"
                  if ok else proc.stdout[-200:])  # fmt: skip
    assert ok, proc.stdout[-3000:] + proc.stderr[-2000:]
