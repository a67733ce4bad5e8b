"""Errors of the registry and promotion code; each message names the file/field/version and what was expected."""

from __future__ import annotations

from pfactory.runtime.failures import EXIT_FAILED, EXIT_USAGE, UserError


class RegistryError(UserError, RuntimeError):
    """The registry is not in the state an operation needs (unknown version, no champion, no previous one)."""

    exit_code = EXIT_FAILED


class EvidenceError(UserError, ValueError):
    """A candidate's evidence file (kpis.json, parity.json, latency.json, backend.json) is missing or malformed."""

    exit_code = EXIT_FAILED


class LockTimeout(RegistryError):
    """Another promotion held the registry lock longer than `promote.lock_timeout_s`."""


class UnknownRef(RegistryError):
    """A version, alias or run that the registry / tracking server does not have: bad input, nothing changed."""

    exit_code = EXIT_USAGE


class PromotionRefused(UserError):
    """The gates refused the candidate (`factory promote` without --no-fail-if-refused): nothing was promoted."""

    exit_code = EXIT_FAILED
    hint = "the gate table above says which gate failed by how much; params.promote sets the gates"
