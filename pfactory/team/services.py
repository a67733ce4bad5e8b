"""`factory team up|down|status`: a team's MLflow (with authentication) and Prefect servers on this machine.

In:  a state folder DIR (created 0700, or 2770 with a named group; it holds every byte the services write),
     the host (127.0.0.1 unless told: any other address needs TLS or `allow_plaintext`), two ports, the
     number of training slots, optionally a TLS certificate and key the user gives, and a group.
Out: two real servers, started the documented way, detached from the terminal (own sessions), with umask 077
     (007 with a group), so every database, log and artifact they write is their owner's (and the group's):
       mlflow server --app-name basic-auth --workers 1 --backend-store-uri sqlite:///DIR/mlflow/mlflow.db
                     --artifacts-destination DIR/mlflow/artifacts     (MLflow's auth app: users, grants)
                     [--uvicorn-opts "--ssl-keyfile KEY --ssl-certfile CERT"]
       prefect server start                      (PREFECT_HOME=DIR/prefect, PREFECT_SERVER_API_AUTH_STRING)
       with TLS: python -m uvicorn --factory prefect.server.api.server:create_app --ssl-keyfile KEY
                 --ssl-certfile CERT (the command `prefect server start --background` runs, plus uvicorn's
                 TLS options: `prefect server start` has none)
     and in DIR:
       team.json            what runs where: pids, urls, the slot limit (no secret in it)
       secrets/             0700; each file 0600, generated, never printed: admin_password, flask_secret,
                            prefect_auth_string (Prefect's basic auth, `pfactory:<random>`), and the
                            systemd environment files mlflow.env / prefect.env (docs/OPERATIONS.md)
       mlflow/auth.ini      0600; MLflow's auth config (MLFLOW_AUTH_CONFIG_PATH): default READ, the admin
       logs/mlflow.log, logs/prefect.log
     then, as the admin: the experiment `perception-factory` (artifacts on the server; READ for every user,
     whose runs go to their own `perception-factory/<user>`, `pfactory.tracking.runs.own_experiment`), the
     registered models `<model>` (production) and `<model>-candidates`, and the global concurrency limit of
     training slots.
     `env_lines` are the shell `export NAME=VALUE` lines a user runs; secret values are read from their
     0600 files (`$(cat ...)`), so they are never shown either.

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
PREFECT_AUTH_USER = "pfactory"  # Prefect's auth string is `user:password` (what a browser's login sends)
REPOSSESSOR_LOOP_S = 5  # Prefect's default 15 s: a killed holder's lease is revoked at most this late
SLOT_WAIT_S = (
    5  # the longest a waiter sleeps between tries (Prefect's default 30 s): a freed slot is taken fast
)
# A first start migrates two databases: ~12 s on a quiet 2-core box, 80 s at load 11 (measured 2026-12-03).
START_TIMEOUT_S = 600.0
EXPERIMENT = "perception-factory"
DEFAULT_MODEL = "pfactory-detector"
PLAINTEXT_OPTION = "--allow-plaintext"  # the option that accepts a non-loopback bind without TLS


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
    tls_cert: str = ""
    """The servers' certificate (PEM; clients verify against it); "" for plain HTTP on loopback."""
    tls_key: str = ""
    group: str = ""
    """The group that may read the team's state ("" : the owner only)."""

    @property
    def url_host(self) -> str:
        """The host in the URLs clients use: this machine's name for a wildcard bind."""
        return socket.getfqdn() if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

    @property
    def mlflow_url(self) -> str:
        return f"{self.scheme}://{self.url_host}:{self.mlflow_port}"

    @property
    def prefect_url(self) -> str:
        return f"{self.scheme}://{self.url_host}:{self.prefect_port}/api"


def file_mode(group: str) -> int:
    """The mode of the team's files: 0600, or 0660 with a group."""
    return 0o660 if group else 0o600


def dir_mode(group: str) -> int:
    """The mode of the team's folders: 0700, or 2770 with a group (setgid: new files get the group)."""
    return 0o2770 if group else 0o700


def umask(group: str) -> int:
    """The umask of the servers: nothing for others (077), or for the group too (007)."""
    return 0o007 if group else 0o077


def _write_secret(path: Path, value: str, mode: int = 0o600) -> None:
    """`value` into `path`, created `mode` (never readable by others, not even for an instant), atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # O_CREAT applies the umask; a stale tmp kept its old mode
        with os.fdopen(fd, "w") as f:
            f.write(value)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    os.replace(tmp, path)


def secret(dir: Path, name: str, make: Any = None) -> str:
    """A secret of the team in DIR/secrets (created on first use by `make()`, default 32 random bytes,
    url-safe; 0600 in a 0700 folder)."""
    folder = Path(dir) / "secrets"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    path = folder / name
    if not path.is_file():
        _write_secret(path, make() if make else secrets.token_urlsafe(32))
    return path.read_text().strip()


def prefect_auth_string(dir: Path) -> str:
    """Prefect's basic-auth string of the team (`pfactory:<random>`; DIR/secrets/prefect_auth_string)."""
    return secret(dir, "prefect_auth_string", lambda: f"{PREFECT_AUTH_USER}:{secrets.token_urlsafe(32)}")


def _make_private(dir: Path, group: str) -> None:
    """DIR and everything in it: folders `dir_mode`, nothing for others (and nothing for the group without
    one); secrets/ stays 0700 with 0600 files whatever the group. Tightens a team folder made before."""
    import grp

    gid = -1
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise TeamError(f"--group {group!r}: no such group on this machine") from None
        if gid != os.getgid() and gid not in os.getgroups():
            raise TeamError(
                f"--group {group!r}: you are not a member of it (see `id`); ask for it or drop --group"
            )
    dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    keep = 0o770 if group else 0o700  # what the owner (and the group) keep; others lose everything
    for root, dirs, files in os.walk(dir):
        here = Path(root)
        secret_dir = here == dir / "secrets"
        for p in [here, *(here / f for f in files)]:
            if p.is_symlink():
                continue
            if gid != -1 and not secret_dir:
                os.chown(p, -1, gid)
            mode = p.stat().st_mode
            if p.is_dir():
                want = 0o700 if secret_dir else dir_mode(group)
            else:
                want = mode & (0o700 if secret_dir else keep) & 0o7777
            if (mode & 0o7777) != want:
                os.chmod(p, want)
        dirs[:] = [d for d in dirs if not (here / d).is_symlink()]


def check_bind(host: str, tls_cert: str | None, tls_key: str | None, allow_plaintext: bool) -> None:
    """Refuse (TeamError, one line) a non-loopback bind without TLS (basic-auth passwords and Prefect's auth
    string would cross the network in plain text), a half TLS pair, a key readable by others."""
    import ipaddress

    if bool(tls_cert) != bool(tls_key):
        raise TeamError(
            "--tls-cert and --tls-key: give both (the certificate and its private key) or neither"
        )
    for opt, f in (("--tls-cert", tls_cert), ("--tls-key", tls_key)):
        if f and not Path(f).is_file():
            raise TeamError(f"{opt} {f}: no such file")
    if tls_key and Path(tls_key).stat().st_mode & 0o007:
        raise TeamError(f"--tls-key {tls_key}: readable by others; chmod 600 {tls_key}")
    if tls_cert:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not allow_plaintext:
        raise TeamError(
            f"--host {host}: not a loopback address, and without TLS every password and Prefect's auth string "
            f"would cross the network in plain text; give --tls-cert and --tls-key, or {PLAINTEXT_OPTION}"
        )


def read_state(dir: Path) -> TeamState:
    path = Path(dir) / STATE
    if not path.is_file():
        raise TeamError(f"{path}: no team state here (start the services: factory team up --dir {dir})")
    return TeamState(**json.loads(path.read_text()))


def _write_state(state: TeamState) -> None:
    """DIR/team.json, atomically, with the team's file mode (no secret in it, still nobody else's)."""
    _write_secret(Path(state.dir) / STATE, json.dumps(asdict(state), indent=2, sort_keys=True) + "\n",
                  file_mode(state.group))  # fmt: skip


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


def _env_files(dir: Path) -> None:
    """The systemd `EnvironmentFile=`s (docs/OPERATIONS.md), 0600: the servers' secrets as variables."""
    _write_secret(
        dir / "secrets" / "mlflow.env", f"MLFLOW_FLASK_SERVER_SECRET_KEY={secret(dir, 'flask_secret')}\n"
    )
    _write_secret(
        dir / "secrets" / "prefect.env", f"PREFECT_SERVER_API_AUTH_STRING={prefect_auth_string(dir)}\n"
    )


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
    if state.tls_cert:  # MLflow serves through uvicorn: its own TLS options
        import shlex

        mlflow_cmd += [
            "--uvicorn-opts",
            shlex.join(["--ssl-keyfile", state.tls_key, "--ssl-certfile", state.tls_cert]),
        ]
    prefect_env = {
        **base,
        "PREFECT_HOME": str(d / "prefect"),
        "PREFECT_SERVER_API_AUTH_STRING": prefect_auth_string(d),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": str(REPOSSESSOR_LOOP_S),
        "PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS": str(SLOT_WAIT_S),
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    if state.tls_cert:
        # `prefect server start` has no TLS options; its --background form runs this uvicorn command
        # (prefect/cli/_server_utils.py, Prefect 3.9), to which uvicorn's own TLS options are added.
        prefect_env["PREFECT__SERVER_FINAL"] = "1"  # what `prefect server start` sets: this is the one server
        prefect_cmd = [
            sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
            "--host", state.host, "--port", str(state.prefect_port), "--workers", "1",
            "--ssl-keyfile", state.tls_key, "--ssl-certfile", state.tls_cert, "--log-level", "warning",
        ]  # fmt: skip
    else:
        prefect_cmd = [
            sys.executable, "-m", "prefect", "server", "start", "--host", state.host, "--port", str(state.prefect_port),
        ]  # fmt: skip
    return {"mlflow": (mlflow_cmd, mlflow_env), "prefect": (prefect_cmd, prefect_env)}


def verify(state: TeamState) -> str | bool:
    """What `requests` verifies the team's servers with: their certificate, or the default CAs."""
    return state.tls_cert or True


def _health(url: str, verify: str | bool = True) -> bool:
    import requests

    try:
        return requests.get(url, timeout=5, verify=verify).status_code == 200
    except requests.RequestException:
        return False


def running(state: TeamState) -> dict[str, bool]:
    """Per service: its process is alive and it answers its health URL (GET, no credentials needed)."""
    urls = {"mlflow": state.mlflow_url + "/health", "prefect": state.prefect_url + "/health"}
    return {k: alive(state.pids.get(k, -1)) and _health(urls[k], verify(state)) for k in urls}


def up(
    dir: Path, host: str = "127.0.0.1", mlflow_port: int = 5000, prefect_port: int = 4200, train_slots: int = 1,
    slot_limit: str = "pfactory-train", model: str = DEFAULT_MODEL, timeout_s: float = START_TIMEOUT_S,
    say: Any = None, tls_cert: str | Path | None = None, tls_key: str | Path | None = None, group: str = "",
    allow_plaintext: bool = False,
) -> TeamState:  # fmt: skip
    """Start both servers (or find them running), then set up the admin's resources; returns the state.

    `say(text)`: progress lines (default: none). `tls_cert` / `tls_key`: PEM files both servers serve
    (required for a `host` other than loopback unless `allow_plaintext`); `group`: the group that may read
    the state. TeamError (one line) for a refused bind or TLS pair, a port taken, a server that does not
    answer within `timeout_s` (its log's last lines in the message), a running Prefect without auth."""
    say = say or (lambda _text: None)
    dir = Path(dir).resolve()
    if train_slots < 1:
        raise TeamError(f"--train-slots {train_slots}: expected at least 1")
    cert = str(Path(tls_cert).resolve()) if tls_cert else ""
    key = str(Path(tls_key).resolve()) if tls_key else ""
    check_bind(host, cert, key, allow_plaintext)
    if (dir / STATE).is_file():
        old = read_state(dir)
        if all(running(old).values()):
            say(f"already running (started {time.strftime('%H:%M:%S', time.localtime(old.started_at))})")
            if prefect_open(old):
                raise TeamError(
                    f"{old.prefect_url}: this team's Prefect server answers without credentials (started before "
                    f"authentication); restart it: factory team down --dir {dir}, then factory team up"
                )
            _make_private(dir, old.group)
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
    _make_private(dir, group)
    old_umask = os.umask(umask(group))  # the folders and files made here and by the servers
    try:
        for sub in ("mlflow/artifacts", "prefect", "logs"):
            (dir / sub).mkdir(parents=True, exist_ok=True)
        _make_private(dir, group)
        state = TeamState(str(dir), host, mlflow_port, prefect_port, train_slots, slot_limit, model,
                          tls_cert=cert, tls_key=key, group=group)  # fmt: skip
        _env_files(dir)
        procs: dict[str, subprocess.Popen] = {}
        for name, (cmd, env) in _commands(state).items():
            fd = os.open(
                dir / "logs" / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, file_mode(group)
            )
            with os.fdopen(fd, "ab") as log:
                procs[name] = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=dir,
                    start_new_session=True,  # a Ctrl-C in the terminal that started them does not stop them
                    umask=umask(group),
                )  # fmt: skip
            state.pids[name] = procs[name].pid
            say(f"started {name} (pid {procs[name].pid}), log {dir / 'logs' / (name + '.log')}")
    finally:
        os.umask(old_umask)
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
            if _health(url, verify(state)):
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


def prefect_open(state: TeamState) -> bool:
    """Whether the team's Prefect API answers an anonymous `POST /flows/filter` (a server without auth)."""
    import requests

    try:
        r = requests.post(
            state.prefect_url + "/flows/filter", json={"limit": 1}, timeout=30, verify=verify(state)
        )
    except requests.RequestException:
        return False
    return r.status_code == 200


def client_env(state: TeamState) -> dict[str, str]:
    """What every team member's factory processes need besides their MLflow account: the URLs, Prefect's
    auth string (from its 0600 file) and, with TLS, the certificate both clients verify the servers with."""
    env = {
        "MLFLOW_TRACKING_URI": state.mlflow_url,
        "PREFECT_API_URL": state.prefect_url,
        "PREFECT_API_AUTH_STRING": prefect_auth_string(Path(state.dir)),
    }
    if state.tls_cert:
        env.update(
            {"MLFLOW_TRACKING_SERVER_CERT_PATH": state.tls_cert, "PREFECT_API_SSL_CERT_FILE": state.tls_cert}
        )
    return env


def admin_env(state: TeamState) -> dict[str, str]:
    """The admin's environment for this team: `client_env` and the admin's MLflow credentials (read from the
    0600 file)."""
    return {
        **client_env(state),
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

    from pfactory.tracking.runs import EXPERIMENT_KIND

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

    with _env(client_env(state)):
        ensure_limit(state.slot_limit, state.train_slots)
    say(f"training slots: {state.train_slots} (Prefect global concurrency limit {state.slot_limit!r})")
    _write_state(state)


def candidates_name(model: str) -> str:
    """The registered model that holds `model`'s candidates (engineers register there)."""
    return f"{model}-candidates"


def env_lines(state: TeamState) -> list[str]:
    """The shell lines a user runs (`eval "$(factory team up ...)"` works: comments are harmless). Secret
    values are never in them: they read the 0600 files."""
    d = Path(state.dir) / "secrets"
    lines = [
        f"export MLFLOW_TRACKING_URI={state.mlflow_url}",
        f"export PREFECT_API_URL={state.prefect_url}",
        "# Prefect's auth string (every client sends it; the admin gives it to the team with their accounts):",
        f'export PREFECT_API_AUTH_STRING="$(cat {d / "prefect_auth_string"})"',
    ]
    if state.tls_cert:
        lines += [
            "# the servers' certificate: both clients verify it",
            f"export MLFLOW_TRACKING_SERVER_CERT_PATH={state.tls_cert}",
            f"export PREFECT_API_SSL_CERT_FILE={state.tls_cert}",
        ]
    return [
        *lines,
        f"export PFACTORY_TRAIN_SLOT_LIMIT={state.slot_limit}",
        f"export PFACTORY_TRAIN_SLOTS={state.train_slots}",
        "# your team account (an admin adds it: factory team user add NAME --role engineer|maintainer):",
        "# export MLFLOW_TRACKING_USERNAME=<name>; read -rs MLFLOW_TRACKING_PASSWORD; export MLFLOW_TRACKING_PASSWORD",
        "# the admin (adds users); the password stays in its 0600 file:",
        f"export MLFLOW_TRACKING_USERNAME={ADMIN}",
        f'export MLFLOW_TRACKING_PASSWORD="$(cat {d / "admin_password"})"',
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
