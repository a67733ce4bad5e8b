"""Errors of the team services (who may do what is `pfactory.tracking.identity`); each message is one line naming the user, the resource and what is needed."""

from __future__ import annotations

from pfactory.runtime.failures import EXIT_USAGE, UserError

__all__ = ["TeamError"]


class TeamError(UserError, RuntimeError):
    """The team's services are not in the state a command needs (not started, a port taken, a bad DIR)."""

    exit_code = EXIT_USAGE
