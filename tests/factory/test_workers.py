"""Workers on other hosts (`factory worker start`, factory/worker.py; `factory deploy --pool`, flows/deploy.py).

The full-tier test plays two hosts on 127.0.0.1 that share nothing but the servers: a team (`factory team up`:
MLflow with basic auth, Prefect with an auth string), a bare git remote, a moto S3 server (the DVC remote).
Alice's checkout (a copy of the project, committed and pushed to the bare remote, its `.dvc/config` naming the
S3 remote) deploys the pipeline to a work pool with `factory deploy --pool --cron "* * * * *" --run-now`; two
`factory worker start` processes, each in its own fresh directory (no checkout), poll the pool. Both the
triggered run and the first cron run must complete on a worker: cloned at the deployment's commit (the MLflow
parent run's `git.commit`), in that worker's directory (its `workspace` tag; the worker's log names the run),
logged to the team's MLflow as alice, the outputs pushed to the S3 remote. The triggered run comes first (no
schedule yet); its worker is then stopped and the same deployment given an every-minute cron schedule, so the
scheduled run has to land on the other worker: both directories run a flow.

What runs on the workers is the real pipeline flow limited to its first stage (`stages=["synth"]`, tiny
params): git_clone, the project's imports, the run workspace, DVC (`repro --pull`, `push --run-cache`), MLflow.
prepare/train/optimize/evaluate/promote are not run on a worker here (minutes each on this 2-core box).

The fast tests check the one-line refusals: a worker directory inside a checkout, a directory others can open,
a missing server variable, a dirty tree, a commit the remote does not have, a URL with a password.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from factory.cli import app
from factory.worker import WorkerError, prepare_dir, worker_env
from flows.deploy import DeployError, git_source
from tests.flows.conftest import team_servers  # noqa: F401 - the team's servers fixture (module scope)
from tests.flows.pipeline_project import clean_env, factory, make_project, tiny_args
from tests.prepare.test_storage import BUCKET, s3  # noqa: F401 - the moto S3 server fixture (module scope)

ROOT = Path(__file__).resolve().parents[2]
POOL = "pf-workers-test"
REMOTE_PREFIX = "workers-dvc"
RUN_TIMEOUT_S = 900  # a tiny pipeline run on a loaded 2-core box, plus worker polling


def _git(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"git {' '.join(args)}: {out.stderr}"
    return out.stdout.strip()


def _repo_with_remote(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny git repo with one commit pushed to a bare remote `origin`."""
    bare = tmp_path / "remote.git"
    _git(tmp_path, "init", "--bare", "--quiet", str(bare))
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "--quiet", "-b", "main")
    (repo / "flows").mkdir()
    (repo / "flows" / "a.py").write_text("x = 1\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "--quiet", "-m", "one")
    _git(repo, "remote", "add", "origin", str(bare))
    _git(repo, "push", "--quiet", "origin", "main")
    return repo, bare


# ---------------------------------------------------------------------------------------------- fast checks


def test_git_source_is_head_on_the_remote(tmp_path):
    repo, bare = _repo_with_remote(tmp_path)
    src = git_source(repo)
    assert src.commit == _git(repo, "rev-parse", "HEAD") and src.url == str(bare) and src.remote == "origin"


@pytest.mark.parametrize(
    "spoil, problem",
    [
        (lambda r: (r / "flows" / "a.py").write_text("x = 2\n"), r"^--pool: the working tree has uncommitted changes"),
        (lambda r: (r / "flows" / "new.py").write_text(""), r"^--pool: the working tree has uncommitted changes"),
        (lambda r: (_git(r, "commit", "--quiet", "--allow-empty", "-m", "two")), r"^--git-remote origin: commit \w+ is not on it"),
        (lambda r: _git(r, "remote", "set-url", "origin", "https://me:s3cret@example.com/x.git"), r"^--git-remote origin: its URL carries a password"),
        (lambda r: _git(r, "remote", "remove", "origin"), r"^--git-remote origin: no such git remote"),
    ],
)  # fmt: skip
def test_git_source_refuses_in_one_line_naming_the_remote(tmp_path, spoil, problem):
    repo, _ = _repo_with_remote(tmp_path)
    spoil(repo)
    with pytest.raises(DeployError, match=problem) as e:
        git_source(repo)
    assert "\n" not in str(e.value) and "s3cret" not in str(e.value)


def test_worker_dir_inside_a_checkout_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # never reached: refused before
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    res = CliRunner().invoke(app, ["worker", "start", "--pool", "p", "--dir", str(ROOT / "artifacts" / "w")])
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"--dir {ROOT / 'artifacts' / 'w'}: inside the git checkout {ROOT}")
    assert res.output.count("\n") == 1 and not (ROOT / "artifacts" / "w").exists()


def test_worker_dir_is_made_owner_only_and_an_open_one_refused(tmp_path):
    d = prepare_dir(tmp_path / "hosts" / "w")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and (d / "tmp").is_dir()
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(WorkerError, match=r"--dir .*open: mode 755; expected owner-only"):
        prepare_dir(open_dir)


def test_worker_env_needs_the_servers_and_keeps_secrets_off_argv(tmp_path):
    with pytest.raises(WorkerError, match=r"^PREFECT_API_URL is not set"):
        worker_env({"MLFLOW_TRACKING_URI": "http://x"}, tmp_path)
    with pytest.raises(WorkerError, match=r"^MLFLOW_TRACKING_URI is not set"):
        worker_env({"PREFECT_API_URL": "http://x/api"}, tmp_path)
    env = worker_env(
        {"PREFECT_API_URL": "http://x/api", "MLFLOW_TRACKING_URI": "http://x", "PFACTORY_ROOT": "/repo",
         "MLFLOW_TRACKING_PASSWORD": "pw", "PATH": "/usr/bin"}, tmp_path)  # fmt: skip
    assert env["TMPDIR"] == str(tmp_path / "tmp") and "PFACTORY_ROOT" not in env
    assert env["MLFLOW_TRACKING_PASSWORD"] == "pw"  # passed on in the environment...
    from factory.worker import worker_command

    assert "pw" not in " ".join(worker_command("p", "process", "n"))  # ...never on argv


def test_run_now_needs_a_pool(monkeypatch):
    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(app, ["deploy", "--cron", "0 3 * * *", "--run-now"])
    assert res.exit_code == 2 and res.output.startswith("--run-now: only with --pool"), res.output


# ---------------------------------------------------------------------------------------------- two hosts


def _alice_checkout(tmp_path: Path, endpoint: str) -> tuple[Path, Path, str]:
    """Alice's checkout: the project (code, dvc.yaml, params.yaml), its DVC remote the S3 bucket, one commit
    pushed to a bare remote `origin`. Returns (checkout, bare remote, commit)."""
    bare = tmp_path / "remote" / "perception-factory.git"
    bare.parent.mkdir()
    _git(bare.parent, "init", "--bare", "--quiet", str(bare))
    project = make_project(tmp_path / "alice", first_start=True)
    (project / ".dvc" / "config").write_text(
        "[core]\n    analytics = false\n    remote = team\n"
        f"['remote \"team\"']\n    url = s3://{BUCKET}/{REMOTE_PREFIX}\n    endpointurl = {endpoint}\n"
    )
    (project / ".dvc" / ".gitignore").write_text("/config.local\n/tmp\n/cache\n")
    _git(project, "init", "--quiet", "-b", "main")
    _git(project, "add", ".")
    _git(project, "commit", "--quiet", "-m", "the project")
    _git(project, "remote", "add", "origin", str(bare))
    _git(project, "push", "--quiet", "-u", "origin", "main")
    return project, bare, _git(project, "rev-parse", "HEAD")


def _start_worker(name: str, d: Path, env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
    factory_exe = Path(sys.executable).parent / "factory"
    cmd = [str(factory_exe), "worker", "start", "--pool", POOL, "--dir", str(d), "--name", name]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _uncached_outs() -> set[str]:
    """The outputs dvc.yaml declares `cache: false` (metrics, a plot, promotion.json: they travel in the
    experiment's git commit, not through the DVC cache or its remote), as paths."""
    import re

    import yaml

    root = Path(__file__).resolve().parents[2]
    paths = yaml.safe_load((root / "params.yaml").read_text())["paths"]
    out = set()
    for stage in yaml.safe_load((root / "dvc.yaml").read_text())["stages"].values():
        for o in [o for kind in ("outs", "metrics", "plots") for o in stage.get(kind, [])]:
            if isinstance(o, dict) and next(iter(o.values())).get("cache") is False:
                out.add(re.sub(r"\$\{paths\.(\w+)\}", lambda m: str(paths[m.group(1)]), next(iter(o))))
    return out


@pytest.mark.full
def test_two_workers_without_a_checkout_run_a_triggered_and_a_cron_run(team_servers, s3, tmp_path):  # noqa: F811
    import fsspec
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from pfactory.tracking.runs import experiment_ids

    alice = team_servers.env("alice")
    project, bare, commit = _alice_checkout(tmp_path, s3)
    hosts = {name: tmp_path / "hosts" / name / "worker" for name in ("host-a", "host-b")}
    for d in hosts.values():
        d.parent.mkdir(parents=True)
        assert not d.exists()  # no checkout there before, nor anything else
    worker_env_ = {**clean_env(tmp_path), **alice, "PREFECT_WORKER_QUERY_SECONDS": "2",
                   "PREFECT_LOGGING_LEVEL": "INFO"}  # fmt: skip  (AWS_* of the moto server: from clean_env)
    workers = {
        name: _start_worker(name, d, worker_env_, tmp_path / f"{name}.log", d.parent) for name, d in hosts.items()
    }
    settings = {PREFECT_API_URL: alice["PREFECT_API_URL"], PREFECT_API_AUTH_STRING: alice["PREFECT_API_AUTH_STRING"]}
    try:
        with temporary_settings(settings), get_client(sync_client=True) as client:
            deadline = time.monotonic() + 180
            while True:  # both workers polling the pool (`factory worker start` created it)
                for name, p in workers.items():
                    assert p.poll() is None, f"{name} exited {p.returncode}: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
                try:
                    online = {w.name for w in client.read_workers_for_work_pool(POOL)}
                except Exception:
                    online = set()
                if set(hosts) <= online:
                    break
                assert time.monotonic() < deadline, f"workers not online: {online}"
                time.sleep(1)
            for d in hosts.values():
                assert stat.S_IMODE(d.stat().st_mode) == 0o700 and not list(d.rglob(".git"))

            def deploy(*args: str) -> dict:
                res = factory(
                    project, "deploy", "--pool", POOL, "--name", "on-workers", *args, *tiny_args(),
                    "--parameters", json.dumps({"checkout": False}), env=alice, timeout=600,
                )  # fmt: skip
                assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
                return json.loads(res.stdout[res.stdout.index("{") :])

            def wait(run_id: str) -> None:
                deadline = time.monotonic() + RUN_TIMEOUT_S
                while not client.read_flow_run(run_id).state.is_final():
                    assert time.monotonic() < deadline, client.read_flow_run(run_id).state
                    time.sleep(2)

            # 1. A person triggers a run: `factory deploy --pool ... --run-now` (no schedule yet).
            t_trigger = time.time()
            out = deploy("--run-now")
            assert out["commit"] == commit and out["remote"] == str(bare) and out["pool"] == POOL
            assert out["pull_steps"] == [
                {"prefect.deployments.steps.git_clone": {"repository": str(bare), "branch": None, "commit_sha": commit}}
            ]
            dep = client.read_deployment(out["deployment_id"])
            assert dep.pull_steps == out["pull_steps"] and dep.work_pool_name == POOL and not dep.schedules
            triggered_id = out["flow_run_id"]
            assert "pfactory.triggered-by:alice" in client.read_flow_run(triggered_id).tags
            wait(triggered_id)
            # Stop the worker that ran it: the scheduled run must then go to the other one (both directories run a
            # flow, deterministically).
            name = client.read_flow_run(triggered_id).name
            stopped = [n for n in hosts if f"Flow run '{name}' submitted to infrastructure"
                       in (tmp_path / f"{n}.log").read_text(errors="replace")]  # fmt: skip
            assert len(stopped) == 1, stopped
            _stop(workers[stopped[0]])

            # 2. The same deployment on a cron schedule (every minute): its first run, then the schedule paused.
            assert deploy("--cron", "* * * * *")["deployment_id"] == str(dep.id)
            cron_id = None
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while cron_id is None:
                flow_runs = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])),
                    flow_run_filter=FlowRunFilter(),
                )
                taken = [r for r in flow_runs if r.auto_scheduled and r.state and
                         r.state.type.value in ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CRASHED")]  # fmt: skip
                if taken:
                    cron_id = str(min(taken, key=lambda r: r.expected_start_time).id)
                    client.pause_deployment(dep.id)  # no more cron runs: this one is enough
                    for r in flow_runs:
                        if r.state and r.state.is_scheduled():
                            with contextlib.suppress(ObjectNotFound):  # pausing may have removed it
                                client.delete_flow_run(r.id)
                    break
                for n, p in workers.items():
                    assert n in stopped or p.poll() is None, f"{n} exited {p.returncode}"
                assert time.monotonic() < deadline, [(r.state_name, r.auto_scheduled) for r in flow_runs]
                time.sleep(2)
            wait(cron_id)
            final = {i: client.read_flow_run(i) for i in (triggered_id, cron_id)}
    finally:
        for p in workers.values():
            _stop(p)
    logs = {name: (tmp_path / f"{name}.log").read_text(errors="replace") for name in hosts}
    for run in final.values():
        assert run.state.is_completed(), (run.state, *(log[-4000:] for log in logs.values()))
    # Each run went to exactly one worker (two may try to claim a run: the server lets one of them have it).
    ran_on = {i: [n for n, log in logs.items() if f"Flow run '{r.name}' submitted to infrastructure" in log]
              for i, r in final.items()}  # fmt: skip
    assert all(len(v) == 1 for v in ran_on.values()), ran_on

    # The pipeline's MLflow parent runs, on the team's server, as alice: in the worker's directory, at the commit.
    os.environ.update({k: alice[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")})
    try:
        ml = MlflowClient(tracking_uri=alice["MLFLOW_TRACKING_URI"])
        parents = ml.search_runs(experiment_ids(ml), "tags.pipeline = 'true'")  # each user's own experiment
    finally:
        for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            os.environ.pop(k, None)
    assert len(parents) == 2, [p.data.tags.get("workspace") for p in parents]
    # Who triggered the run now (--run-now by alice) is on its parent run; the cron run has no trigger.
    triggers = [p.data.tags.get("pfactory.triggered_by") for p in parents]
    assert sorted(triggers, key=str) == [None, "alice"], triggers  # str(None) sorts first
    # ... and the MLflow server backs the claim: alice's record in her own experiment names this flow run.
    triggered = next(p for p in parents if p.data.tags.get("pfactory.triggered_by") == "alice")
    assert triggered.data.tags["pfactory.triggered_by.verified"].startswith("yes: record"), triggered.data.tags
    owners_all = []
    for p in parents:
        assert p.info.status == "FINISHED" and p.data.tags["git.commit"] == commit, p.data.tags
        ws = Path(p.data.tags["workspace"])
        owners = [name for name, d in hosts.items() if ws.is_relative_to(d / "tmp")]
        assert len(owners) == 1, (ws, hosts)
        owners_all.append(owners[0])
        assert p.data.tags.get("dvc.push") == "ok", p.data.tags.get("dvc.push")
        hashes = {k: v for k, v in p.data.tags.items() if k.startswith("data.") and k.endswith(".md5")}
        assert hashes, p.data.tags
        hashes = {k: v for k, v in hashes.items() if k[len("data.") : -len(".md5")] not in _uncached_outs()}
        fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3})
        for key, md5 in hashes.items():
            assert fs.exists(f"{BUCKET}/{REMOTE_PREFIX}/files/md5/{md5[:2]}/{md5[2:]}"), (key, md5)
    # The whole pipeline ran on the workers: the stage runs of both parents (synth logs none; a stage the second
    # run restored from the remote's run-cache logs none either) cover every other stage, train held a training
    # slot (the team's concurrency limit), each run decided its promotion and the candidate was registered.
    os.environ.update({k: alice[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")})
    try:
        stage_runs = [r for p in parents for r in
                      ml.search_runs([p.info.experiment_id], f"tags.`mlflow.parentRunId` = '{p.info.run_id}'")]  # fmt: skip
        by_stage = {r.data.tags.get("stage"): r for r in stage_runs}
        assert set(by_stage) == {"prepare", "train", "optimize", "evaluate", "promote"}, set(by_stage)
        assert all(r.info.status == "FINISHED" for r in stage_runs), [(r.data.tags.get("stage"), r.info.status)
                                                                        for r in stage_runs]  # fmt: skip
        train_tags = by_stage["train"].data.tags
        assert float(train_tags["pfactory.slot.acquired_at"]) <= float(train_tags["pfactory.slot.released_at"])
        assert all(p.data.tags.get("promotion.decision") for p in parents), [p.data.tags for p in parents]
        versions = ml.search_model_versions("name = 'pfactory-detector-candidates'")
        ours = {r.info.run_id for r in [*parents, *stage_runs]}
        assert {v.run_id for v in versions} & ours, [(v.version, v.run_id) for v in versions]
        for v in versions:  # the candidate of alice's run names her, as verified (the cron run's: nobody)
            by_alice = v.run_id in {triggered.info.run_id} | {r.info.run_id for r in stage_runs
                                                               if r.data.tags.get("mlflow.parentRunId") == triggered.info.run_id}  # fmt: skip
            assert v.tags.get("pfactory.triggered_by") == ("alice" if by_alice else None), (v.run_id, v.tags)
            if by_alice:
                assert v.tags["pfactory.triggered_by.verified"].startswith("yes: record"), v.tags
    finally:
        for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            os.environ.pop(k, None)
    assert sorted(owners_all) == sorted(v[0] for v in ran_on.values())  # the logs and the workspaces agree
    assert ran_on[triggered_id] == stopped and ran_on[cron_id] != stopped, (ran_on, stopped)  # both workers ran one
    for d in hosts.values():  # the per-run clones are gone: no checkout stays on a worker
        assert not list(d.rglob(".git")), list(d.rglob(".git"))

    created = {i: r.created.timestamp() for i, r in final.items()}
    starts = {i: r.start_time.timestamp() for i, r in final.items()}
    expected = final[cron_id].expected_start_time.timestamp()
    print(
        f"\ntriggered run on {ran_on[triggered_id][0]}: trigger -> start "
        f"{starts[triggered_id] - created[triggered_id]:.1f} s (deploy command from {t_trigger:.0f}: "
        f"{starts[triggered_id] - t_trigger:.1f} s), total {final[triggered_id].total_run_time.total_seconds():.1f} s"
        f"\ncron run on {ran_on[cron_id][0]}: scheduled time -> start {starts[cron_id] - expected:.1f} s, "
        f"total {final[cron_id].total_run_time.total_seconds():.1f} s; workers used: {sorted(owners_all)} (stopped after the triggered run: {stopped}); "
        f"load {Path('/proc/loadavg').read_text().strip()}"
    )
