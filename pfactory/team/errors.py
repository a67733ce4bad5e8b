"""Errors of the team services; each message is one line naming the user, the resource and what is needed."""

from __future__ import annotations

from pfactory.failures import EXIT_NOPERM, EXIT_USAGE, UserError, unauthenticated_message

__all__ = ["EXIT_NOPERM", "NotAuthenticated", "PermissionRefused", "TeamError", "unauthenticated_message"]


class TeamError(UserError, RuntimeError):
    """The team's services are not in the state a command needs (not started, a port taken, a bad DIR)."""

    exit_code = EXIT_USAGE


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
