"""Start the local services of a `factory run` before the flow, saying what a first start is doing.

On a fresh clone both stores are created on the first run: Prefect's SQLite database from the installed
version's schema snapshot (`seed_prefect_database`; a version without one runs its migrations: 10-13 s on a
quiet 2-core box, 42 s on a 2-3x slower one at load 3), then its ephemeral API starts (~5 s), and MLflow
creates its tables (a few seconds). Done here, explicitly, they are announced ("first run only"), timed, and a
failure is one clear `ServiceFailed` (what failed, what to try) instead of a traceback from inside the
flow. The ephemeral server is Prefect's own (`SubprocessASGIServer`, a process-wide singleton): the flow's
client finds it running and reuses it. `factory run` launches its process first thing
(`boot_prefect_early`), so that it boots while the command imports MLflow and the flow, and hands it to
that singleton once it answers (`prefect_starting`). Its start-up timeout is Prefect's setting
`PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`, which `pfactory.runtime.project.configure_environment`
defaults to `PREFECT_STARTUP_TIMEOUT_S` unless the user set it.

`PREFECT_API_URL` / `MLFLOW_TRACKING_URI` pointing at real servers: nothing is created, the servers are
checked for an answer so that a wrong address fails in seconds, before any stage runs.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import select
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flows.console import RunConsole
from flows.failure import ServiceFailed


def _sqlite_file(url: str) -> Path | None:
    """The database file of a `sqlite:///...` / `sqlite+aiosqlite:///...` URL (None: not a sqlite file)."""
    scheme, sep, rest = url.partition(":///")
    if not sep or not scheme.startswith("sqlite") or rest in ("", ":memory:"):
        return None
    return Path(rest)  # sqlite:///relative/path, sqlite:////absolute/path


def _first_start(db: Path | None) -> bool:
    return db is not None and (not db.is_file() or db.stat().st_size == 0)


PREFECT_SCHEMA_DIR = Path(__file__).with_name("prefect_schema")
"""Schema snapshots of Prefect's SQLite database, one per Prefect version: `prefect-<version>.sql`, the SQL dump of
a database that version's migrations just created (its tables, indexes and alembic revision; no rows). Written by
`python scripts/prefect_schema.py`; tests/flows/test_startup.py checks the installed version's against its
migrations."""


def _schema_snapshot() -> Path | None:
    """The installed Prefect version's schema snapshot, None when there is none."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        snap = PREFECT_SCHEMA_DIR / f"prefect-{version('prefect')}.sql"
    except PackageNotFoundError:
        return None
    return snap if snap.is_file() else None


def seed_prefect_database(db: Path) -> bool:
    """Create Prefect's SQLite database `db` from the installed Prefect version's schema snapshot instead of its
    migrations, the way Rails' `db:schema:load` creates a new database: Prefect's start then finds it at its
    head revision and migrates nothing (the ephemeral API answered after 3.6 instead of 8.6 s on a quiet 2-core
    box: ~150 migrations, most of them SQLite table rebuilds, take ~5 s of CPU). Returns False, writing nothing,
    when `db` exists or this Prefect version has no snapshot: Prefect then migrates as usual. The database is
    built beside `db` and linked into place only while `db` is still absent (another process creating it first
    wins)."""
    from pfactory.storage.fsutil import remove_stale_temps, temp_sibling

    snap = _schema_snapshot()
    if snap is None or db.exists():
        return False
    db.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(db)  # a seed killed mid-way
    tmp = temp_sibling(db)
    try:
        with contextlib.closing(sqlite3.connect(tmp)) as con:
            con.executescript(snap.read_text(encoding="utf-8"))
        os.link(tmp, db)  # fails if `db` appeared meanwhile: never replaces a database in use
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def migrated_schema_dump(folder: Path) -> str:
    """The SQL dump of a Prefect database that the installed Prefect's own migrations create in `folder` (in a
    child process, with Prefect's defaults): what a schema snapshot must equal."""
    db = Path(folder) / "prefect.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(folder), PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{db}")
    code = (
        "import asyncio\n"
        "from prefect.server.database import provide_database_interface\n"
        "asyncio.run(provide_database_interface().create_db())\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    with contextlib.closing(sqlite3.connect(db)) as con:
        return "\n".join(con.iterdump()) + "\n"


_EARLY: dict[str, Any] = {}
"""The ephemeral API process `boot_prefect_early` launched: `process` (until `prefect_starting` adopts it),
`port`, `first` (its database did not exist then), `seeded` (the database was created from the schema snapshot,
`seed_prefect_database`), `t0` (`time.perf_counter()` at the launch)."""


def _free_port(ports: range = range(8000, 9000)) -> int:
    """A port of 127.0.0.1 nothing listens on, drawn from Prefect's own ephemeral range (as its
    `SubprocessASGIServer.find_available_port` does: that lives in the server module, whose import is what
    `boot_prefect_early` runs before)."""
    for _ in range(20):
        port = random.choice(ports)
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port for the local Prefect API in {ports.start}-{ports.stop - 1}")


def boot_prefect_early() -> bool:
    """Launch Prefect's ephemeral API process now (`python -m flows.startup PORT`, `_serve`): `factory run` calls
    this first thing, before it imports Prefect itself, so that the server imports Prefect and opens (or seeds)
    its database on the other core while the command imports MLflow, Prefect and the flow. It is the server
    Prefect's `SubprocessASGIServer.start` would run (its app factory under uvicorn, its settings from this
    environment); `prefect_starting` hands it to Prefect's own singleton once it answers, and the flow's client
    uses it. Nothing is launched when `PREFECT_API_URL` names a server or the ephemeral API is disabled: in
    Prefect's settings when Prefect is imported already, else in the environment (a profile's setting is found
    by the process itself, which then exits without serving). A process never handed over is stopped at exit.
    Returns whether a process was launched."""
    if _EARLY or not _may_serve():
        return False
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "flows.startup", str(port)], stdout=subprocess.PIPE, text=True)
    _EARLY.update(process=process, port=port, t0=time.perf_counter())
    atexit.register(_stop_early)
    return True


_FALSE = ("0", "false", "f", "no", "n", "off")


def _may_serve() -> bool:
    """Whether the ephemeral API may be wanted (`boot_prefect_early`), without importing Prefect."""
    if "prefect.settings" in sys.modules:
        from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

        return not PREFECT_API_URL.value() and bool(PREFECT_SERVER_EPHEMERAL_ENABLED.value())
    enabled = os.environ.get("PREFECT_SERVER_EPHEMERAL_ENABLED", "true").strip().lower() not in _FALSE
    return not os.environ.get("PREFECT_API_URL") and enabled


def _serve(port: int) -> int:
    """The early process (`boot_prefect_early`): one JSON line on stdout, `{"serving": false}` when Prefect's
    settings name a server or disable the ephemeral API (then exit 0), else `{"serving": true, "first",
    "seeded"}` (`first`: its database did not exist; `seeded`: created from the schema snapshot,
    `seed_prefect_database`); then Prefect's API on 127.0.0.1:`port` until terminated, as Prefect's own
    `SubprocessASGIServer` runs it (the UI off; exit 3 when the port was taken meanwhile)."""
    os.environ.update(PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    status: dict[str, Any] = {"serving": _may_serve()}
    if status["serving"]:
        db = _sqlite_file(str(PREFECT_SERVER_DATABASE_CONNECTION_URL.value() or ""))
        first = _first_start(db)
        status.update(first=first, seeded=first and db is not None and seed_prefect_database(db))
    sys.stdout.write(json.dumps(status) + "\n")
    sys.stdout.flush()
    os.dup2(2, 1)  # the launcher reads one line: anything the server prints goes where its errors go
    if not status["serving"]:
        return 0
    import uvicorn

    uvicorn.run("prefect.server.api.server:create_app", factory=True, host="127.0.0.1", port=port,
                log_level="error", lifespan="on")  # fmt: skip
    return 0


def _early_status(timeout: float) -> dict[str, Any]:
    """The early process's line (`_serve`), read once and kept in `_EARLY["status"]` (with `first` and
    `seeded`); `{}` when it exited or said nothing within `timeout` s of its launch."""
    if "status" not in _EARLY:
        status: dict[str, Any] = {}
        proc = _EARLY.get("process")
        if proc is not None and proc.stdout is not None:
            wait = max(0.0, timeout - (time.perf_counter() - _EARLY["t0"]))
            if select.select([proc.stdout], [], [], wait)[0]:
                with contextlib.suppress(ValueError):
                    status = json.loads(proc.stdout.readline() or "{}")
        _EARLY.update(status=status, first=status.get("first"), seeded=status.get("seeded"))
    return _EARLY["status"]


def _stop_early() -> None:
    """Stop the early process unless it was handed over (then Prefect's own `stop` ends it at exit)."""
    proc = _EARLY.pop("process", None)
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _adopt_early(timeout: float) -> bool:
    """Wait for the early process (`boot_prefect_early`) to answer `GET /api/health`, then hand it to
    Prefect's `SubprocessASGIServer` singleton as its own `start` would have set it (port, process, running;
    stopped at exit by its `stop`). False when there is none or it exited first (exit 3: another process
    took the port meanwhile): the caller starts Prefect's own. RuntimeError after `timeout` s from the launch."""
    proc = _EARLY.get("process")
    if proc is None:
        return False
    import httpx

    url = f"http://127.0.0.1:{_EARLY['port']}/api/health"
    with httpx.Client() as client:
        while True:
            if proc.poll() is not None:
                _EARLY.pop("process", None)
                return False
            try:
                if client.get(url).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - _EARLY["t0"] > timeout:
                _stop_early()
                raise RuntimeError(f"Timed out while attempting to connect to the local Prefect API at {url}")
            time.sleep(0.1)
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    if server.running:  # started meanwhile by another path: keep that one
        _stop_early()
        return True
    server.port, server.server_process, server.running = _EARLY["port"], _EARLY.pop("process"), True
    atexit.register(server.stop)
    return True


def start_prefect(console: RunConsole) -> dict[str, Any]:
    """Start Prefect's ephemeral API (unless `PREFECT_API_URL` names a server, which is checked instead) and
    wait for it. Returns `{"prefect": "ephemeral" | url, "prefect_start_s": seconds, "prefect_first_start":
    bool}`. Raises `ServiceFailed`."""
    with prefect_starting(console) as figures:
        pass
    return figures


@contextlib.contextmanager
def prefect_starting(console: RunConsole) -> Iterator[dict[str, Any]]:
    """`start_prefect` with the body run while the ephemeral API boots in its own process (a first start
    migrates its database: ~10 s); leaving the block waits for it and fills the yielded dict with
    `start_prefect`'s figures. An exception in the body propagates without waiting (the server process is
    stopped at exit by Prefect's own handler). Raises `ServiceFailed` on leaving."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_SERVER_DATABASE_CONNECTION_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    figures: dict[str, Any] = {}
    t0 = time.perf_counter()
    api = PREFECT_API_URL.value()
    if api:
        from flows.deploy import DeployError, check_server

        try:
            check_server(api)
        except DeployError as e:
            raise ServiceFailed(
                f"the Prefect API at {api}",
                [str(e).splitlines()[0]],
                [
                    "start it (`prefect server start`), or check PREFECT_API_URL",
                    "or `unset PREFECT_API_URL` to run on the embedded local API",
                ],
            ) from e
        figures.update(prefect=api, prefect_start_s=round(time.perf_counter() - t0, 3), prefect_first_start=False)
        yield figures
        return
    if not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        raise ServiceFailed(
            "Prefect",
            [
                "no PREFECT_API_URL, and the ephemeral API is disabled (PREFECT_SERVER_EPHEMERAL_ENABLED=false)"
            ],
            ["set PREFECT_API_URL to a running server, or PREFECT_SERVER_EPHEMERAL_ENABLED=true"],
        )
    db = _sqlite_file(str(PREFECT_SERVER_DATABASE_CONNECTION_URL.value() or ""))
    timeout = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    # Launched by boot_prefect_early and serving: its database's state then, its start timed from its launch.
    early = "process" in _EARLY and bool(_early_status(timeout).get("serving"))
    if not early:
        _stop_early()  # said it would not serve, or nothing: Prefect's own start below
    first = bool(_EARLY["first"]) if early else _first_start(db)
    t0 = _EARLY["t0"] if early else t0
    shown = db if db is not None else Path(str(PREFECT_HOME.value()))
    what = (
        f"first run only: creating the local Prefect database ({_rel(shown)}) and starting its API "
        f"(up to a minute on a slow machine; limit {timeout} s)"
        if first
        else "starting the local Prefect API"
    )
    failed: list[BaseException] = []

    def boot() -> None:  # Prefect's own start-up: launch, then poll /health until it answers or times out
        try:
            if not _adopt_early(timeout):
                from prefect.server.api.server import SubprocessASGIServer

                SubprocessASGIServer().start()
        except BaseException as e:  # RuntimeError on a timeout or a crashed server; httpx errors
            failed.append(e)

    if first:
        console.note(what + " …")
    booting = threading.Thread(target=boot, name="prefect-start", daemon=True)
    booting.start()
    yield figures
    with console.status(what + " …", announce=False):
        booting.join()
    if failed:
        e = failed[0]
        last = str(e).strip().splitlines()
        raise ServiceFailed(
            "the local Prefect API did not start",
            [f"{type(e).__name__}: {last[0] if last else ''}"[:300], f"waited up to {timeout} s"],
            [
                "run it again: the first start creates the database, a second start is faster",
                f"allow more time: export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS={4 * timeout}",
                "or run a server (`prefect server start`) and export PREFECT_API_URL=http://127.0.0.1:4200/api",
            ],
        ) from e
    seconds = time.perf_counter() - t0
    if first or seconds > 10:
        console.note(f"local Prefect API ready in {seconds:.1f} s" + (" (database created)" if first else ""))
    figures.update(prefect="ephemeral", prefect_start_s=round(seconds, 3), prefect_first_start=first)


def start_mlflow(console: RunConsole, root: Path) -> dict[str, Any]:
    """Create (first run) or open the MLflow store of `MLFLOW_TRACKING_URI` and the project's experiment.

    Returns `{"mlflow_start_s", "mlflow_first_start"}`. Raises `ServiceFailed`.
    """
    import mlflow

    from pfactory.tracking.runs import experiment_id, redact_uri

    uri = os.environ["MLFLOW_TRACKING_URI"]
    shown = redact_uri(uri)  # a password in the URI is never printed
    db = _sqlite_file(uri)
    first = _first_start(db)
    t0 = time.perf_counter()
    what = (
        f"first run only: creating the local MLflow database ({_rel(db)})"
        if first and db is not None
        else f"opening the MLflow store {shown}"
    )
    try:
        with console.status(what + " …", announce=first):
            mlflow.set_tracking_uri(uri)
            experiment_id(root)
    except Exception as e:
        last = str(e).strip().splitlines()
        raise ServiceFailed(
            f"the MLflow tracking store {shown}",
            [f"{type(e).__name__}: {last[0] if last else ''}"[:300]],
            [
                "a tracking server: check that it answers (GET /health) and MLFLOW_TRACKING_URI",
                "or `unset MLFLOW_TRACKING_URI` to use the embedded sqlite store under artifacts/mlflow/",
            ],
        ) from e
    seconds = time.perf_counter() - t0
    if first:
        console.note(f"local MLflow database ready in {seconds:.1f} s")
    return {"mlflow_start_s": round(seconds, 3), "mlflow_first_start": first}


def _rel(path: Path | None) -> str:
    from flows.failure import openable

    return openable(path) if path is not None else "?"


MLFLOW_PROBE_TIMEOUT_S = 10.0  # one GET /health; the MLflow client's own retries come after, in start_mlflow


def probe_mlflow_server(uri: str, timeout: float = MLFLOW_PROBE_TIMEOUT_S) -> None:
    """For an `http(s)://` MLFLOW_TRACKING_URI: one `GET /health`, so that an address where nothing answers
    fails in seconds instead of after the MLflow client's retries (about a minute). Any HTTP answer, an
    error status included (a basic-auth server's 401), counts as an answer. Raises `ServiceFailed`."""
    import ssl
    import urllib.error
    import urllib.parse
    import urllib.request

    from pfactory.tracking.runs import redact_uri

    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    netloc = parts.hostname or ""  # without user:password@ (urllib would not take them from the URL)
    netloc = f"[{netloc}]" if ":" in netloc else netloc
    if parts.port:
        netloc += f":{parts.port}"
    health = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") + "/health", "", ""))
    try:
        with urllib.request.urlopen(health, timeout=timeout):
            return
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ssl.SSLError):
            return  # it answered; TLS settings (MLFLOW_TRACKING_INSECURE_TLS, a CA bundle) are the client's
        raise ServiceFailed(
            f"the MLflow tracking server {redact_uri(uri)}",
            [f"nothing answered GET /health: {type(reason).__name__}: {reason}"[:300]],
            [
                "a tracking server: check that it runs and MLFLOW_TRACKING_URI (host, port, http/https)",
                "or `unset MLFLOW_TRACKING_URI` to use the embedded sqlite store under artifacts/mlflow/",
            ],
        ) from e


def start_services(console: RunConsole, root: Path) -> dict[str, Any]:
    """A tracking server's address checked first (`probe_mlflow_server`: seconds), then Prefect, with the
    MLflow store opened while Prefect's API boots in its own process (`prefect_starting`, `start_mlflow`);
    their start-up figures."""
    probe_mlflow_server(os.environ["MLFLOW_TRACKING_URI"])
    with prefect_starting(console) as prefect:
        mlflow = start_mlflow(console, root)
    return {**prefect, **mlflow}


if __name__ == "__main__":  # the early Prefect API process (`boot_prefect_early`)
    sys.exit(_serve(int(sys.argv[1])))
