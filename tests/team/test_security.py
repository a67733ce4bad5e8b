"""A team's factory as a security review reads it, against real servers on 127.0.0.1 (tests/team/conftest.py):
Prefect's auth string (HTTP and websockets), the factory's one line for a Prefect 401, private state modes, the
bind refusal, TLS with a self-signed pair, passwords never on argv, the admin API's refusals as one line, and
the cells of docs/OPERATIONS.md's role table that the MLflow server enforces."""

from __future__ import annotations

import datetime as dt
import grp
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, free_port

MODEL = "pfactory-detector"


def _cli(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`factory ...` through the real console entry (errors -> one line + exit code)."""
    return subprocess.run(
        [sys.executable, "-c", "from factory.cli import main; main()", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, input=stdin,
    )  # fmt: skip


def _lines(err: str) -> list[str]:
    """stderr's lines without Python's warnings (MLflow's import of a deprecated Starlette module prints its
    StarletteDeprecationWarning and the `from ... import` line it points at: not the factory's words)."""
    return [
        ln for ln in err.strip().splitlines() if ln.strip() and "Warning" not in ln and " import " not in ln
    ]


# ----------------------------------------------------------------------------------------------------------
# Prefect's authentication


def test_prefect_http_api_needs_the_auth_string(team) -> None:
    import requests

    from pfactory.team.services import prefect_auth_string

    api = team.state.prefect_url
    good = tuple(prefect_auth_string(Path(team.state.dir)).split(":", 1))
    assert requests.get(api + "/health", timeout=30).status_code == 200  # probes stay open
    for path in ("/flows/filter", "/v2/concurrency_limits/filter", "/variables/filter"):
        assert requests.post(api + path, json={}, timeout=30).status_code == 401, path
        assert requests.post(api + path, json={}, auth=("pfactory", "wrong"), timeout=30).status_code == 401
        assert requests.post(api + path, json={}, auth=good, timeout=30).status_code == 200, path


@pytest.mark.parametrize("path", ["/events/in", "/events/out", "/logs/out"])
def test_prefect_websockets_need_the_auth_string(team, path: str) -> None:
    from websockets.exceptions import ConnectionClosed, InvalidStatus
    from websockets.sync.client import connect

    from pfactory.team.services import prefect_auth_string

    url = team.state.prefect_url.replace("http://", "ws://") + path
    # An old client (no `prefect` subprotocol) is refused at the handshake when auth is configured.
    with pytest.raises(InvalidStatus) as old:
        connect(url, open_timeout=30)
    assert old.value.response.status_code == 403
    # The `prefect` protocol: the first message authenticates; none / a wrong token closes the socket (1008).
    for token in (None, "pfactory:wrong"):
        with connect(url, subprotocols=["prefect"], open_timeout=30) as ws:
            ws.send(json.dumps({"type": "auth", "token": token}))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=30)
            assert closed.value.rcvd.code == 1008, (token, closed.value.rcvd)
    with connect(url, subprotocols=["prefect"], open_timeout=30) as ws:
        ws.send(json.dumps({"type": "auth", "token": prefect_auth_string(Path(team.state.dir))}))
        assert json.loads(ws.recv(timeout=30)) == {"type": "auth_success"}


@pytest.mark.parametrize("auth", [None, "pfactory:wrong"])
def test_factory_turns_a_prefect_401_into_one_line_exit_77(team, auth: str | None) -> None:
    env = team.subprocess_env("bob")
    env.pop("PREFECT_API_AUTH_STRING")
    if auth:
        env["PREFECT_API_AUTH_STRING"] = auth
    res = _cli(env, "team", "status")
    assert res.returncode == 77, res.stderr[-2000:]
    lines = _lines(res.stderr)
    assert len(lines) == 1, lines
    why = "differs from the server's" if auth else "no PREFECT_API_AUTH_STRING"
    assert lines[0].startswith(f"the Prefect server {team.state.prefect_url} refused the request: 401"), lines
    assert why in lines[0] and "wrong" not in lines[0]  # the string sent is never shown
    ok = _cli(team.subprocess_env("bob"), "team", "status")  # with the team's string: it answers
    assert ok.returncode == 0 and "slots    0 of 1 held" in ok.stdout, ok.stderr[-2000:]


def test_export_lines_read_the_auth_string_from_its_file(team) -> None:
    from pfactory.team.services import env_lines, prefect_auth_string

    d = Path(team.state.dir)
    text = "\n".join(env_lines(team.state))
    assert prefect_auth_string(d) not in text and prefect_auth_string(d).split(":")[1] not in text
    assert f'export PREFECT_API_AUTH_STRING="$(cat {d / "secrets" / "prefect_auth_string"})"' in text
    out = subprocess.run(["bash", "-c", text + '\nprintf %s "$PREFECT_API_AUTH_STRING"'], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout == prefect_auth_string(d)
    for name in ("mlflow.env", "prefect.env"):  # what the systemd units of docs/OPERATIONS.md read
        assert stat.S_IMODE((d / "secrets" / name).stat().st_mode) == 0o600
    assert (
        d / "secrets" / "prefect.env"
    ).read_text() == f"PREFECT_SERVER_API_AUTH_STRING={prefect_auth_string(d)}\n"
    assert (d / "secrets" / "mlflow.env").read_text().startswith("MLFLOW_FLASK_SERVER_SECRET_KEY=")


# ----------------------------------------------------------------------------------------------------------
# Private state


def _readable_by_others(d: Path, group: bool = False) -> list[str]:
    """Every path under `d` (itself included) that others (or, without a group, the group) may read, write
    or enter, as `mode path`."""
    bad = 0o007 if group else 0o077
    out = []
    for p in [d, *d.rglob("*")]:
        if p.is_symlink():
            continue
        mode = stat.S_IMODE(p.lstat().st_mode)
        if mode & bad:
            out.append(f"{oct(mode)} {p}")
    return out


def test_team_state_is_owner_only_after_runs_and_slots(team, monkeypatch, tmp_path) -> None:
    """After a run that logs an artifact through the server and a training slot (Prefect's database and
    variables written), no file or folder under DIR is readable by anyone but its owner."""
    import mlflow
    from mlflow import MlflowClient

    from pfactory.team import slots
    from pfactory.team.services import up
    from pfactory.tracking.runs import experiment_id

    team.become(monkeypatch, "alice")
    mlflow.set_tracking_uri(team.state.mlflow_url)
    exp = experiment_id(tmp_path)  # hers, perception-factory/alice: its artifacts on the server
    run = MlflowClient().create_run(exp, tags={"stage": "train"}).info.run_id
    (tmp_path / "kpis.json").write_text('{"mAP": 0.5}')
    MlflowClient().log_artifact(run, str(tmp_path / "kpis.json"))
    MlflowClient().log_metric(run, "eval/mAP", 0.5)
    with slots.training_slot("private-run", "alice", say=lambda _line: None):
        pass
    d = Path(team.state.dir)
    assert list((d / "mlflow" / "artifacts").rglob("kpis.json")), "the artifact went through the server"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert _readable_by_others(d) == []
    for f in ("mlflow/auth.db", "mlflow/mlflow.db", "prefect/prefect.db", "logs/mlflow.log", "team.json"):
        assert stat.S_IMODE((d / f).stat().st_mode) == 0o600, f

    # A team folder made before (files 0644): `team up` again (the services found running) tightens it.
    loose = d / "logs" / "old.log"
    loose.write_text("x")
    loose.chmod(0o644)
    d.chmod(0o755)
    team.become(monkeypatch, None)
    up(d, "127.0.0.1", team.state.mlflow_port, team.state.prefect_port, slot_limit=team.state.slot_limit)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o600 and stat.S_IMODE(d.stat().st_mode) == 0o700
    assert _readable_by_others(d) == []


@pytest.mark.parametrize(("mask", "file", "folder"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_published_files_follow_the_umask(tmp_path: Path, mask: int, file: int, folder: int) -> None:
    """fsutil's atomic writes give files the mode any new file gets under the umask (it forced 0644)."""
    code = (
        "import os, sys; os.umask(int(sys.argv[1], 8)); from pathlib import Path\n"
        "from pfactory.storage.fsutil import atomic_directory, atomic_write_text\n"
        "atomic_write_text(Path(sys.argv[2]) / 'f.json', '{}')\n"
        "with atomic_directory(Path(sys.argv[2]) / 'out', stage='evaluate') as d: (d / 'kpis.json').write_text('{}')\n"
    )
    subprocess.run([sys.executable, "-c", code, oct(mask)[2:], str(tmp_path)], cwd=ROOT, check=True)
    assert stat.S_IMODE((tmp_path / "f.json").stat().st_mode) == file
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == folder


# ----------------------------------------------------------------------------------------------------------
# Binding, TLS


def test_non_loopback_bind_without_tls_is_refused_in_one_line(tmp_path: Path) -> None:
    from pfactory.team.errors import TeamError
    from pfactory.team.services import check_bind

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    ports = ("--mlflow-port", str(free_port()), "--prefect-port", str(free_port()))
    res = _cli(env, "team", "up", "--dir", str(tmp_path / "t"), "--host", "0.0.0.0", *ports)
    if (tmp_path / "t" / "team.json").is_file():  # the refusal failed: stop what it started
        from pfactory.team.services import down

        down(tmp_path / "t")
    assert res.returncode == 2, res.stderr[-2000:]
    lines = _lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith("--host 0.0.0.0: not a loopback address"), lines
    assert "--tls-cert and --tls-key, or --allow-plaintext" in lines[0]
    assert not (tmp_path / "t").exists(), "refused before anything was made"
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_bind(host, None, None, False)
    check_bind("0.0.0.0", None, None, True)  # the named override
    key = tmp_path / "key.pem"
    key.write_text("x")
    key.chmod(0o644)
    with pytest.raises(TeamError, match="give both"):
        check_bind("0.0.0.0", str(key), None, False)
    with pytest.raises(TeamError, match=f"--tls-key {key}: readable by others; chmod 600"):
        check_bind("0.0.0.0", str(key), str(key), False)
    key.chmod(0o600)
    check_bind("0.0.0.0", str(key), str(key), False)


def test_group_must_exist_and_hold_the_user(tmp_path: Path) -> None:
    from pfactory.team.errors import TeamError
    from pfactory.team.services import up

    with pytest.raises(TeamError, match="--group 'no-such-group-47': no such group"):
        up(tmp_path / "t", "127.0.0.1", free_port(), free_port(), group="no-such-group-47")
    foreign = next(
        (g for g in grp.getgrall() if g.gr_gid != os.getgid() and g.gr_gid not in os.getgroups()), None
    )
    if foreign is not None:
        with pytest.raises(TeamError, match=f"--group '{foreign.gr_name}': you are not a member"):
            up(tmp_path / "t2", "127.0.0.1", free_port(), free_port(), group=foreign.gr_name)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost and its key (0600), made with `cryptography`."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pfactory-team-test")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))  # fmt: skip
    return cert_path, key_path


def test_tls_both_servers_and_a_group(tmp_path_factory, monkeypatch) -> None:
    """Both servers serve HTTPS with the user's certificate (MLflow: uvicorn's TLS options; Prefect: its app
    under uvicorn with them), clients verify it (MLflow's and Prefect's own settings), an unverified client
    and plain HTTP fail; the state belongs to the owner and the named group (2770 folders, no bit for others)."""
    import requests
    from mlflow import MlflowClient

    from pfactory.team import slots
    from pfactory.team.services import client_env, down, up

    from .conftest import _VARS

    certs = tmp_path_factory.mktemp("certs")
    cert, key = _self_signed(certs)
    d = tmp_path_factory.mktemp("tls-team") / "team"
    group = grp.getgrgid(os.getgid()).gr_name
    state = up(d, "127.0.0.1", free_port(), free_port(), slot_limit="tls-slots", tls_cert=cert, tls_key=key,
               group=group)  # fmt: skip
    try:
        assert state.mlflow_url.startswith("https://") and state.prefect_url.startswith("https://")
        for url in (state.mlflow_url + "/health", state.prefect_url + "/health"):
            assert requests.get(url, verify=str(cert), timeout=30).status_code == 200
            with pytest.raises(requests.exceptions.SSLError):  # the default CAs do not know it: verified
                requests.get(url, timeout=30)
            with pytest.raises(requests.exceptions.ConnectionError):  # no plain HTTP on that port
                requests.get(url.replace("https://", "http://"), timeout=30)
        assert (
            requests.post(
                state.prefect_url + "/flows/filter", json={}, verify=str(cert), timeout=30
            ).status_code
            == 401
        )

        for k in _VARS:
            monkeypatch.delenv(k, raising=False)
        for k, v in client_env(state).items():  # what `factory team up` prints: the clients' own settings
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", (d / "secrets" / "admin_password").read_text().strip())
        assert MlflowClient(state.mlflow_url).get_experiment_by_name("perception-factory") is not None
        assert slots.status("tls-slots")["slots"] == 1  # Prefect's client over TLS, with the auth string

        gid = grp.getgrnam(group).gr_gid
        assert stat.S_IMODE(d.stat().st_mode) == 0o2770 and d.stat().st_gid == gid
        assert _readable_by_others(d, group=True) == []
        db = stat.S_IMODE((d / "mlflow" / "mlflow.db").stat().st_mode)  # sqlite creates 0644 less the umask
        assert db & 0o040 and (d / "mlflow" / "mlflow.db").stat().st_gid == gid, oct(db)  # the group reads
        assert stat.S_IMODE((d / "secrets").stat().st_mode) == 0o700  # secrets stay the owner's
        assert stat.S_IMODE((d / "secrets" / "prefect_auth_string").stat().st_mode) == 0o600
    finally:
        down(d)


# ----------------------------------------------------------------------------------------------------------
# Users: passwords never on argv, the admin API's refusals as one line


def test_password_is_never_an_argument(team) -> None:
    res = _cli(team.subprocess_env("admin"), "team", "user", "add", "carol", "--role", "engineer",
               "--password", "carol-pw-0123456789")  # fmt: skip
    assert res.returncode == 2 and "No such option: --password" in res.stderr, res.stderr[-2000:]


def test_user_admin_refusals_are_one_line_exit_2(team, tmp_path: Path) -> None:
    env = {**team.subprocess_env("admin"), "SHORT_PW": "short-pw", "DAVE_PW": "dave-pw-0123456789"}
    cases = [
        (("user", "add", "dave", "--role", "engineer", "--password-env", "SHORT_PW"),
         "password of user 'dave': Password must be at least 12 characters (the MLflow server's rule); "
         "nothing was changed"),
        (("user", "add", "alice", "--role", "engineer", "--password-env", "DAVE_PW"),
         "user 'alice': exists already"),
        (("user", "password", "nobody", "--password-env", "DAVE_PW"), "user 'nobody': no such user"),
        (("user", "role", "nobody", "--role", "engineer"), "user 'nobody': no such user"),
        (("user", "add", "dave", "--role", "boss", "--password-env", "DAVE_PW"),
         "--role 'boss': expected one of engineer, maintainer"),
        (("user", "add", "dave", "--role", "engineer"),  # no terminal, no file, no variable
         "password of user 'dave': not given; use --password-file FILE"),
        (("user", "add", "dave", "--role", "engineer", "--password-env", "NO_SUCH_VAR"),
         "--password-env NO_SUCH_VAR: no such environment variable"),
    ]  # fmt: skip
    for args, start in cases:
        res = _cli(env, "team", *args, stdin="")
        lines = _lines(res.stderr)
        assert res.returncode == 2, (args, res.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith(start), (args, lines)
    # Nothing was changed by the refusals: dave does not exist.
    res = _cli(env, "team", "user", "role", "dave", "--role", "engineer")
    assert res.returncode == 2 and "user 'dave': no such user" in res.stderr


def test_user_add_and_password_from_file_stdin_and_environment(team, tmp_path: Path) -> None:
    import requests

    from pfactory.team.services import verify

    pw = tmp_path / "erin.pw"
    pw.write_text("erin-pw-0123456789\n")
    env = team.subprocess_env("admin")
    res = _cli(env, "team", "user", "add", "erin", "--role", "engineer", "--password-file", str(pw))
    assert res.returncode == 0 and res.stdout.startswith("created erin (engineer)"), res.stderr[-2000:]

    def who(password: str) -> int:
        return requests.get(team.state.mlflow_url + "/api/2.0/mlflow/users/current", auth=("erin", password),
                            timeout=30, verify=verify(team.state)).status_code  # fmt: skip

    assert who("erin-pw-0123456789") == 200
    res = _cli(
        env, "team", "user", "password", "erin", "--password-file", "-", stdin="erin-new-pw-0123456789\n"
    )
    assert res.returncode == 0, res.stderr[-2000:]
    res = _cli(
        {**env, "ERIN_PW": "erin-3rd-pw-0123456789"},
        "team",
        "user",
        "password",
        "erin",
        "--password-env",
        "ERIN_PW",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert who("erin-3rd-pw-0123456789") == 200 and who("erin-new-pw-0123456789") == 401
    # An EDIT on the shared experiment (granted by hand) is revoked by a role change: no role writes there.
    from mlflow import MlflowClient
    from mlflow.server import get_app_client

    from tests.local_services import as_admin

    with as_admin(team.state):
        admin = get_app_client("basic-auth", tracking_uri=team.state.mlflow_url)
        shared = MlflowClient(team.state.mlflow_url).get_experiment_by_name("perception-factory").experiment_id
        admin.grant_user_permission("erin", "experiment", shared, "EDIT")
        assert admin.get_user_permission("erin", "experiment", shared).permission == "EDIT"
        res = _cli(env, "team", "user", "role", "erin", "--role", "maintainer")
        assert res.returncode == 0 and "MANAGE on registered_model pfactory-detector" in res.stdout, res.stderr
        assert "experiment perception-factory " not in res.stdout + " ", res.stdout  # nothing on the shared one
        assert "MANAGE on experiment perception-factory/erin" in res.stdout, res.stdout  # her own
        assert admin.get_user_permission("erin", "experiment", shared).permission == "READ"


# ----------------------------------------------------------------------------------------------------------
# The role table (docs/OPERATIONS.md): the cells the MLflow server enforces


def test_server_enforces_the_engineer_cells(team, monkeypatch, tmp_path) -> None:
    """An engineer (alice) gets 403 from the server for: moving an alias of the production model, registering
    a version in it, deleting it, editing its tags (the role tags), deleting the shared experiment, creating a
    run in it, creating a user, granting herself a permission; an unauthenticated client gets 401. What she
    may do answers 200."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from mlflow.server import get_app_client

    from pfactory.tracking.runs import experiment_id

    team.become(monkeypatch, "bob")
    bobs = MlflowClient().create_run(experiment_id(tmp_path), tags={"pfactory.user": "bob"}).info.run_id
    exp = MlflowClient().get_experiment_by_name("perception-factory").experiment_id
    team.become(monkeypatch, "alice")
    c = MlflowClient()
    admin_api = get_app_client("basic-auth", tracking_uri=team.state.mlflow_url)
    refused = {
        "alias on production": lambda: c.set_registered_model_alias(MODEL, "champion", "1"),
        "version in production": lambda: c.create_model_version(MODEL, f"runs:/{bobs}/model", run_id=bobs),
        "delete production": lambda: c.delete_registered_model(MODEL),
        "role tag": lambda: c.set_registered_model_tag(MODEL, "pfactory.role.alice", "maintainer"),
        "delete experiment": lambda: c.delete_experiment(exp),
        "run in the shared experiment": lambda: c.create_run(exp),
        "create user": lambda: admin_api.create_user("mallory", "mallory-pw-0123456789"),
        "grant herself": lambda: admin_api.update_user_admin("alice", True),
    }
    for what, call in refused.items():
        with pytest.raises(MlflowException) as e:
            call()
        assert e.value.get_http_status_code() == 403, (what, e.value)
    # allowed: her own run in her experiment, a candidate model's tag, reading production
    mine = c.create_run(experiment_id(tmp_path), tags={"pfactory.user": "alice"}).info.run_id
    c.log_metric(mine, "eval/mAP", 0.4)
    c.set_registered_model_tag(f"{MODEL}-candidates", "note", "alice was here")
    assert c.get_registered_model(MODEL).name == MODEL
    team.become(monkeypatch, None)
    with pytest.raises(MlflowException) as e:
        MlflowClient().get_run(mine)
    assert e.value.get_http_status_code() == 401


def test_a_users_runs_are_in_their_own_experiment_and_theirs_alone_to_edit(team, monkeypatch, tmp_path) -> None:
    """The runs of each user go to their experiment `perception-factory/<user>`, which their first stage run
    creates (MLflow grants its creator MANAGE; everyone else keeps the server's default, READ). Another
    engineer (eve) and a maintainer (bob) get 403 for editing alice's run -- a metric, a tag, `pfactory.user`,
    a param, its status, deleting it -- and for adding a run to her experiment; both read it; alice edits her
    own. A stage run nests in its pipeline run's experiment. On the shared experiment (the old behaviour)
    eve's edit of alice's run answered 200."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from pfactory.tracking import identity
    from pfactory.tracking.runs import EXPERIMENT, PARENT_ENV, experiment_id, stage_run, user_experiment

    team.become(monkeypatch, "alice")
    with stage_run("train", {"lr": 0.1}, root=tmp_path) as active:  # what every stage opens
        mlflow.log_metric("eval/mAP", 0.5)
    alices = active.info.run_id
    c = MlflowClient()
    hers = c.get_experiment_by_name(user_experiment("alice"))
    assert hers is not None and active.info.experiment_id == hers.experiment_id
    assert hers.artifact_location.startswith("mlflow-artifacts:"), hers.artifact_location  # on the server
    assert experiment_id(tmp_path) == hers.experiment_id  # her next run finds it
    me = identity.current()
    shared = c.get_experiment_by_name(EXPERIMENT).experiment_id
    assert identity.permission(me, hers.experiment_id, "experiment") == "MANAGE"
    assert identity.permission(me, shared, "experiment") == "READ"
    # a pipeline's stage run: in its parent's experiment
    parent = c.create_run(hers.experiment_id, tags={"pipeline": "true"}).info.run_id
    monkeypatch.setenv(PARENT_ENV, parent)
    with stage_run("evaluate", {}, root=tmp_path) as stage:
        pass
    monkeypatch.delenv(PARENT_ENV)
    child = c.get_run(stage.info.run_id)
    assert child.info.experiment_id == hers.experiment_id and child.data.tags["mlflow.parentRunId"] == parent

    for other in ("eve", "bob"):
        team.become(monkeypatch, other)
        c = MlflowClient()
        refused = {
            "metric": lambda c=c: c.log_metric(alices, "eval/mAP", 0.99),
            "tag": lambda c=c: c.set_tag(alices, "note", "not hers"),
            "pfactory.user": lambda c=c, other=other: c.set_tag(alices, "pfactory.user", other),
            "delete tag": lambda c=c: c.delete_tag(alices, "pfactory.user"),
            "param": lambda c=c: c.log_param(alices, "train.forged", "1"),
            "status": lambda c=c: c.set_terminated(alices, "FAILED"),
            "delete run": lambda c=c: c.delete_run(alices),
            "run in her experiment": lambda c=c: c.create_run(hers.experiment_id),
        }
        for what, call in refused.items():
            with pytest.raises(MlflowException) as e:
                call()
            assert e.value.get_http_status_code() == 403, (other, what, e.value)
        run = c.get_run(alices)  # reading: yes
        assert run.data.tags["pfactory.user"] == "alice" and run.data.metrics["eval/mAP"] == 0.5, other
        assert run.info.status == "FINISHED"

    team.become(monkeypatch, "alice")  # her own run: hers to edit
    MlflowClient().set_tag(alices, "note", "mine")
    MlflowClient().log_metric(alices, "eval/mAP", 0.55)
    run = MlflowClient().get_run(alices)
    assert run.data.tags["note"] == "mine" and run.data.metrics["eval/mAP"] == 0.55


def test_an_experiment_named_for_another_user_is_refused(team, monkeypatch, tmp_path) -> None:
    """eve creates `perception-factory/frank` before frank exists (she would then manage it). Adding frank is
    refused in one line and creates nothing. A user added without their experiment (as before per-user
    experiments) whose experiment eve made first: their run is refused in one line (PermissionRefused, exit
    77) instead of logging runs she could edit. A user added now has it from the start (admin-made, MANAGE for
    the user alone), so nobody can make it first."""
    from mlflow import MlflowClient

    from pfactory.team.errors import TeamError
    from pfactory.team.users import _admin, _user_exists, add_user
    from pfactory.tracking.identity import PermissionRefused, current, permission
    from pfactory.tracking.runs import experiment_id, user_experiment
    from tests.local_services import as_admin

    from .conftest import _VARS

    uri = team.state.mlflow_url
    team.become(monkeypatch, "eve")
    MlflowClient().create_experiment(user_experiment("frank"))
    with as_admin(team.state, also=_VARS):
        with pytest.raises(TeamError) as e:
            add_user(uri, "frank", "engineer", "frank-pw-0123456789")
        assert "\n" not in str(e.value) and str(e.value).startswith(
            "experiment 'perception-factory/frank' exists already, made before user 'frank' existed"
        ), e.value
        assert not _user_exists(_admin(uri), "frank")  # nothing was created
        _admin(uri).create_user("frank", "frank-pw-0123456789")  # a user from before per-user experiments
    team.become(monkeypatch, None)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "frank")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "frank-pw-0123456789")
    with pytest.raises(PermissionRefused) as refused:
        experiment_id(tmp_path)
    assert refused.value.exit_code == 77 and "\n" not in str(refused.value)
    assert str(refused.value).startswith(
        "experiment 'perception-factory/frank': user 'frank' has READ on it, not MANAGE"
    ), refused.value

    with as_admin(team.state, also=_VARS):
        add_user(uri, "gina", "engineer", "gina-pw-0123456789")
    gina_exp = MlflowClient(uri).get_experiment_by_name(user_experiment("gina"))
    assert gina_exp is not None  # made by the admin with the user
    team.become(monkeypatch, "eve")
    with pytest.raises(Exception) as taken:  # eve cannot make it first any more: it exists
        MlflowClient().create_experiment(user_experiment("gina"))
    assert "RESOURCE_ALREADY_EXISTS" in str(taken.value)
    assert permission(current(), gina_exp.experiment_id, "experiment") == "READ"  # eve reads it, no more
    team.become(monkeypatch, None)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "gina")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "gina-pw-0123456789")
    assert experiment_id(tmp_path) == gina_exp.experiment_id  # gina manages it: her runs go there
    assert permission(current(), gina_exp.experiment_id, "experiment") == "MANAGE"


def test_compare_reads_the_runs_of_every_user(team, monkeypatch, tmp_path) -> None:
    """`factory compare` as bob (maintainer): alice's and eve's pipeline runs, each in their own experiment,
    by default (the latest finished) and by name."""
    from mlflow import MlflowClient

    from pfactory.report.compare import compare_runs
    from pfactory.tracking.runs import experiment_id

    ids = {}
    for user, m_ap in (("alice", 0.5), ("eve", 0.4)):
        team.become(monkeypatch, user)
        c = MlflowClient()
        run = c.create_run(experiment_id(tmp_path), run_name=f"{user}-run", tags={"pipeline": "true"})
        c.log_metric(run.info.run_id, "eval/mAP", m_ap)
        c.set_terminated(run.info.run_id, "FINISHED")
        ids[user] = run.info.run_id
    team.become(monkeypatch, "bob")
    latest = compare_runs(tracking_uri=team.state.mlflow_url)
    assert {r.run_id for r in latest.runs} >= set(ids.values()), latest.runs
    named = compare_runs(["alice-run", "eve-run"], tracking_uri=team.state.mlflow_url)
    assert [r.run_id for r in named.runs] == [ids["alice"], ids["eve"]]
    assert named.row("eval/mAP").values == [0.5, 0.4]
