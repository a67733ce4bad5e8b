"""The pipeline against real services: an `mlflow server` and a `prefect server` on 127.0.0.1.

`factory run` with `MLFLOW_TRACKING_URI` / `PREFECT_API_URL` pointing at them (what a team's setup
looks like), checked through the servers' own APIs: the pipeline run and its lineage, the registered
version, the champion alias and the audit record in MLflow; the flow run in Prefect. Then the pipeline
is deployed on a cron schedule (`factory deploy`), triggered once, and the triggered run completes.
Servers: tests/flows/conftest.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.flows.pipeline_project import clean_env, factory, make_project, tiny_args

# Full tier (docs/TESTING.md): a whole run against served MLflow + Prefect (~90-140 s). The default tier
# starts the same real servers in tests/team (basic-auth MLflow, Prefect) and tests/flows/test_deploy.py.
pytestmark = [pytest.mark.slow, pytest.mark.full]
CRON = "0 3 * * *"


def _api(url: str, body: dict | None = None, method: str | None = None) -> object:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url,
        data=data,
        method=method or ("POST" if data else "GET"),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def test_pipeline_against_real_mlflow_and_prefect_servers(
    tmp_path_factory, mlflow_server, prefect_server
) -> None:
    from mlflow.tracking import MlflowClient

    from pfactory.promote.registry import audit_trail

    project = make_project(tmp_path_factory.mktemp("served-project"))
    env = {"MLFLOW_TRACKING_URI": mlflow_server.url, "PREFECT_API_URL": prefect_server.url}
    # The first model of a registry is promoted when it passes the absolute gates; a 1-epoch model on
    # 12 frames has mAP ~0, so the mAP floor is lowered for it (every other gate as shipped).
    args = [*tiny_args(), "-S", "promote.min_map=0.0", "-S", "promote.model_name=served-detector"]
    r = factory(project, "run", *args, "--name", "served", "--json", env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout[r.stdout.index("{") :])
    assert result["promotion"]["decision"] == "promoted", result["promotion"]
    version = result["promotion"]["version"]

    # MLflow, through the server's API.
    client = MlflowClient(tracking_uri=mlflow_server.url)
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.tags["pipeline"] == "true" and run.data.tags["mlflow.runName"] == "served"
    assert "eval/mAP" in run.data.metrics and "time/train_s" in run.data.metrics
    assert run.data.tags["promotion.decision"] == "promoted"
    mv = client.get_model_version("served-detector", str(version))
    assert mv.run_id == result["mlflow_run_id"]  # the version points at the pipeline run
    assert client.get_model_version_by_alias("served-detector", "champion").version == str(version)
    model = client.get_registered_model("served-detector")
    audits = audit_trail(client, "served-detector")  # the readable audit tags, parsed back
    assert any(a.get("to") == version and a.get("action") == "promote" for a in audits), model.tags
    assert all(not v.startswith("{") for k, v in model.tags.items() if k.startswith("audit.")), model.tags
    # The release folder of the run's workspace carries the same audit record and a model card.
    release = Path(result["workspace"]) / "artifacts" / "release"
    assert (release / "MODEL_CARD.md").is_file()
    assert json.loads((release / "audit.jsonl").read_text().splitlines()[-1])["to"] == version

    # Prefect, through the server's API: the flow run under the run's name, completed.
    runs = _api(f"{prefect_server.url}/flow_runs/filter", {"flow_runs": {"name": {"any_": ["served"]}}})
    assert [fr["state_type"] for fr in runs] == ["COMPLETED"], runs

    # A cron deployment of the pipeline, served from this project, triggered once.
    cmd = [sys.executable, "-m", "factory.cli", "deploy", "--name", "served-nightly", "--cron", CRON, *args]
    log = project / "serve.log"
    with open(log, "wb") as f:
        serve = subprocess.Popen(
            cmd,
            cwd=project,
            env={**clean_env(project), **prefect_server.env, **env},
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        dep = None
        deadline = time.monotonic() + 120
        while dep is None:
            try:
                dep = _api(f"{prefect_server.url}/deployments/name/perception-factory/served-nightly")
            except urllib.error.HTTPError:
                assert serve.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "deployment never appeared:\n" + log.read_text()[-3000:]
                time.sleep(1)
        assert [s["schedule"]["cron"] for s in dep["schedules"]] == [CRON]
        fr = _api(
            f"{prefect_server.url}/deployments/{dep['id']}/create_flow_run", {"name": "served-triggered"}
        )
        deadline = time.monotonic() + 600
        while True:
            state = _api(f"{prefect_server.url}/flow_runs/{fr['id']}")["state_type"]
            if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            assert time.monotonic() < deadline, "triggered run did not finish:\n" + log.read_text()[-3000:]
            time.sleep(2)
        assert state == "COMPLETED", log.read_text()[-4000:]
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
    # The triggered run is a second pipeline run in MLflow (its stages restored from the run-cache).
    runs = client.search_runs(
        [run.info.experiment_id], filter_string="tags.pipeline = 'true'", order_by=["start_time DESC"]
    )
    assert len(runs) == 2
