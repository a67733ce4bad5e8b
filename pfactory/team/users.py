"""`factory team user add NAME --role maintainer|engineer --password P`: users and grants through MLflow's auth API.

In:  an admin's credentials in the environment (`MLFLOW_TRACKING_USERNAME` / `MLFLOW_TRACKING_PASSWORD`, the
     lines `factory team up` prints), the team's tracking URI.
Out: the user in MLflow's user store (`mlflow.server.get_app_client("basic-auth").create_user`) and these grants
     (`grant_user_permission`), everything else staying at the server's default (READ):
       role        experiment perception-factory   <model>-candidates   <model> (production)
       engineer    EDIT (runs, models)             EDIT (register)      READ (default)
       maintainer  EDIT                            MANAGE               MANAGE (copy versions in, move champion)
     The role is also written on the production model as tags `pfactory.role.<name>` and the list
     `pfactory.maintainers`, which every user can read: a refused promotion says who may do it.

Why two registered models: EDIT on a registered model allows registering a version *and* setting an alias
(MLflow's permission model), so "may register a candidate" and "may move champion" must be two models
(FEASIBILITY.md 2026-12-03; MLflow's documented promotion across environments: `copy_model_version`).
"""

from __future__ import annotations

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


def grants(role: str, experiment_id: str, model: str) -> list[tuple[str, str, str]]:
    """(resource type, resource id, permission) of a role (module docstring)."""
    if role not in ROLES:
        raise TeamError(f"--role {role!r}: expected one of {', '.join(ROLES)}")
    out = [("experiment", experiment_id, "EDIT")]
    if role == "engineer":
        return [*out, ("registered_model", candidates_name(model), "EDIT")]
    return [
        *out,
        ("registered_model", candidates_name(model), "MANAGE"),
        ("registered_model", model, "MANAGE"),
    ]


def add_user(uri: str, name: str, role: str, password: str, model: str = DEFAULT_MODEL) -> dict[str, Any]:
    """Create user `name` (or, if it exists, set its password) with `role`'s grants; returns what was done."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from mlflow.server import get_app_client

    if role not in ROLES:
        raise TeamError(f"--role {role!r}: expected one of {', '.join(ROLES)}")
    admin = get_app_client("basic-auth", tracking_uri=uri)
    created = True
    try:
        admin.create_user(name, password)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        admin.update_user_password(name, password)
        created = False
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        raise TeamError(f"{uri} has no experiment {EXPERIMENT!r}: run `factory team up` first")
    given = grants(role, exp.experiment_id, model)
    if role == "engineer":  # a demoted maintainer keeps nothing of the role
        for kind, resource in (("registered_model", model),):
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
    return {"user": name, "role": role, "created": created,
            "grants": [f"{p} on {k} {r}" for k, r, p in given]}  # fmt: skip


def maintainers(client: Any, model: str) -> list[str]:
    """The maintainers recorded on the production model (empty when unknown)."""
    from mlflow.exceptions import MlflowException

    try:
        tags = client.get_registered_model(model).tags or {}
    except MlflowException:
        return []
    return sorted(m for m in tags.get(MAINTAINERS_TAG, "").split(",") if m)
