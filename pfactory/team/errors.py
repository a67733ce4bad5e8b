"""Errors of the team services; each message is one line naming the user, the resource and what is needed."""

from __future__ import annotations

EXIT_NOPERM = 77  # sysexits.h EX_NOPERM: "you did not have sufficient permission to perform the operation"


class TeamError(RuntimeError):
    """The team's services are not in the state a command needs (not started, a port taken, a bad DIR)."""


class PermissionRefused(RuntimeError):
    """The MLflow server does not grant the authenticated user what an operation needs (exit 77).

    Raised before anything changes; the message names the user, the model and the permission needed."""

    def __init__(
        self, message: str, user: str = "", model: str = "", needed: str = "", has: str = ""
    ) -> None:
        super().__init__(message)
        self.user, self.model, self.needed, self.has = user, model, needed, has

    def __str__(self) -> str:
        return str(self.args[0])


class NotAuthenticated(RuntimeError):
    """The MLflow server answered 401: no or wrong credentials (exit 77)."""

    def __str__(self) -> str:
        return str(self.args[0])


def unauthenticated_message(uri: str, user: str | None) -> str:
    """The one line for a 401 (the URI without its user info: no password in it)."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    where = f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}{parts.path}" if parts.netloc else uri
    who = f"user {user!r} and its password" if user else "no MLFLOW_TRACKING_USERNAME / PASSWORD set"
    return (
        f"the MLflow server {where} refused the request: 401 not authenticated ({who}); export "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD of your team account (an admin creates it: "
        "factory team user add)"
    )


def explain_mlflow(exc: BaseException) -> tuple[str, int] | None:
    """One line + exit 77 for an MLflow 401 / 403 anywhere in `exc`'s chain (a client call the factory did
    not check first), else None. Used by `pfactory.failures.explain`."""
    import os

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = getattr(e, "error_code", None)
        if type(e).__name__ in ("MlflowException", "RestException") and code in (
            "UNAUTHENTICATED",
            "PERMISSION_DENIED",
        ):
            uri = os.environ.get("MLFLOW_TRACKING_URI", "")
            user = os.environ.get("MLFLOW_TRACKING_USERNAME")
            if code == "UNAUTHENTICATED":
                return unauthenticated_message(uri, user), EXIT_NOPERM
            endpoint = str(e).split("endpoint ", 1)[-1].split(" ", 1)[0] if "endpoint " in str(e) else "?"
            return (f"the MLflow server refused user {user!r}: 403 permission denied ({endpoint}); an admin grants "
                    "permissions (factory team user add NAME --role ...)"), EXIT_NOPERM  # fmt: skip
        e = e.__cause__ or e.__context__
    return None
