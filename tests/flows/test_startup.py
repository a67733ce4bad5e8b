"""`flows.startup.probe_mlflow_server`: a tracking server's address is checked with one GET /health before
anything starts, so that nothing answering fails in seconds; any HTTP answer counts. `boot_prefect_early`: the
ephemeral Prefect API launched first thing is the one the flow's client uses (handed to Prefect's own
singleton), Prefect's own start takes over when it died, and nothing is launched for a server of the user's."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from flows.failure import ServiceFailed
from flows.startup import _schema_snapshot, migrated_schema_dump, probe_mlflow_server, seed_prefect_database
from tests.flows.conftest import free_port


def test_nothing_answering_fails_in_seconds_naming_the_server_without_its_password() -> None:
    uri = f"http://someone:s3cret-7f3a@127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    with pytest.raises(ServiceFailed) as e:
        probe_mlflow_server(uri)
    assert time.perf_counter() - t0 < 5  # a refused connection, not the client's minute of retries
    assert "127.0.0.1" in e.value.service and "s3cret" not in str(e.value) + " ".join(e.value.hints)
    assert "GET /health" in " ".join(e.value.reason)


class _Answers(http.server.BaseHTTPRequestHandler):
    status = 401  # a basic-auth server without credentials

    def do_GET(self) -> None:
        type(self).paths.append(self.path)
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("status", [200, 401, 404])
def test_any_http_answer_counts_and_the_path_is_kept(status: int) -> None:
    handler = type("H", (_Answers,), {"status": status, "paths": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        probe_mlflow_server(f"http://u:p@127.0.0.1:{server.server_address[1]}/mlflow/")
    finally:
        server.shutdown()
        server.server_close()
    assert handler.paths == ["/mlflow/health"]


def test_stores_that_are_not_servers_are_not_probed() -> None:
    probe_mlflow_server("sqlite:////nonexistent/dir/mlflow.db")
    probe_mlflow_server("file:///nonexistent")


EARLY_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import psutil
    from flows.console import RunConsole
    from flows.startup import _EARLY, boot_prefect_early, prefect_starting

    launched = boot_prefect_early()
    early = _EARLY.get("process")
    if sys.argv[1] == "kill" and early is not None:
        early.kill()
        early.wait()
    with prefect_starting(RunConsole()) as figures:
        pass
    from prefect import flow
    from prefect.server.api.server import SubprocessASGIServer

    @flow
    def hello() -> int:
        return 42

    server = SubprocessASGIServer()
    print(json.dumps({
        "launched": launched, "figures": figures, "answer": hello(), "seeded": _EARLY.get("seeded"),
        "early_pid": early.pid if early is not None else None,
        "early_port": _EARLY.get("port"), "server_port": server.port,
        "server_pid": server.server_process.pid if server.server_process else None,
    }))
""")


def _early(tmp_path: Path, mode: str, **env: str) -> dict:
    home = tmp_path / "prefect"
    home.mkdir()
    run_env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "DO_NOT_TRACK": "1", "PREFECT_LOGGING_LEVEL": "WARNING", **env}  # fmt: skip
    r = subprocess.run([sys.executable, "-c", EARLY_SCRIPT, mode], env=run_env, capture_output=True, text=True,
                       timeout=240, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _gone(pid: int | None) -> bool:
    import psutil

    return pid is None or not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_early_prefect_process_is_the_one_the_flow_uses(tmp_path: Path) -> None:
    out = _early(tmp_path, "keep")
    assert out["launched"] and out["answer"] == 42
    assert out["server_pid"] == out["early_pid"] and out["server_port"] == out["early_port"], out
    assert out["figures"]["prefect"] == "ephemeral" and out["figures"]["prefect_first_start"] is True
    # The database came from the schema snapshot (this Prefect version has one) and the flow ran on it.
    assert out["seeded"] is (_schema_snapshot() is not None)
    assert _gone(out["early_pid"]), "the server outlived the command"


def _schema(db: Path) -> dict:
    """What a SQLite database's schema means, whatever the text of its DDL: per table its columns, foreign keys
    (without SQLite's numbering of them) and indexes (with their columns and order), and the alembic revision."""
    with contextlib.closing(sqlite3.connect(db)) as con:
        q = lambda sql: con.execute(sql).fetchall()  # noqa: E731
        tables = [n for (n,) in q("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        out: dict = {"revision": q("SELECT version_num FROM alembic_version")}
        for t in tables:
            indexes = sorted(
                (i[1], i[2], i[3], i[4], q(f'PRAGMA index_xinfo("{i[1]}")'))
                for i in q(f'PRAGMA index_list("{t}")')
            )
            out[t] = (
                q(f'PRAGMA table_info("{t}")'),
                sorted(fk[2:] for fk in q(f'PRAGMA foreign_key_list("{t}")')),
                indexes,
            )
        return out


def _seeded(tmp_path: Path) -> Path:
    db = tmp_path / "seeded" / "prefect.db"
    assert seed_prefect_database(db) is True
    return db


def test_the_schema_snapshot_is_what_prefects_migrations_create(tmp_path: Path) -> None:
    from importlib.metadata import version

    if _schema_snapshot() is None:
        pytest.skip(f"Prefect {version('prefect')} has no schema snapshot: its first start migrates (write one: "
                    "python scripts/prefect_schema.py)")  # fmt: skip
    migrated = tmp_path / "migrated"
    migrated.mkdir()
    migrated_schema_dump(migrated)
    want, got = _schema(migrated / "prefect.db"), _schema(_seeded(tmp_path))
    assert got.keys() == want.keys()
    assert [t for t in want if got[t] != want[t]] == []


@pytest.mark.skipif(_schema_snapshot() is None, reason="this Prefect version has no schema snapshot")
def test_seeding_leaves_no_temporary_file_and_clears_a_killed_seeds(tmp_path: Path) -> None:
    folder = tmp_path / "seeded"
    folder.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is gone: its temporary file is debris
    (folder / f".prefect.db.{dead.pid}-0badf00d.tmp").write_text("half a database")
    db = _seeded(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == [db.name]


def test_seeding_never_replaces_a_database_and_needs_a_snapshot(tmp_path: Path, monkeypatch) -> None:
    import flows.startup as startup

    db = tmp_path / "prefect.db"
    db.write_bytes(b"somebody's database")
    assert seed_prefect_database(db) is False and db.read_bytes() == b"somebody's database"
    monkeypatch.setattr(startup, "PREFECT_SCHEMA_DIR", tmp_path / "no-snapshots")
    fresh = tmp_path / "fresh" / "prefect.db"
    assert seed_prefect_database(fresh) is False and not fresh.parent.exists()


def test_prefect_starts_its_own_when_the_early_process_died(tmp_path: Path) -> None:
    out = _early(tmp_path, "kill")
    assert out["launched"] and out["answer"] == 42
    assert out["server_pid"] != out["early_pid"], out  # Prefect's own start launched another
    assert _gone(out["server_pid"])


def test_nothing_is_launched_for_a_server_of_the_users(tmp_path: Path) -> None:
    from flows.startup import _EARLY, boot_prefect_early

    before = dict(_EARLY)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert boot_prefect_early() is False
    assert before == _EARLY


def test_the_early_process_exits_for_a_server_named_in_a_profile(tmp_path: Path) -> None:
    """`boot_prefect_early` decides from the environment alone (it runs before Prefect is imported); a server named
    only in the active Prefect profile is found by the process itself, which says so and serves nothing."""
    home = tmp_path / "prefect"
    home.mkdir()
    (home / "profiles.toml").write_text(
        'active = "team"\n[profiles.team]\nPREFECT_API_URL = "http://127.0.0.1:9/api"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_PROFILES_PATH=str(home / "profiles.toml"))
    r = subprocess.run([sys.executable, "-m", "flows.startup", "1"], env=env, capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.splitlines()[0]) == {"serving": False}
    assert not (home / "prefect.db").exists()  # no database created for a server that is not this one
