"""Real MLflow and Prefect servers on 127.0.0.1 that a fault test can kill and bring back on the same port
with the same state (`Server.restart`). Built on tests/flows/conftest.py's start/stop helpers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.flows.conftest import Server, _clean_env, _executable, _start, _stop, free_port


@dataclass
class Restartable:
    name: str
    cmd: list[str]
    env: dict[str, str]
    health: str
    url: str
    log: Path
    server: Server | None = None
    client_env: dict[str, str] | None = None

    @property
    def proc(self):
        assert self.server is not None
        return self.server.proc

    def start(self) -> None:
        self.server = _start(self.name, self.cmd, self.env, self.health, self.url, self.log)

    def restart(self) -> None:
        if self.server is not None:
            _stop(self.server)
        self.start()

    def stop(self) -> None:
        if self.server is not None:
            _stop(self.server)


@contextlib.contextmanager
def mlflow_server(state: Path) -> Iterator[Restartable]:
    state.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [_executable("mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{state / 'mlflow.db'}",
           "--default-artifact-root", (state / "artifacts").as_uri(), "--workers", "1"]  # fmt: skip
    env = _clean_env(MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="1", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    s = Restartable("mlflow", cmd, env, f"{url}/health", url, state / "server.log")
    s.start()
    try:
        yield s
    finally:
        s.stop()


@contextlib.contextmanager
def prefect_server(state: Path) -> Iterator[Restartable]:
    state.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = _clean_env(PREFECT_HOME=str(state), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                     PREFECT_SERVER_UI_ENABLED="false", DO_NOT_TRACK="1")  # fmt: skip
    cmd = [_executable("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    s = Restartable("prefect", cmd, env, f"{api}/health", api, state / "server.log")
    s.start()
    s.client_env = {"PREFECT_API_URL": api}  # what a client run needs (its PREFECT_HOME stays in-project)
    try:
        yield s
    finally:
        s.stop()
