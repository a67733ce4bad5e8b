"""Concurrency: four `factory run` at once with different overrides in one project, two promotions racing,
a promotion racing `factory rollback`.

- 4 runs at once (CI: through `prepare`, full matrix: the whole pipeline) sharing one DVC cache, run-cache,
  MLflow store and Prefect home: all finish, each with its own workspace and MLflow run, and the shared
  outputs are intact (every workspace's prepared data matches its manifest; the common synth output is
  byte-identical across the four).
- 2 promotions racing for an empty registry (both gate against "no champion", then meet at the locked
  compare-and-set): exactly one wins, the other is refused naming the moved champion; audit trail and
  alias agree.
- A promotion racing a rollback: whichever takes the lock first, the alias, the audit chain (each record's
  `from` is the previous record's `to`) and the release folder agree.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.conftest import FULL, REPO

pytestmark = pytest.mark.slow


@pytest.mark.full  # ~170 s; two concurrent runs stay in the default tier (tests/flows/test_pipeline.py: runs)
def test_four_runs_at_once(tmp_path: Path, ledger) -> None:
    from tests.faults.pipeline import (
        digest,
        finish,
        half_written,
        make_project,
        mlflow_runs,
        start_run,
        watch,
    )

    project = make_project(tmp_path / "project")
    until = [] if FULL else ["--until", "prepare"]
    # four different val splits of the 12 tiny frames (split by a hash of the frame id), none of them empty:
    # 0.3 -> 1 val frame, 0.4 -> 2, 0.5 -> 4, 0.55 -> 5 (0.25 gives none: optimize's parity split needs one)
    overrides = [["-S", f"prepare.val_fraction={v}"] for v in (0.3, 0.4, 0.5, 0.55)]
    if FULL:
        overrides = [[*o, "-S", f"train.lr={lr}"] for o, lr in zip(overrides, (1e-3, 2e-3, 3e-3, 4e-3))]
    t0 = time.perf_counter()
    runs = [start_run(project, f"parallel{i}", *until, *o) for i, o in enumerate(overrides)]
    for r in runs:
        watch(r, timeout=1800)
    failures, results = [], []
    for r in runs:
        try:
            results.append(finish(r))
        except AssertionError as e:
            failures.append(str(e)[:1500])
    workspaces = {res["workspace"] for res in results}
    mlflow_ids = {res["mlflow_run_id"] for res in results}
    if len(results) == 4 and (len(workspaces) != 4 or len(mlflow_ids) != 4):
        failures.append(f"runs shared a workspace or an MLflow run: {workspaces}, {mlflow_ids}")
    bad = [p for res in results for p in half_written(Path(res["workspace"]))]
    if bad:
        failures.append(f"shared outputs corrupted: {bad}")
    synth = {
        json.dumps({k: v for k, v in digest(Path(res["workspace"])).items() if "data/raw" in k})
        for res in results
    }
    if len(synth) > 1:
        failures.append("the common synth output differs between the runs")
    running = [r.info.run_name for r in mlflow_runs(project) if r.info.status == "RUNNING"]
    if running:
        failures.append(f"MLflow runs left RUNNING: {running}")
    seconds = time.perf_counter() - t0
    ledger.record("concurrency", f"4 x factory run at once{' (through prepare)' if not FULL else ''}",
                  not failures, lost=len(bad),
                  detail=f"{len(results)}/4 finished in {seconds:.0f} s, {len(workspaces)} workspaces, "
                         f"{len(mlflow_ids)} MLflow runs")  # fmt: skip
    assert not failures, "\n".join(failures)


RACER = """
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
a = json.loads(sys.argv[1])
from tests.promote.helpers import promote_params
if a["what"] == "promote":
    import tasks.promote
    r = tasks.promote.run(promote_params(), Path(a["optimized"]), Path(a["eval"]), Path(a["data"]), Path(a["release"]))
else:
    from pfactory.promote.promotion import rollback
    r = rollback(promote_params(), Path(a["release"]), reason="race")
print("RESULT " + json.dumps(r, default=str))
"""


def _spawn(args: dict, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RACER.format(root=str(REPO)), json.dumps(args)],
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=300)
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        return {"error": err[-1500:]}
    return json.loads(line[7:])


def _chain_ok(trail: list[dict]) -> bool:
    return all(b["from"] == a["to"] for a, b in itertools.pairwise(trail))


def _promote_args(c: dict, bench: dict, tmp_path: Path) -> dict:
    return {"what": "promote", "optimized": str(c["optimized"]), "eval": str(c["eval"]),
            "data": str(bench["prepared_a"]), "release": str(tmp_path / "release")}  # fmt: skip


def _wait_awaiting(registry, n: int, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        waiting = [
            v for v in registry.search_model_versions("name = 'test-detector'")
            if v.tags.get("promotion.status") == "awaiting-lock"
        ]  # fmt: skip
        if len(waiting) >= n or any(p.poll() is not None for p in procs):
            return
        time.sleep(0.2)


@pytest.mark.full  # ~50 s; two racing promotions stay in the default tier: tests/tasks/test_promote.py
@pytest.mark.parametrize("trial", range(3 if FULL else 1))
def test_two_promotions_race(trial: int, bench, tmp_path: Path, registry, ledger) -> None:
    import mlflow

    from pfactory.promote import registry as reg
    from pfactory.tracking.runs import EXPERIMENT, artifact_location
    from tests.promote import helpers as H

    mlflow.create_experiment(EXPERIMENT, artifact_location=artifact_location(tmp_path))
    cands = [H.candidate(tmp_path, bench, f"racer{i}", 0.3 + 0.1 * i) for i in range(2)]
    with reg.registry_lock(reg.registry_uri(), timeout_s=5):  # both gate against "no champion", then race
        procs = [_spawn(_promote_args(c, bench, tmp_path), tmp_path) for c in cands]
        _wait_awaiting(registry, 2, procs)
    results = [_result(p) for p in procs]
    decisions = sorted(r.get("decision", "error") for r in results)
    alias = registry.get_registered_model("test-detector").aliases.get("champion")
    trail = reg.audit_trail(registry, "test-detector")
    winner = next((r for r in results if r.get("decision") == "promoted"), {})
    release = json.loads((tmp_path / "release" / "release.json").read_text())
    ok = decisions == ["promoted", "refused"] and str(alias) == str(winner.get("version"))
    ok = ok and len(trail) == 1 and _chain_ok(trail) and release["version"] == winner.get("version")
    ledger.record("concurrency", "2 promotions racing for the champion alias", ok,
                  detail=f"decisions {decisions}, champion v{alias}, {len(trail)} audit record(s)")  # fmt: skip
    assert ok, (results, alias, trail)


@pytest.mark.parametrize("trial", range(3 if FULL else 1))
def test_promotion_races_rollback(trial: int, bench, tmp_path: Path, registry, ledger) -> None:
    import mlflow

    from pfactory.promote import registry as reg
    from pfactory.tracking.runs import EXPERIMENT, artifact_location
    from tests.promote import helpers as H

    mlflow.create_experiment(EXPERIMENT, artifact_location=artifact_location(tmp_path))
    # v1 then v2 (better) promoted: v2 is the champion, v1 the previous one rollback would restore.
    for i, jitter in enumerate((0.5, 0.3)):
        p = _spawn(_promote_args(H.candidate(tmp_path, bench, f"c{i}", jitter), bench, tmp_path), tmp_path)
        assert _result(p).get("decision") == "promoted"
    better = H.candidate(tmp_path, bench, "c-better", 0.1)
    with reg.registry_lock(reg.registry_uri(), timeout_s=5):
        procs = [_spawn(_promote_args(better, bench, tmp_path), tmp_path)]
        _wait_awaiting(registry, 1, procs)
        procs.append(_spawn({"what": "rollback", "release": str(tmp_path / "release")}, tmp_path))
        time.sleep(3)  # the rollback waits for the lock too
    results = [_result(p) for p in procs]
    alias = registry.get_registered_model("test-detector").aliases.get("champion")
    trail = reg.audit_trail(registry, "test-detector")
    release = json.loads((tmp_path / "release" / "release.json").read_text())
    errors = [r["error"] for r in results if "error" in r]
    ok = not errors and _chain_ok(trail) and str(trail[-1]["to"]) == str(alias)
    ok = ok and str(release["version"]) == str(alias)
    order = " then ".join(f"{a['from']}->{a['to']}" for a in trail[2:])
    ledger.record("concurrency", "a promotion racing factory rollback", ok,
                  detail=f"promote: {results[0].get('decision')}; alias moves after the race: {order}; "
                         f"champion v{alias}, audit chain consistent")  # fmt: skip
    assert ok, (results, alias, trail, release)
