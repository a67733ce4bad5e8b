"""`factory team ...`: a team's shared services, users and training slots (pfactory/team, docs/OPERATIONS.md).

    factory team up --dir DIR [--train-slots N] [--host H --tls-cert C --tls-key K] [--group G]
                                                  start MLflow (basic auth) + Prefect (auth string) here,
                                                  state private to you (or G); print `export` lines
    factory team down --dir DIR                   stop them (their data stays in DIR)
    factory team status [--dir DIR]               what runs where, who you are, slot holders and waiters
    factory team user add NAME --role R           a user and their grants (an admin's credentials)
    factory team user role NAME --role R          another role for an existing user
    factory team user password NAME               a new password for an existing user
Passwords come from a prompt, --password-file or --password-env: never from the command line.

Imports only Typer at module level (`factory --help` stays fast); every command imports what it needs.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Annotated

import typer

team_app = typer.Typer(
    help="A team's factory: shared MLflow (users, permissions) and Prefect (training slots) services.",
    no_args_is_help=True,
)
user_app = typer.Typer(help="Team users (MLflow's own users and grants).", no_args_is_help=True)
team_app.add_typer(user_app, name="user")

DirOpt = Annotated[
    Path, typer.Option("--dir", help="The team's state folder (databases, artifacts, secrets, logs).")
]


def _say(text: str) -> None:
    typer.echo(f"{dt.datetime.now():%H:%M:%S} {text}", err=True)


@team_app.command("up")
def up_cmd(
    dir: DirOpt,
    train_slots: Annotated[int, typer.Option(min=1, help="Training slots (runs that train at once).")] = 1,
    host: Annotated[
        str, typer.Option(help="Address the servers listen on (not loopback: needs --tls-cert/--tls-key).")
    ] = "127.0.0.1",
    mlflow_port: Annotated[int, typer.Option(help="MLflow tracking server port.")] = 5000,
    prefect_port: Annotated[int, typer.Option(help="Prefect server port.")] = 4200,
    model: Annotated[str, typer.Option(help="The production registered model.")] = "pfactory-detector",
    tls_cert: Annotated[
        Path | None, typer.Option(help="PEM certificate both servers present (clients verify it).")
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option(help="Its private key (PEM, not readable by others).")
    ] = None,
    group: Annotated[
        str,
        typer.Option(help="A group that may read the team's state (default: you only; secrets: you only)."),
    ] = "",
    allow_plaintext: Annotated[
        bool,
        typer.Option(
            "--allow-plaintext", help="Accept a non-loopback --host without TLS (passwords in clear text)."
        ),
    ] = False,
) -> None:
    """Start the team's MLflow (with authentication) and Prefect (with its auth string) servers on this
    machine, create the admin, the registered models and the training-slot limit; print the `export` lines
    (stdout; progress on stderr). DIR is 0700 and everything in it owner-only (or --group's).

    Example: eval "$(factory team up --dir /srv/pfactory-team --train-slots 1)"
    """
    from pfactory.team.services import env_lines, up

    state = up(dir, host, mlflow_port, prefect_port, train_slots, model=model, say=_say, tls_cert=tls_cert,
               tls_key=tls_key, group=group, allow_plaintext=allow_plaintext)  # fmt: skip
    _say(
        f"secrets: {Path(state.dir) / 'secrets'} (0600 files: admin password, Prefect auth string, systemd env "
        f"files); stop: factory team down --dir {dir}"
    )
    for line in env_lines(state):
        typer.echo(line)


@team_app.command("down")
def down_cmd(dir: DirOpt) -> None:
    """Stop the team's servers (their databases, artifacts and secrets stay in DIR).

    Example: factory team down --dir /srv/pfactory-team
    """
    from pfactory.team.services import down

    for name, what in down(dir).items():
        typer.echo(f"{name}: {what}")


def _clock(ts: float) -> str:
    return dt.datetime.fromtimestamp(float(ts)).strftime("%H:%M:%S")


@team_app.command("status")
def status_cmd(
    dir: Annotated[
        Path | None,
        typer.Option("--dir", help="The team's state folder (default: the environment's servers)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """What runs where, who you are on the team's MLflow, who holds the training slots and who waits.

    Example: factory team status  |  factory team status --dir /srv/pfactory-team --json
    """
    from pfactory.team import slots
    from pfactory.team.services import read_state, running
    from pfactory.tracking import identity

    out: dict = {"services": {}}
    if dir is not None:
        state = read_state(dir)
        up = running(state)
        out["services"] = {
            "mlflow": {"url": state.mlflow_url, "pid": state.pids.get("mlflow"), "up": up["mlflow"]},
            "prefect": {"url": state.prefect_url, "pid": state.pids.get("prefect"), "up": up["prefect"]},
        }
        from pfactory.team.services import client_env

        try:  # the admin's own state folder: its auth string and certificate (a team member exports them)
            for k, v in client_env(state).items():
                os.environ.setdefault(k, v)
        except OSError:
            os.environ.setdefault("MLFLOW_TRACKING_URI", state.mlflow_url)
            os.environ.setdefault("PREFECT_API_URL", state.prefect_url)
        os.environ.setdefault(slots.LIMIT_ENV, state.slot_limit)
    else:
        out["services"] = {
            "mlflow": {"url": os.environ.get("MLFLOW_TRACKING_URI")},
            "prefect": {"url": os.environ.get("PREFECT_API_URL")},
        }
    ident = identity.current()
    out["you"] = {"user": identity.user_name(), "admin": ident.is_admin if ident else None,
                  "authenticated": ident is not None}  # fmt: skip
    out["slots"] = slots.status() if slots.enabled() else None
    if as_json:
        typer.echo(json.dumps(out, indent=2, default=str))
        return
    for name, s in out["services"].items():
        extra = "" if "up" not in s else f" pid {s['pid']} {'up' if s['up'] else 'NOT ANSWERING'}"
        typer.echo(f"{name:8s} {s['url'] or '(not set: embedded)'}{extra}")
    you = out["you"]
    typer.echo(f"you      {you['user']}" + (" (admin)" if you["admin"] else "") +
               ("" if you["authenticated"] else " (not authenticated by a team server)"))  # fmt: skip
    s = out["slots"]
    if s is None:
        typer.echo("slots    none (no PREFECT_API_URL: training does not wait)")
        return
    if s["slots"] is None:
        typer.echo(f"slots    limit {s['limit']!r} not created yet (the first training creates it)")
        return
    typer.echo(f"slots    {s['active']} of {s['slots']} held ({s['limit']})")
    for r in s["holding"]:
        typer.echo(
            f"  holds  {r['user']}, run {r['run']}, since {_clock(r['since'])} ({r['host']} pid {r['pid']})"
        )
    for r in s["waiting"]:
        typer.echo(
            f"  waits  {r['user']}, run {r['run']}, since {_clock(r['since'])} ({r['host']} pid {r['pid']})"
        )


PasswordFile = Annotated[
    str | None,
    typer.Option("--password-file", help="Read the password from the first line of FILE (- : stdin)."),
]
PasswordEnv = Annotated[
    str | None, typer.Option("--password-env", help="Read the password from this environment variable.")
]
ModelOpt = Annotated[str, typer.Option(help="The production registered model.")]


def _team_uri() -> str:
    from pfactory.team.errors import TeamError

    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        raise TeamError(
            "MLFLOW_TRACKING_URI is not a team server (http(s)://...): run the lines `factory team up` prints"
        )
    return uri


def _done(done: dict) -> None:
    typer.echo(
        f"{'created' if done['created'] else 'updated'} {done['user']} ({done['role']}): "
        + "; ".join(done["grants"])
    )


@user_app.command("add")
def user_add_cmd(
    name: Annotated[str, typer.Argument(help="User name (what runs, versions and audit lines record).")],
    role: Annotated[
        str, typer.Option(help="engineer (runs, registers candidates) | maintainer (also promotes).")
    ],
    password_file: PasswordFile = None,
    password_env: PasswordEnv = None,
    model: ModelOpt = "pfactory-detector",
) -> None:
    """Create a team user with their role's grants, through MLflow's auth API. Needs an admin's
    MLFLOW_TRACKING_USERNAME / PASSWORD and the team's MLFLOW_TRACKING_URI. The password is prompted for
    (twice), or read from a file or an environment variable: never given on the command line.

    Example: factory team user add alice --role engineer --password-file ~/alice.pw
    """
    from pfactory.team.users import add_user, check_role, read_password

    uri = _team_uri()
    check_role(role)  # before asking for a password
    _done(add_user(uri, name, role, read_password(name, password_file, password_env), model))


@user_app.command("role")
def user_role_cmd(
    name: Annotated[str, typer.Argument(help="An existing user.")],
    role: Annotated[str, typer.Option(help="engineer | maintainer.")],
    model: ModelOpt = "pfactory-detector",
) -> None:
    """Give an existing team user another role (its grants; a demoted maintainer keeps nothing of the role).

    Example: factory team user role alice --role maintainer
    """
    from pfactory.team.users import set_role

    _done(set_role(_team_uri(), name, role, model))


@user_app.command("password")
def user_password_cmd(
    name: Annotated[str, typer.Argument(help="An existing user.")],
    password_file: PasswordFile = None,
    password_env: PasswordEnv = None,
) -> None:
    """Set an existing team user's password (prompted for, or from a file or an environment variable).

    Example: factory team user password alice --password-env ALICE_PW
    """
    from pfactory.team.users import read_password, set_password

    uri = _team_uri()
    set_password(uri, name, read_password(name, password_file, password_env))
    typer.echo(f"updated the password of {name}")
