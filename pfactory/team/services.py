"""`factory team up|down|status`: a team's MLflow (with authentication) and Prefect servers on this machine.

In:  a state folder DIR (created; it holds every byte the services write), the host, two ports, the number
     of training slots.
Out: two real servers, started the documented way, detached from the terminal (own sessions):
       mlflow server --app-name basic-auth --workers 1 --backend-store-uri sqlite:///DIR/mlflow/mlflow.db
                     --artifacts-destination DIR/mlflow/artifacts     (MLflow's auth app: users, grants)
       prefect server start                                            (PREFECT_HOME=DIR/prefect)
     and in DIR:
       team.json            what runs where: pids, urls, the slot limit (no secret in it)
       secrets/             0700; admin_password, flask_secret (0600 each): generated, never printed
       mlflow/auth.ini      0600; MLflow's auth config (MLFLOW_AUTH_CONFIG_PATH): default READ, the admin
       logs/mlflow.log, logs/prefect.log
     then, as the admin: the experiment `perception-factory` (artifacts on the server), the registered models
     `<model>` (production) and `<model>-candidates`, and the global concurrency limit of training slots.
     `env_lines` are the shell `export NAME=VALUE` lines a user runs; the admin's password line reads the
     0600 file (`$(cat ...)`), so it is never shown either.

Lease settings (docs/OPERATIONS.md, "Training slots"): the Prefect server's repossessor revokes expired
leases every `REPOSSESSOR_LOOP_S` (Prefect's default is 15 s), and a waiter is told to retry at most every
`SLOT_WAIT_S` (default 30 s); with the factory's 60 s leases a SIGKILLed holder's slot is free again within
60 + 5 + 5 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pfactory.team.errors import TeamError

STATE = "team.json"
ADMIN = "admin"
REPOSSESSOR_LOOP_S = 5  # Prefect's default 15 s: a killed holder's lease is revoked at most this late
SLOT_WAIT_S = (
    5  # the longest a waiter sleeps between tries (Prefect's default 30 s): a freed slot is taken fast
)
# A first start migrates two databases: ~12 s on a quiet 2-core box, 80 s at load 11 (measured 2026-12-03).
START_TIMEOUT_S = 600.0
EXPERIMENT = "perception-factory"
DEFAULT_MODEL = "pfactory-detector"


@dataclass
class TeamState:
    """What `factory team up` started (DIR/team.json)."""

    dir: str
    host: str
    mlflow_port: int
    prefect_port: int
    train_slots: int
    slot_limit: str
    model: str
    pids: dict[str, int] = field(default_factory=dict)
    started_at: float = 0.0

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.host}:{self.mlflow_port}"

    @property
    def prefect_url(self) -> str:
        return f"http://{self.host}:{self.prefect_port}/api"


def _write_secret(path: Path, value: str) -> None:
    """`value` into `path`, created 0600 (never world-readable, not even for an instant), atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value)
    os.replace(tmp, path)


def secret(dir: Path, name: str) -> str:
    """A secret of the team in DIR/secrets (created on first use: 32 random bytes, url-safe)."""
    folder = Path(dir) / "secrets"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / name
    if not path.is_file():
        _write_secret(path, secrets.token_urlsafe(32))
    return path.read_text().strip()


def read_state(dir: Path) -> TeamState:
    path = Path(dir) / STATE
    if not path.is_file():
        raise TeamError(f"{path}: no team state here (start the services: factory team up --dir {dir})")
    return TeamState(**json.loads(path.read_text()))


def _write_state(state: TeamState) -> None:
    from pfactory.fsutil import atomic_write_json

    atomic_write_json(Path(state.dir) / STATE, asdict(state))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of this process (tests start and stop in one process) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _auth_ini(dir: Path) -> Path:
    mlflow_dir = Path(dir) / "mlflow"
    path = mlflow_dir / "auth.ini"
    text = (
        "[mlflow]\n"
        "# Everyone authenticated may read; writes need a grant (factory team user add).\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{(mlflow_dir / 'auth.db').resolve()}\n"
        f"admin_username = {ADMIN}\n"
        f"admin_password = {secret(dir, 'admin_password')}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "# MLflow checks the password hash (PBKDF2) on every request unless cached: 0.5-8 s per request on a\n"
        "# busy 2-core host (2026-12-03). One worker (--workers 1) sees every password change at once.\n"
        "auth_cache_ttl_seconds = 300\n"
    )
    _write_secret(path, text)
    return path


def _commands(state: TeamState) -> dict[str, tuple[list[str], dict[str, str]]]:
    d = Path(state.dir).resolve()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    mlflow_env = {
        **base,
        "MLFLOW_AUTH_CONFIG_PATH": str(_auth_ini(d)),
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secret(d, "flask_secret"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
        # MLflow's job runner (GenAI jobs, trace roll-ups; unused here) is 7 huey consumer processes, ~250 MB
        # and a few CPU seconds each to start, polling forever after (MLflow 3.x).
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    mlflow_cmd = [
        sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth", "--workers", "1",
        "--host", state.host, "--port", str(state.mlflow_port),
        "--backend-store-uri", f"sqlite:///{d / 'mlflow' / 'mlflow.db'}",
        "--artifacts-destination", str(d / "mlflow" / "artifacts"),
    ]  # fmt: skip
    prefect_env = {
        **base,
        "PREFECT_HOME": str(d / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": str(REPOSSESSOR_LOOP_S),
        "PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS": str(SLOT_WAIT_S),
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    prefect_cmd = [
        sys.executable, "-m", "prefect", "server", "start", "--host", state.host, "--port", str(state.prefect_port),
    ]  # fmt: skip
    return {"mlflow": (mlflow_cmd, mlflow_env), "prefect": (prefect_cmd, prefect_env)}


def _health(url: str) -> bool:
    import requests

    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.RequestException:
        return False


def running(state: TeamState) -> dict[str, bool]:
    """Per service: its process is alive and it answers its health URL."""
    urls = {"mlflow": state.mlflow_url + "/health", "prefect": state.prefect_url + "/health"}
    return {k: alive(state.pids.get(k, -1)) and _health(urls[k]) for k in urls}


def up(
    dir: Path, host: str = "127.0.0.1", mlflow_port: int = 5000, prefect_port: int = 4200, train_slots: int = 1,
    slot_limit: str = "pfactory-train", model: str = DEFAULT_MODEL, timeout_s: float = START_TIMEOUT_S,
    say: Any = None,
) -> TeamState:  # fmt: skip
    """Start both servers (or find them running), then set up the admin's resources; returns the state.

    `say(text)`: progress lines (default: none). TeamError when a port is taken or a server does not
    answer within `timeout_s` (its log's last lines in the message)."""
    say = say or (lambda _text: None)
    dir = Path(dir).resolve()
    if train_slots < 1:
        raise TeamError(f"--train-slots {train_slots}: expected at least 1")
    if (dir / STATE).is_file():
        old = read_state(dir)
        if all(running(old).values()):
            say(f"already running (started {time.strftime('%H:%M:%S', time.localtime(old.started_at))})")
            old.train_slots = train_slots
            _setup(old, say)
            return old
        if any(alive(p) for p in old.pids.values()):
            raise TeamError(
                f"{dir / STATE}: a service of this team runs but does not answer; `factory team down --dir {dir}`"
            )
    for name, port in (("MLflow", mlflow_port), ("Prefect", prefect_port)):
        if not _port_free(host, port):
            raise TeamError(f"{host}:{port} ({name}) is taken by another process; pick another port")
    for sub in ("mlflow/artifacts", "prefect", "logs"):
        (dir / sub).mkdir(parents=True, exist_ok=True)
    state = TeamState(str(dir), host, mlflow_port, prefect_port, train_slots, slot_limit, model)
    procs: dict[str, subprocess.Popen] = {}
    for name, (cmd, env) in _commands(state).items():
        with open(dir / "logs" / f"{name}.log", "ab") as log:
            procs[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=dir,
                start_new_session=True,  # a Ctrl-C in the terminal that started them does not stop them
            )  # fmt: skip
        state.pids[name] = procs[name].pid
        say(f"started {name} (pid {procs[name].pid}), log {dir / 'logs' / (name + '.log')}")
    state.started_at = time.time()
    _write_state(state)  # before waiting: `factory team down` can stop a start that hangs
    deadline = time.monotonic() + timeout_s
    waiting = set(procs)
    while waiting:
        for name in sorted(waiting):
            if procs[name].poll() is not None:
                tail = (dir / "logs" / f"{name}.log").read_text(errors="replace").strip().splitlines()[-5:]
                down(dir)
                raise TeamError(f"{name} server exited with {procs[name].returncode}: " + " | ".join(tail))
            url = state.mlflow_url + "/health" if name == "mlflow" else state.prefect_url + "/health"
            if _health(url):
                waiting.discard(name)
                say(f"{name} answers at {url.rsplit('/', 1)[0]} ({time.time() - state.started_at:.1f} s)")
        if waiting and time.monotonic() > deadline:
            down(dir)
            raise TeamError(
                f"{', '.join(sorted(waiting))} did not answer within {timeout_s:g} s; logs in {dir / 'logs'}"
            )
        time.sleep(0.5)
    _setup(state, say)
    return state


def admin_env(state: TeamState) -> dict[str, str]:
    """The admin's MLflow credentials for this team (read from the 0600 file)."""
    return {
        "MLFLOW_TRACKING_URI": state.mlflow_url,
        "MLFLOW_TRACKING_USERNAME": ADMIN,
        "MLFLOW_TRACKING_PASSWORD": secret(Path(state.dir), "admin_password"),
    }


class _env:
    """Set environment variables for a block (MLflow's clients read credentials from there)."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self.values, self.saved = dict(values), {}

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _setup(state: TeamState, say: Any) -> None:
    """As the admin: the experiment, the two registered models, the slot limit (each only if missing)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from pfactory.tracking import EXPERIMENT_KIND

    with _env(admin_env(state)):
        c = MlflowClient(state.mlflow_url)
        if c.get_experiment_by_name(EXPERIMENT) is None:
            # No artifact_location: the server's own (proxied `mlflow-artifacts:/`, under DIR/mlflow/artifacts),
            # so every user's runs keep their files on the team's server, not in their clone.
            c.create_experiment(EXPERIMENT, tags=EXPERIMENT_KIND)
            say(f"created experiment {EXPERIMENT}")
        for name, what in ((state.model, "production versions (maintainers)"),
                           (candidates_name(state.model), "candidates (engineers register here)")):  # fmt: skip
            try:
                c.create_registered_model(name, description=f"perception-factory: {what}")
                say(f"created registered model {name}: {what}")
            except MlflowException as e:
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
    from pfactory.team.slots import ensure_limit

    with _env({"PREFECT_API_URL": state.prefect_url}):
        ensure_limit(state.slot_limit, state.train_slots)
    say(f"training slots: {state.train_slots} (Prefect global concurrency limit {state.slot_limit!r})")
    _write_state(state)


def candidates_name(model: str) -> str:
    """The registered model that holds `model`'s candidates (engineers register there)."""
    return f"{model}-candidates"


def env_lines(state: TeamState) -> list[str]:
    """The shell lines a user runs (`eval "$(factory team up ...)"` works: comments are harmless)."""
    pw = Path(state.dir) / "secrets" / "admin_password"
    return [
        f"export MLFLOW_TRACKING_URI={state.mlflow_url}",
        f"export PREFECT_API_URL={state.prefect_url}",
        f"export PFACTORY_TRAIN_SLOT_LIMIT={state.slot_limit}",
        f"export PFACTORY_TRAIN_SLOTS={state.train_slots}",
        "# your team account (an admin adds it: factory team user add NAME --role engineer|maintainer):",
        "# export MLFLOW_TRACKING_USERNAME=<name> MLFLOW_TRACKING_PASSWORD=<password>",
        "# the admin (adds users); the password stays in its 0600 file:",
        f"export MLFLOW_TRACKING_USERNAME={ADMIN}",
        f'export MLFLOW_TRACKING_PASSWORD="$(cat {pw})"',
    ]


def down(dir: Path, timeout_s: float = 30.0) -> dict[str, str]:
    """Stop the team's servers (SIGTERM to their process groups, SIGKILL after `timeout_s`); returns what
    happened to each. The state folder (databases, artifacts, secrets) stays."""
    state = read_state(dir)
    out: dict[str, str] = {}
    for name, pid in state.pids.items():
        if not alive(pid):
            out[name] = f"pid {pid} not running"
            continue
        try:
            os.killpg(pid, signal.SIGTERM)  # its own session: the server and the workers it started
        except ProcessLookupError:
            out[name] = f"pid {pid} not running"
            continue
        deadline = time.monotonic() + timeout_s
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # reap it when this process started it (tests)
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)
            out[name] = f"pid {pid} killed after {timeout_s:g} s"
        else:
            out[name] = f"pid {pid} stopped"
    state.pids = {}
    _write_state(state)
    return out
