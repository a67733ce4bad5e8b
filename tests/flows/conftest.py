"""Real servers for the flow tests: a Prefect server and an MLflow tracking server on 127.0.0.1.

Both are module-scoped (started on first use, stopped when the module ends: an idle server still costs CPU), each with
its own state in a tmp dir, on a free port. `server.env` is the environment a subprocess
needs to talk to it (e.g. a served flow, `factory run`). Measured on the 2-core dev box:
Prefect healthy in ~4-10 s, MLflow (1 worker) in ~12 s.

Usage: `def test_x(prefect_server): ... prefect_server.api_url` / `mlflow_server.uri`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.local_services import as_admin, free_port

START_TIMEOUT_S = 90.0  # generous: 4 engineers share 2 cores; a healthy start is 4-12 s


def _executable(name: str) -> str:
    """The console script `name` of this interpreter's environment (the venv's, not PATH's)."""
    exe = Path(sys.executable).parent / name
    return str(exe) if exe.is_file() else name


def _clean_env(**extra: str) -> dict[str, str]:
    """os.environ without client-side server addresses, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env.update(extra)
    return env


@dataclass
class Server:
    """A started server: its process, base URL, log file and the env a client subprocess needs."""

    name: str
    proc: subprocess.Popen
    url: str  # the address clients use (Prefect: the /api URL; MLflow: the tracking URI)
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    start_s: float = 0.0

    def log_tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-n:])


def _start(name: str, cmd: list[str], env: dict[str, str], health: str, url: str, log: Path) -> Server:
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(name, proc, url, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{name} server exited with code {proc.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(health, timeout=2) as r:
                if r.status == 200:
                    server.start_s = time.perf_counter() - t0
                    return server
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    _stop(server)
    pytest.fail(f"{name} server not healthy at {health} after {START_TIMEOUT_S:.0f} s:\n{server.log_tail()}")


def _stop(server: Server) -> None:
    """SIGTERM the server's process group (uvicorn/gunicorn workers too), SIGKILL after 15 s."""
    if server.proc.poll() is not None:
        return
    pgid = os.getpgid(server.proc.pid)
    os.killpg(pgid, 15)
    try:
        server.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(pgid, 9)
        server.proc.wait(timeout=5)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory) -> Iterator[Server]:
    """`prefect server start` on 127.0.0.1:<free port>, state in a tmp PREFECT_HOME.

    `.url` is the API URL (`http://127.0.0.1:<port>/api`); `.env` has PREFECT_API_URL and
    PREFECT_HOME set for client subprocesses (runner polling every second, for fast tests).
    """
    home = tmp_path_factory.mktemp("prefect_home")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = _clean_env(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_UI_ENABLED="false",  # the UI's static build is not needed by tests
        DO_NOT_TRACK="1",
    )
    cmd = [_executable("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    server = _start("prefect", cmd, env, f"{api}/health", api, home / "server.log")
    server.env = env | {"PREFECT_API_URL": api, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    try:
        yield server
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[Server]:
    """`mlflow server` (sqlite backend, local artifact root, 1 worker) on 127.0.0.1:<free port>.

    `.url` is the tracking URI (`http://127.0.0.1:<port>`); `.env` has MLFLOW_TRACKING_URI.
    """
    d = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    # no job runner: 7 huey consumer processes the tests never use (pfactory/team/services.py says more)
    env = _clean_env(MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="1", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    cmd = [
        _executable("mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{d / 'mlflow.db'}",
        "--default-artifact-root",
        (d / "artifacts").as_uri(),
        "--workers",
        "1",
    ]
    server = _start("mlflow", cmd, env, f"{uri}/health", uri, d / "server.log")
    server.env = env | {"MLFLOW_TRACKING_URI": uri}
    try:
        yield server
    finally:
        _stop(server)


@dataclass
class TeamServers:
    """A team started by `pfactory.team.services.up` (what `factory team up` runs): MLflow with basic auth and
    Prefect with an auth string; `env(user)` is what that user exports (URLs, auth string, their MLflow
    password)."""

    state: object
    passwords: dict[str, str]

    def env(self, user: str) -> dict[str, str]:
        from pfactory.team.services import client_env

        return {**client_env(self.state), "PFACTORY_TRAIN_SLOT_LIMIT": self.state.slot_limit,
                "MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": self.passwords[user]}  # fmt: skip


@pytest.fixture(scope="module")
def team_servers(tmp_path_factory) -> Iterator[TeamServers]:
    """`factory team up` in a tmp DIR on free 127.0.0.1 ports (1 training slot) with one engineer, alice;
    `factory team down` at the end of the module. ~15 s on a quiet 2-core box, over a minute under load."""
    from pfactory.team.services import down, up
    from pfactory.team.users import add_user

    d = tmp_path_factory.mktemp("team")
    state = up(d, "127.0.0.1", free_port(), free_port(), train_slots=1, slot_limit="pfactory-train-workers")
    passwords = {"alice": "alice-pw-0123456789"}
    with as_admin(state):
        add_user(state.mlflow_url, "alice", "engineer", passwords["alice"])
    try:
        yield TeamServers(state, passwords)
    finally:
        down(d)
