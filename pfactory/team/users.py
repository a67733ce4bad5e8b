"""`factory team user add|password|role`: users and grants through MLflow's auth API.

In:  an admin's credentials in the environment (`MLFLOW_TRACKING_USERNAME` / `MLFLOW_TRACKING_PASSWORD`, the
     lines `factory team up` prints), the team's tracking URI; a password from a prompt, a file or an
     environment variable (`read_password`), never from the command line (`ps`, shell history).
Out: `add_user`: a new user in MLflow's user store (`mlflow.server.get_app_client("basic-auth").create_user`)
     and these grants (`grant_user_permission`), everything else staying at the server's default (READ);
     `set_role`: an existing user's grants for another role; `set_password`: an existing user's password.
       role        experiment perception-factory/<user>   <model>-candidates   <model> (production)
       engineer    MANAGE (their runs)                    EDIT (register)      READ (default)
       maintainer  MANAGE (their runs)                    MANAGE               MANAGE (copy versions in, move champion)
     A user's runs go to `perception-factory/<user>` (`pfactory.tracking.runs.experiment_id`), which the admin
     creates when adding the user and on which the user alone is granted MANAGE (`_own_experiment`): created
     here, before the user exists, nobody else can create it first and so manage it (MLflow's auth app gives
     an experiment's creator MANAGE). `add_user` refuses a name whose experiment exists already (someone
     made it before the user existed). Every other user's experiment and the shared `perception-factory` stay
     READ for them, so nobody edits another user's runs, metrics or tags. A grant on the shared experiment
     left from an earlier role is revoked.
     The role is also written on the production model as tags `pfactory.role.<name>` and the list
     `pfactory.maintainers`, which every user can read: a refused promotion says who may do it.
     Every refusal of the server's admin API -- a password the server's rule refuses (MLflow: at least 12
     characters), a user that exists (add) or does not (password, role), an unknown role -- is a `TeamError`:
     one line naming the field and the rule, exit 2, nothing changed.

Why two registered models: EDIT on a registered model allows registering a version *and* setting an alias
(MLflow's permission model), so "may register a candidate" and "may move champion" must be two models
(FEASIBILITY.md 2026-12-03; MLflow's documented promotion across environments: `copy_model_version`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pfactory.team.errors import TeamError
from pfactory.team.services import DEFAULT_MODEL, EXPERIMENT, candidates_name

ROLES = ("engineer", "maintainer")
MAINTAINERS_TAG = "pfactory.maintainers"
ROLE_TAG = "pfactory.role."


def _grant(admin: Any, user: str, kind: str, resource: str, permission: str) -> None:
    """Grant, or replace an earlier grant of the same resource (the API refuses a second grant)."""
    from mlflow.exceptions import MlflowException

    try:
        admin.grant_user_permission(user, kind, resource, permission)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        admin.revoke_user_permission(user, kind, resource)
        admin.grant_user_permission(user, kind, resource, permission)


def grants(role: str, model: str) -> list[tuple[str, str, str]]:
    """(resource type, resource id, permission) a role is granted for production model `model` (module
    docstring): registered models only; a user's own experiment is granted apart (`_own_experiment`)."""
    if role not in ROLES:
        raise TeamError(f"--role {role!r}: expected one of {', '.join(ROLES)}")
    if role == "engineer":
        return [("registered_model", candidates_name(model), "EDIT")]
    return [
        ("registered_model", candidates_name(model), "MANAGE"),
        ("registered_model", model, "MANAGE"),
    ]


def _no_such_user(name: str) -> TeamError:
    return TeamError(
        f"user {name!r}: no such user on the team's server (add it: factory team user add {name} --role R)"
    )


def _refusal(e: Any, name: str) -> TeamError | None:
    """The one-line `TeamError` for a refusal of MLflow's user API (`MlflowException` `e`), else None (a 401 /
    403 stays MLflow's: `pfactory.runtime.failures.mlflow_refusal`, exit 77)."""
    code, msg = e.error_code, str(getattr(e, "message", e)).strip().rstrip(".")
    # the REST client's form: "INVALID_PARAMETER_VALUE: Password must be at least 12 characters."
    msg = msg.removeprefix(f"{code}: ")
    if code == "RESOURCE_ALREADY_EXISTS":
        return TeamError(
            f"user {name!r}: exists already (a name is added once); change its role with `factory team user role "
            f"{name} --role R`, its password with `factory team user password {name}`"
        )
    if code == "RESOURCE_DOES_NOT_EXIST":
        return _no_such_user(name)
    if code == "INVALID_PARAMETER_VALUE":
        field = "password" if "password" in msg.lower() else "user name"
        return TeamError(f"{field} of user {name!r}: {msg} (the MLflow server's rule); nothing was changed")
    return None


def _admin(uri: str) -> Any:
    from mlflow.server import get_app_client

    return get_app_client("basic-auth", tracking_uri=uri)


def check_role(role: str) -> None:
    """TeamError (one line, exit 2) unless `role` is one of ROLES."""
    if role not in ROLES:
        raise TeamError(f"--role {role!r}: expected one of {', '.join(ROLES)}")


def _user_exists(admin: Any, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        admin.get_user(name)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise (_refusal(e, name) or e) from None
    return True


def _refuse_made_before(uri: str, name: str) -> None:
    """TeamError when user `name`'s experiment (`user_experiment`) exists before the user does: whoever made it
    manages it (MLflow grants an experiment's creator MANAGE), so the user's runs would not be theirs alone."""
    from mlflow import MlflowClient

    from pfactory.tracking.runs import user_experiment

    exp_name = user_experiment(name)
    exp = MlflowClient(uri).get_experiment_by_name(exp_name)
    if exp is not None:
        raise TeamError(
            f"experiment {exp_name!r} exists already, made before user {name!r} existed: whoever made it manages "
            f"it, so the user's runs would not be theirs alone; an admin deletes it (`mlflow experiments delete "
            f"--experiment-id {exp.experiment_id}`, then `mlflow gc`) and adds the user again"
        )


def _own_experiment(uri: str, admin: Any, name: str) -> tuple[str, str, str]:
    """User `name`'s experiment (`user_experiment`), created now with the admin's credentials when missing, and
    MANAGE on it for `name`; returns that grant."""
    from mlflow import MlflowClient

    from pfactory.tracking.runs import EXPERIMENT_KIND, user_experiment

    c = MlflowClient(uri)
    exp_name = user_experiment(name)
    exp = c.get_experiment_by_name(exp_name)
    exp_id = exp.experiment_id if exp is not None else c.create_experiment(exp_name, tags=EXPERIMENT_KIND)
    _grant(admin, name, "experiment", exp_id, "MANAGE")
    return ("experiment", exp_name, "MANAGE")


def _apply_role(uri: str, admin: Any, name: str, role: str, model: str) -> list[tuple[str, str, str]]:
    """`role`'s grants for `name` (a demoted maintainer keeps nothing of the role) and the role tags."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        raise TeamError(f"{uri} has no experiment {EXPERIMENT!r}: run `factory team up` first")
    given = grants(role, model)
    # What no role holds: a grant on the shared experiment (an earlier one is revoked), and for an engineer
    # the production model.
    revoked = [("experiment", exp.experiment_id)]
    if role == "engineer":
        revoked.append(("registered_model", model))
    for kind, resource in revoked:
        try:
            admin.revoke_user_permission(name, kind, resource)
        except MlflowException as e:
            if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
    for kind, resource, permission in given:
        _grant(admin, name, kind, resource, permission)
    tags = c.get_registered_model(model).tags or {}
    maintainers = {m for m in tags.get(MAINTAINERS_TAG, "").split(",") if m}
    maintainers = maintainers | {name} if role == "maintainer" else maintainers - {name}
    c.set_registered_model_tag(model, ROLE_TAG + name, role)
    c.set_registered_model_tag(model, MAINTAINERS_TAG, ",".join(sorted(maintainers)))
    return given


def add_user(uri: str, name: str, role: str, password: str, model: str = DEFAULT_MODEL) -> dict[str, Any]:
    """Create user `name` with their own experiment and `role`'s grants; returns what was done. TeamError (one
    line, nothing changed) for an unknown role, a user that exists, an experiment of that name made before
    the user (`_refuse_made_before`), a password or name the server's rules refuse."""
    from mlflow.exceptions import MlflowException

    check_role(role)
    admin = _admin(uri)
    if not _user_exists(admin, name):  # (a user that exists is refused by create_user below)
        _refuse_made_before(uri, name)  # before anything is created
    try:
        admin.create_user(name, password)
    except MlflowException as e:
        raise (_refusal(e, name) or e) from None
    given = [_own_experiment(uri, admin, name), *_apply_role(uri, admin, name, role, model)]
    return {"user": name, "role": role, "created": True,
            "grants": [f"{p} on {k} {r}" for k, r, p in given]}  # fmt: skip


def _existing(admin: Any, name: str) -> None:
    """TeamError (one line) unless user `name` exists."""
    if not _user_exists(admin, name):
        raise _no_such_user(name)


def set_role(uri: str, name: str, role: str, model: str = DEFAULT_MODEL) -> dict[str, Any]:
    """Give existing user `name` `role`'s grants (and no more of the other role's); returns what was done.
    TeamError for an unknown role or user."""
    check_role(role)
    admin = _admin(uri)
    _existing(admin, name)
    given = [_own_experiment(uri, admin, name), *_apply_role(uri, admin, name, role, model)]
    return {"user": name, "role": role, "created": False,
            "grants": [f"{p} on {k} {r}" for k, r, p in given]}  # fmt: skip


def set_password(uri: str, name: str, password: str) -> None:
    """Set existing user `name`'s password. TeamError for an unknown user or a password the server refuses."""
    from mlflow.exceptions import MlflowException

    admin = _admin(uri)
    _existing(admin, name)
    try:
        admin.update_user_password(name, password)
    except MlflowException as e:
        raise (_refusal(e, name) or e) from None


PASSWORD_SOURCES = "--password-file FILE (- for stdin), --password-env VARIABLE, or a terminal to be prompted"


def read_password(name: str, file: str | None = None, env: str | None = None, prompt: Any = None) -> str:
    """User `name`'s new password from `file` (its first line; "-": stdin), the environment variable `env`,
    else `prompt()` (asked twice on a terminal). Never from the command line. TeamError (one line) when
    none is given, the file or variable is missing, or the two prompts differ."""
    import sys

    if file and env:
        raise TeamError("password: give --password-file or --password-env, not both")
    if file:
        try:
            text = sys.stdin.readline() if file == "-" else Path(file).read_text()
        except OSError as e:
            raise TeamError(f"--password-file {file}: {e.strerror}") from None
        lines = text.splitlines()
        return lines[0] if lines else ""
    if env:
        if env not in os.environ:
            raise TeamError(f"--password-env {env}: no such environment variable")
        return os.environ[env]
    if prompt is None:
        if not sys.stdin.isatty():
            raise TeamError(
                f"password of user {name!r}: not given; use {PASSWORD_SOURCES} (never the command line)"
            )
        import getpass

        def prompt() -> str:
            first = getpass.getpass(f"password for {name}: ")
            if getpass.getpass(f"password for {name} (again): ") != first:
                raise TeamError(f"password of user {name!r}: the two entries differ; nothing was changed")
            return first

    return str(prompt())


def maintainers(client: Any, model: str) -> list[str]:
    """The maintainers recorded on the production model (empty when unknown)."""
    from mlflow.exceptions import MlflowException

    try:
        tags = client.get_registered_model(model).tags or {}
    except MlflowException:
        return []
    return sorted(m for m in tags.get(MAINTAINERS_TAG, "").split(",") if m)
