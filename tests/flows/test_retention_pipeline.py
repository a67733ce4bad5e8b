"""Issue 32's retention acceptance on the real pipeline (tiny size, a git project): five `factory run`s, the
second promoted (the champion, three runs before the last), then `factory gc --keep-last 1 --yes`:

- it frees what it reported (file-system free space before/after vs the plan's figure);
- `mlflow.pyfunc.load_model("models:/pfactory-detector@champion")` still loads and predicts;
- `factory lineage` still resolves the champion, and the champion's data objects are still in the cache;
- `dvc exp apply` of the kept run works;
- a `gc --keep-last 1 --yes` started while a run is in its train stage leaves that run to finish with exit 0.

Heavy (six tiny pipelines, ~10-15 min on 2 shared cores): `@pytest.mark.full`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pfactory.storage import retention
from tests.flows.pipeline_project import clean_env, dvc, factory, make_project, tiny_args

pytestmark = [pytest.mark.full, pytest.mark.slow]

GIT = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, env={**clean_env(root), **GIT}, check=True,
                          capture_output=True, text=True).stdout  # fmt: skip


def _run(root: Path, name: str, *extra: str) -> dict:
    r = factory(root, "run", *tiny_args(), *extra, "--name", name, "--json", timeout=1500, env=GIT)
    assert r.returncode == 0, f"{name}: {r.stdout[-1500:]}\n{r.stderr[-2500:]}"
    return json.loads(r.stdout[r.stdout.index("{") :])


def test_gc_after_five_runs_keeps_the_champions_lineage_and_a_training_run(tmp_path: Path) -> None:
    import mlflow

    root = make_project(tmp_path / "p")
    (root / ".dvc" / "config").write_text("[core]\n    analytics = false\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "baseline")
    results = []
    for i in range(5):
        # run 2 (index 1) is promoted: no champion before it (min_map 0 for a tiny model); the others are
        # refused by an unreachable min_map, so the champion stays the one of three runs before the last.
        gate = "promote.min_map=0" if i == 1 else "promote.min_map=0.99"
        results.append(_run(root, f"r{i}", "-S", f"train.lr={0.002 + 0.001 * i}", "-S", gate))
    assert results[1]["promotion"]["decision"] == "promoted"
    champion_ws = Path(results[1]["workspace"])

    # The champion's lineage as its pipeline run records it (`data.<out>.md5`), and which of those objects the
    # cache holds before gc (a `cache: false` output, promotion.json, is named but never in the cache).
    mlflow.set_tracking_uri(f"sqlite:///{root / 'artifacts' / 'mlflow' / 'mlflow.db'}")
    cache = retention.read_config(root)
    tags = mlflow.MlflowClient().get_run(results[1]["mlflow_run_id"]).data.tags
    lineage = {k[5:-4]: v for k, v in tags.items() if k.startswith("data.") and k.endswith(".md5")}
    cached = {h for h in retention.expand(cache, lineage.values()) if retention.object_path(cache, h).is_file()}
    for out in ("artifacts/prepared", "artifacts/model/model.pt", "artifacts/optimized"):
        assert lineage.get(out) in cached, f"the champion's {out} is not in the cache before gc: {lineage}"

    env = {**GIT, "PFACTORY_GC_GRACE_S": "0"}
    dry = factory(root, "gc", "--keep-last", "1", "--json", env=env)
    assert dry.returncode == 0, dry.stderr[-2000:]
    planned = json.loads(dry.stdout)
    assert planned["plan"]["runs_kept"] == [Path(results[4]["workspace"]).name]
    assert any(row["what"] == "model" and "@champion" in row["name"] for row in planned["table"])
    free0 = shutil.disk_usage(root).free
    done = factory(root, "gc", "--keep-last", "1", "--yes", "--json", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    freed = shutil.disk_usage(root).free - free0
    removed = json.loads(done.stdout)["removed"]
    assert len(removed["runs"]) == 4 and not champion_ws.exists()
    frees = planned["plan"]["frees_bytes"]
    assert freed >= 0.9 * frees, f"reported {frees} B, freed {freed} B"

    # The champion: loads and predicts from MLflow's store; its lineage resolves; its data is still cached.
    model = mlflow.pyfunc.load_model("models:/pfactory-detector@champion")
    from pfactory.optimize.calibration import load_feeds

    feed = load_feeds(root / "artifacts" / "prepared", "val", batch_size=1, max_frames=1, num_threads=1).feeds[0]
    assert set(model.predict(feed)) == {"boxes", "scores", "labels"}
    lin = factory(root, "lineage", "--json")
    assert lin.returncode == 0, lin.stderr[-2000:]
    data = json.loads(lin.stdout)["data"]
    gone = sorted(h for h in cached if not retention.object_path(cache, h).is_file())
    assert not gone, f"gc removed {len(gone)} of the champion's {len(cached)} cached objects: {gone[:5]}"
    assert data, "lineage names the champion's data"

    # The kept run as DVC sees it.
    kept = results[4]["experiment"]["name"]
    r = dvc(root, "exp", "apply", kept, env=GIT)
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]

    # A gc while a run trains: the run ends with exit 0.
    proc = subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "run", *tiny_args(), "-S", "train.epochs=3", "-S", "train.lr=0.009",
         "-S", "promote.min_map=0.99", "--name", "during", "--json"],
        cwd=root, env={**clean_env(root), **GIT}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 900
    training = False
    while time.monotonic() < deadline and proc.poll() is None and not training:
        for prog in (root / "artifacts" / "runs").glob("*during*/logs/progress.jsonl"):
            training = '"stage": "train"' in prog.read_text()
        time.sleep(1)
    assert training, "the run never reached train"
    during_gc = factory(root, "gc", "--keep-last", "1", "--yes", "--json", env=env)
    assert during_gc.returncode == 0, during_gc.stderr[-2000:]
    _out, err = proc.communicate(timeout=1500)
    assert proc.returncode == 0, err[-3000:]
    rows = json.loads(during_gc.stdout)["table"]
    assert any(r["what"] == "run" and "during" in r["name"] and "in progress" in r["why"] for r in rows), rows
