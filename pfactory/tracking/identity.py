"""Who is calling, as the MLflow server authenticated them, and what the server grants them.

In:  the tracking/registry URI and MLflow's own credential and TLS variables (`MLFLOW_TRACKING_USERNAME`,
     `MLFLOW_TRACKING_PASSWORD`, `MLFLOW_TRACKING_SERVER_CERT_PATH`), the same ones every MLflow client call
     sends and verifies with.
Out: `current()` -> `Identity(username, is_admin, uri)` when the server runs MLflow's basic-auth app
     (`GET /api/2.0/mlflow/users/current` answers 200), None for a sqlite store or a server without auth
     (the embedded default: one user, a maintainer); `NotAuthenticated` when the server answers 401.
     `permission(identity, resource, resource_type)`: the effective permission name the server resolves for
     that user on a registered model or an experiment (`GET /api/3.0/mlflow/users/permissions/get`, which a
     user may ask about themselves),
     `user_name()`: the name every run, version, alias move and audit line records.

Why ask the server instead of trusting a local setting: MLflow stores `user_id` "unknown" on runs and nothing
on versions in server mode (FEASIBILITY.md, MLflow 3.17.2), and the OS account is not the person; the
authenticated name is what the server enforces its permissions on, so it is the one recorded.
"""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass

from pfactory.runtime.failures import EXIT_NOPERM, UserError, unauthenticated_message


class PermissionRefused(UserError, RuntimeError):
    """The MLflow server does not grant the authenticated user what an operation needs (exit 77).

    Raised before anything changes; the message names the user, the model and the permission needed."""

    exit_code = EXIT_NOPERM

    def __init__(
        self, message: str, user: str = "", model: str = "", needed: str = "", has: str = ""
    ) -> None:
        super().__init__(message)
        self.user, self.model, self.needed, self.has = user, model, needed, has


class NotAuthenticated(UserError, RuntimeError):
    """The MLflow server answered 401: no or wrong credentials (exit 77)."""

    exit_code = EXIT_NOPERM


CURRENT_USER = "/api/2.0/mlflow/users/current"
USER_PERMISSION = "/api/3.0/mlflow/users/permissions/get"
TIMEOUT_S = 30.0
# Permission names in MLflow's order (mlflow.server.auth.permissions): what each one allows includes the
# ones before it; DENY and NO_PERMISSIONS allow nothing.
ORDER = ("NO_PERMISSIONS", "READ", "USE", "EDIT", "MANAGE")


@dataclass(frozen=True)
class Identity:
    """A user the MLflow server authenticated."""

    username: str
    is_admin: bool
    uri: str
    """The server that authenticated them (http(s) tracking URI, no credentials in it)."""


_CACHE: dict[tuple[str, str], Identity | None] = {}


def _uri() -> str:
    return os.environ.get("MLFLOW_REGISTRY_URI") or os.environ.get("MLFLOW_TRACKING_URI", "")


def _auth() -> tuple[str, str] | None:
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    return (user, os.environ.get("MLFLOW_TRACKING_PASSWORD", "")) if user else None


def tls_verify() -> str | bool:
    """What a request to the MLflow server verifies its certificate with, as MLflow's own client does:
    `MLFLOW_TRACKING_SERVER_CERT_PATH` (a CA bundle or the server's self-signed certificate), nothing when
    `MLFLOW_TRACKING_INSECURE_TLS=true`, else the default CAs."""
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("true", "1"):
        return False
    return os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or True


def current(uri: str | None = None) -> Identity | None:
    """The authenticated user of an http(s) MLflow server with basic auth; None for a sqlite store or a
    server without auth. `NotAuthenticated` on a 401. One request per process and credentials."""
    uri = (uri or _uri()).rstrip("/")
    if not uri.startswith(("http://", "https://")):
        return None
    auth = _auth()
    key = (uri, auth[0] if auth else "")
    if key in _CACHE:
        return _CACHE[key]
    import requests

    r = requests.get(uri + CURRENT_USER, auth=auth, timeout=TIMEOUT_S, verify=tls_verify())
    if r.status_code == 401:
        raise NotAuthenticated(unauthenticated_message(uri, auth[0] if auth else None))
    ident = None
    if r.status_code == 200:
        try:
            user = r.json()["user"]
            ident = Identity(str(user["username"]), bool(user.get("is_admin")), uri)
        except (ValueError, KeyError, TypeError):
            ident = None  # another app on that path: not MLflow's auth
    _CACHE[key] = ident
    return ident


def os_user() -> str:
    """The OS account of this process (the embedded default's user)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry / no login name in a container
        return f"uid{os.getuid()}"


def user_name() -> str:
    """The name recorded on runs, versions, alias moves and audit lines: the authenticated user of a team
    server, else `MLFLOW_TRACKING_USERNAME` (a server without auth), else the OS account."""
    ident = current()
    if ident is not None:
        return ident.username
    return os.environ.get("MLFLOW_TRACKING_USERNAME") or os_user()


def permission(ident: Identity, resource: str, resource_type: str = "registered_model") -> str:
    """The effective permission the server resolves for `ident` on `resource`: a registered model's name, or
    with `resource_type="experiment"` an experiment's id (MANAGE for an admin: admins pass every check)."""
    if ident.is_admin:
        return "MANAGE"
    import requests

    r = requests.get(
        ident.uri + USER_PERMISSION,
        params={"username": ident.username, "resource_type": resource_type, "resource_id": resource},
        auth=_auth(),
        timeout=TIMEOUT_S,
        verify=tls_verify(),
    )
    if r.status_code == 401:
        raise NotAuthenticated(unauthenticated_message(ident.uri, ident.username))
    r.raise_for_status()
    return str(r.json().get("permission") or "NO_PERMISSIONS")


def allows(has: str, needed: str) -> bool:
    """Whether permission `has` includes `needed` (MLflow's order; DENY allows nothing)."""
    return has in ORDER and ORDER.index(has) >= ORDER.index(needed)
