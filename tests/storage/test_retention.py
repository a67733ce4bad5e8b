"""Retention (pfactory/storage/retention.py, `factory gc` / `factory disk`): what it keeps and why, what it frees, and
that a run in progress (a lease held by another process) loses nothing.

A tiny DVC project (tests/tiny_dvc.py: runs made by the factory's own workspace code), a real MLflow registry
(sqlite in tmp) holding a champion whose pipeline run's `data.<out>.md5` tags name one run's outputs.
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

from pfactory.storage import retention
from tests import tiny_dvc

pytestmark = pytest.mark.slow

RUNS = {  # run id -> synth.frames (each its own data and model objects)
    "20261201T000000Z-r1-000001": 3,
    "20261201T010000Z-r2-000002": 4,
    "20261201T020000Z-r3-000003": 5,
    "20261201T030000Z-r4-000004": 6,
}


def _registry(tmp_path: Path, ws) -> tuple[str, object]:
    """A registry with `pfactory-detector` v1 @champion from a pipeline run of workspace `ws`."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = c.create_experiment("factory", artifact_location=(tmp_path / "mlartifacts").as_uri())
    tags = {
        "pipeline": "true",
        "run_id": ws.run_id,
        **{f"data.{k}.md5": v for k, v in ws.out_hashes().items()},
    }
    run = c.create_run(exp, tags=tags)
    c.set_terminated(run.info.run_id)
    c.create_registered_model("pfactory-detector")
    c.create_model_version("pfactory-detector", f"runs:/{run.info.run_id}/candidate", run.info.run_id)
    c.set_registered_model_alias("pfactory-detector", "champion", "1")
    return uri, c


def _hold_lease(root: Path, run_id: str) -> subprocess.Popen:
    code = (
        "import sys, time; from pathlib import Path; from pfactory.storage.retention import run_lease\n"
        f"with run_lease(Path({str(root)!r}), {run_id!r}):\n    print('held', flush=True); time.sleep(300)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=tiny_dvc.env()
                         | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])})  # fmt: skip
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory):
    """Four runs of the tiny project, shared by this module: the tests that only read it come first, the one
    that collects comes last."""
    root = tiny_dvc.make(tmp_path_factory.mktemp("retention") / "p")
    ws = {rid: tiny_dvc.run(root, rid, [f"synth.frames={n}"])[0] for rid, n in RUNS.items()}
    return root, ws


def test_a_lease_is_held_while_its_process_lives_and_stale_after_a_kill(tmp_path: Path) -> None:
    root = tiny_dvc.make(tmp_path / "p")
    cache = retention.read_config(root)
    holder = _hold_lease(root, "20261201T000000Z-live-000001")
    try:
        held = retention.active_leases(cache)
        assert [h["run_id"] for h in held] == ["20261201T000000Z-live-000001"] and held[0][
            "pid"
        ] == holder.pid
    finally:
        holder.kill()  # SIGKILL: no cleanup ran; the kernel released the lock
        holder.wait(10)
    assert (retention.lease_dir(cache) / "20261201T000000Z-live-000001.lease").exists()
    assert retention.active_leases(cache) == []
    assert not list(retention.lease_dir(cache).glob("*.lease")), "the stale lease is removed"


def test_factory_gc_without_yes_only_shows_the_table_and_disk_reports(project) -> None:
    root, ws = project
    env = {**tiny_dvc.env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def factory(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "factory.cli", *args], cwd=root, env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip

    r = factory("gc", "--keep-last", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dry run" in r.stdout and "remove" in r.stdout and "one of the 2 newest" in r.stdout
    assert all(w.path.is_dir() for w in ws.values()), "without --yes nothing is removed"
    r = factory("gc")
    assert r.returncode == 2 and "--keep-last" in r.stderr
    r = factory("disk", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    usage = json.loads(r.stdout)
    assert len(usage["runs"]) == 4 and set(usage["stages"]) == {"data", "model"}
    listings = 4 * 1000  # a `.dir` listing per data output, a few hundred bytes each
    assert 0 <= usage["stages"]["data"]["cache_bytes"] - (3 + 4 + 5 + 6) * tiny_dvc.FILE_BYTES < listings
    assert all(run["own_bytes"] < run["apparent_bytes"] for run in usage["runs"]), "outputs are links"


def test_gc_refuses_to_guess_when_the_registry_cannot_be_read(project) -> None:
    root, ws = project
    env = {
        **tiny_dvc.env(),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "MLFLOW_TRACKING_URI": "http://127.0.0.1:9",  # nothing listens there
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "3",
    }
    r = subprocess.run([sys.executable, "-m", "factory.cli", "gc", "--keep-last", "1", "--yes"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert (
        r.returncode == 1 and "cannot read the model registry" in r.stderr and "nothing removed" in r.stderr
    )
    assert all(w.path.is_dir() for w in ws.values())


def test_lease_file_names_the_holder(tmp_path: Path) -> None:
    root = tiny_dvc.make(tmp_path / "p")
    with retention.run_lease(root, "20261201T000000Z-me-000001") as path:
        info = json.loads(path.read_text())
        assert info["pid"] == os.getpid() and info["workspace"].endswith(
            "artifacts/runs/20261201T000000Z-me-000001"
        )
    assert not path.exists()


def test_gc_keeps_the_newest_the_champions_lineage_and_a_run_in_progress(project, tmp_path: Path) -> None:
    from pfactory.storage.retention import registry_lineage

    root, ws = project
    r1, r2, r3, r4 = RUNS
    _, client = _registry(tmp_path, ws[r2])  # the champion came from r2
    holder = _hold_lease(root, r3)  # r3 is "in progress" in another process
    try:
        later = time.time() + retention.GRACE_S + 60  # every object older than the grace window
        plan = retention.plan(
            root, keep_last=1, keep_days=None, registry=lambda: registry_lineage(client), now=later
        )
        kept = {r.run_id: why for r, why in plan.kept_runs}
        assert set(kept) == {r3, r4} and "in progress" in kept[r3] and "newest" in kept[r4]
        assert [r.run_id for r in plan.removed_runs] == [r1, r2]
        champion = retention.expand(plan.cache, ws[r2].out_hashes().values())
        assert champion <= plan.kept_objects and not champion & plan.removed_objects.keys()
        r1_objects = retention.expand(plan.cache, ws[r1].out_hashes().values())
        assert set(plan.removed_objects) == r1_objects, "exactly r1's data and model go"
        rows = plan.table()
        assert any(r["what"] == "model" and "@champion" in r["name"] and "model.pt" in r["why"] for r in rows)
        r1_bytes = 3 * tiny_dvc.FILE_BYTES + 32 * 32768
        assert r1_bytes <= plan.frees_bytes < r1_bytes + 2_000_000, plan.frees_bytes

        done = retention.collect(root, plan)
        assert sorted(done.runs) == [r1, r2] and done.objects == len(r1_objects)
        assert not ws[r1].path.exists() and not ws[r2].path.exists()
        assert ws[r3].path.is_dir() and ws[r4].path.is_dir()
        assert all(retention.object_path(plan.cache, h).is_file() for h in champion)
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(10)
    # The champion's stages still restore from the run-cache; r1's are recomputed (their entries went first).
    _, how = tiny_dvc.run(root, "20261201T050000Z-again-000005", ["synth.frames=4"])
    assert how == {"data": "run-cache", "model": "run-cache"}
    _, how = tiny_dvc.run(root, "20261201T060000Z-r1again-000006", ["synth.frames=3"])
    assert how == {"data": "ran", "model": "ran"}
    tiny_dvc.git(root, "worktree", "prune")
    assert r1 not in tiny_dvc.git(root, "worktree", "list")
    # The command: new objects are within the grace window (a stage may be committing them), so this gc
    # removes the older runs' workspaces and keeps their objects until they are older.
    env = {**tiny_dvc.env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-m", "factory.cli", "gc", "--keep-last", "2", "--yes", "--json"], cwd=root,
                       env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert sorted(out["removed"]["runs"]) == [r3, r4] and out["removed"]["objects"] == 0, out["removed"]
    assert len(retention.list_runs(root)) == 2


def test_the_gc_params_section_is_checked_and_is_no_stages_dependency() -> None:
    import yaml

    from flows.params import ParamsError, load_params

    root = Path(__file__).resolve().parents[2]
    p = load_params(root / "params.yaml", ["gc.keep_last=3", "gc.keep_days=7"])
    assert (p.gc.keep_last, p.gc.keep_days) == (3, 7.0)
    assert load_params(root / "params.yaml").gc.keep_last is None, "by default a run deletes nothing"
    with pytest.raises(ParamsError, match=r"gc\.keep_last"):
        load_params(root / "params.yaml", ["gc.keep_last=0"])
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    assert not any("gc" in (s.get("params") or []) for s in stages.values()), "-S gc.* must not re-run a stage"
