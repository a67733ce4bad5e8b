"""Scheduled runs (`factory deploy`, `flows.deploy`, `prefect.yaml`) against a real Prefect server.

The served flow is `tests/flows/tiny_flow.py:tiny_pipeline` (the pipeline's parameters, none
of its minutes of work), deployed by `factory deploy --flow ...` through the same `flows.deploy`
code path the pipeline takes (tests/flows/test_servers.py serves the real pipeline, full tier).
`prefect.yaml` is deployed for real with `prefect deploy --all`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from factory.cli import app
from flows.deploy import DeployError, load_flow, make_spec, validate_cron

ROOT = Path(__file__).resolve().parents[2]
TINY = "tests/flows/tiny_flow.py:tiny_pipeline"
CRON = "0 3 * * *"


def _read_deployment(api_url: str, full_name: str, proc: subprocess.Popen | None = None, wait_s: float = 90):
    """The deployment `flow/name` from the server, waiting for it to appear (while `proc` lives)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + wait_s
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        while True:
            try:
                return client.read_deployment_by_name(full_name)
            except ObjectNotFound:
                if proc is not None and proc.poll() is not None:
                    pytest.fail(f"the serving process exited with {proc.returncode} before deploying")
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def test_served_deployment_keeps_its_cron_and_completes_a_triggered_run(prefect_server, tmp_path):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    log = tmp_path / "serve.log"
    params = {"overrides": ["train.lr=0.1"]}
    cmd = [sys.executable, "-m", "factory.cli", "deploy", "--flow", TINY, "--name", "test-nightly"]
    cmd += ["--cron", CRON, "--timezone", "Europe/Berlin", "--parameters", json.dumps(params)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=prefect_server.env, stdout=f, stderr=subprocess.STDOUT)
    try:
        dep = _read_deployment(prefect_server.url, "tiny-pipeline/test-nightly", proc)
        assert len(dep.schedules) == 1
        sched = dep.schedules[0]
        assert sched.schedule.cron == CRON and sched.schedule.timezone == "Europe/Berlin"
        assert sched.active
        assert dep.parameters == params
        assert dep.entrypoint == TINY

        t0 = time.perf_counter()
        with temporary_settings({PREFECT_API_URL: prefect_server.url}):
            run = run_deployment(
                "tiny-pipeline/test-nightly", parameters={"root": str(tmp_path)}, timeout=180, poll_interval=1
            )
        assert run.state is not None and run.state.is_completed(), (run.state, log.read_text()[-3000:])
        ran = json.loads((tmp_path / "ran.json").read_text())
        assert ran["overrides"] == params["overrides"]  # the deployment's default reached the run
        assert ran["pid"] != proc.pid  # executed by the served process's runner, in a subprocess
        print(
            f"trigger -> Completed: {time.perf_counter() - t0:.1f} s; server start {prefect_server.start_s:.1f} s"
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # serve pauses the schedule on shutdown, so runs do not pile up while nothing serves them
    assert _read_deployment(prefect_server.url, "tiny-pipeline/test-nightly").paused


def test_prefect_yaml_deploys_with_prefect_deploy_all(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (dep_cfg,) = spec["deployments"]
    flow = load_flow(dep_cfg["entrypoint"])  # the entrypoint imports and is a flow
    make_spec(
        flow, name=dep_cfg["name"], cron=dep_cfg["schedules"][0]["cron"], parameters=dep_cfg["parameters"]
    )

    pool = dep_cfg["work_pool"]["name"]
    with temporary_settings({PREFECT_API_URL: prefect_server.url}), get_client(sync_client=True) as client:
        client.create_work_pool(
            WorkPoolCreate(
                name=pool, type="process", base_job_template=ProcessWorker.get_default_base_job_template()
            )
        )
    res = subprocess.run(
        [str(Path(sys.executable).parent / "prefect"), "--no-prompt", "deploy", "--all"],
        cwd=ROOT,
        env=prefect_server.env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    dep = _read_deployment(prefect_server.url, f"{flow.name}/{dep_cfg['name']}", wait_s=5)
    assert dep.entrypoint == "flows/pipeline.py:pipeline"
    assert [s.schedule.cron for s in dep.schedules] == [CRON]
    assert dep.work_pool_name == pool
    assert dep.parameters == {"overrides": []}
    assert dep.pull_steps == spec["pull"]  # resolved on the worker at run time, not at deploy time


@pytest.mark.parametrize(
    "cron, problem",
    [
        ("0 3 * *", "has 4 fields"),
        ("* * * * * *", "has 6 fields"),
        ("61 3 * * *", "out of range"),
        ("H 3 * * *", "random/hashed"),
        ("@sometimes", "not a known cron alias"),
        ("", "has 0 fields"),
    ],
)
def test_bad_cron_is_refused_naming_the_field(cron, problem):
    with pytest.raises(DeployError, match=rf"^cron: .*{problem}"):
        validate_cron(cron)


@pytest.mark.parametrize("cron", ["0 3 * * *", "*/15 * * * *", "0 3 * * MON-FRI", "@daily"])
def test_good_cron_passes(cron):
    assert validate_cron(f" {cron} ") == cron


def test_spec_refuses_unknown_parameters_and_bad_names():
    flow = load_flow(TINY)
    with pytest.raises(DeployError, match="parameters: epochs not a parameter of flow 'tiny-pipeline'"):
        make_spec(flow, cron=CRON, parameters={"epochs": 3})
    with pytest.raises(DeployError, match="name: 'a/b'"):
        make_spec(flow, name="a/b", cron=CRON)
    with pytest.raises(DeployError, match="timezone: 'Mars/Olympus'"):
        make_spec(flow, cron=CRON, timezone="Mars/Olympus")
    with pytest.raises(DeployError, match="flow: cannot load"):
        load_flow("tests/flows/no_such_file.py:f")


def test_cli_deploy_print_only_validates_and_prints(monkeypatch):
    monkeypatch.chdir(ROOT)
    runner = CliRunner()
    res = runner.invoke(app, ["deploy", "--cron", CRON, "-S", "train.lr=0.01", "--print-only"])
    assert res.exit_code == 0, res.output
    spec = json.loads(res.stdout)
    assert spec["full_name"] == "perception-factory/nightly"
    assert spec["parameters"] == {"overrides": ["train.lr=0.01"]}
    assert spec["entrypoint"] == "flows/pipeline.py:pipeline"

    res = runner.invoke(app, ["deploy", "--cron", "61 3 * * *", "--print-only"])
    assert res.exit_code == 2 and "cron: '61 3 * * *'" in res.output
    res = runner.invoke(app, ["deploy", "--cron", CRON, "-S", "train.no_such_key=1", "--print-only"])
    assert res.exit_code == 2 and "train.no_such_key" in res.output


def test_cli_deploy_any_flow_takes_parameters_as_json(monkeypatch):
    monkeypatch.chdir(ROOT)
    runner = CliRunner()
    params = {"overrides": ["a=1"], "name": "x"}  # the tiny flow's own `overrides`, not params.yaml's
    res = runner.invoke(
        app, ["deploy", "--cron", CRON, "--flow", TINY, "--parameters", json.dumps(params), "--print-only"]
    )
    assert res.exit_code == 0, res.output
    spec = json.loads(res.stdout)
    assert spec["full_name"] == "tiny-pipeline/nightly"
    assert spec["parameters"] == params and spec["entrypoint"] == TINY

    # The pipeline takes --parameters for its other parameters; its overrides stay -S.
    res = runner.invoke(
        app,
        ["deploy", "--cron", CRON, "-S", "train.lr=0.01", "--parameters", '{"checkout": false}', "--print-only"],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["parameters"] == {"overrides": ["train.lr=0.01"], "checkout": False}
    # ... however it is addressed (a module path is the pipeline too).
    res = runner.invoke(
        app, ["deploy", "--cron", CRON, "--flow", "flows.pipeline:pipeline", "-S", "train.lr=0.01", "--print-only"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["parameters"] == {"overrides": ["train.lr=0.01"]}


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--flow", TINY, "-S", "train.lr=0.01"], "-S/--set-param: only for the pipeline"),
        (["--parameters", '{"overrides": ["train.lr=0.01"]}'], "parameters: the pipeline's overrides are given with -S"),
        (["--flow", TINY, "--parameters", "{name: 1}"], "parameters: not valid JSON"),
        (["--flow", TINY, "--parameters", '["a=1"]'], "parameters: expected a JSON object"),
        (["--flow", TINY, "--parameters", '{"epochs": 3}'], "parameters: epochs not a parameter of flow"),
        (["--flow", "tests/flows/no_such_file.py:f"], "flow: cannot load"),
    ],
)
def test_cli_deploy_refuses_options_that_make_no_sense_in_one_line(monkeypatch, args, problem):
    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(app, ["deploy", "--cron", CRON, *args, "--print-only"])
    assert res.exit_code == 2, res.output
    assert res.output.startswith(problem) and res.output.count("\n") == 1, res.output


def test_cli_deploy_without_a_server_says_how_to_start_one(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    res = CliRunner().invoke(app, ["deploy", "--cron", CRON])
    assert res.exit_code == 2
    assert "PREFECT_API_URL is not set" in res.output and "prefect server start" in res.output


@pytest.mark.full  # the fixture of tests/flows/test_servers.py (full tier); no product code in it
def test_mlflow_server_fixture_answers(mlflow_server):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.url)
    exp_id = client.create_experiment("fixture-check")
    run = client.create_run(exp_id, run_name="r")
    client.log_metric(run.info.run_id, "eval/mAP", 0.5)
    assert client.get_run(run.info.run_id).data.metrics == {"eval/mAP": 0.5}
    print(f"mlflow server start {mlflow_server.start_s:.1f} s")
