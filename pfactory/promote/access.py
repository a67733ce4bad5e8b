"""Who may do what to the registry of a team (DESIGN.md §8b), checked before anything changes.

In:  an `MlflowClient`, the production model's name (`promote.model_name`).
Out: `team()` -> the authenticated `Identity` when the registry is a team's MLflow server with basic auth,
     None for the embedded default (a sqlite store, or a server without auth: one user, a maintainer).
     With a team, candidates are registered in `<model>-candidates` (`candidates_model`) and promotion copies
     a gated candidate into `<model>` (`copy_model_version`) before moving the alias there.
     `require(...)`: `PermissionRefused` (exit 77) naming the user, the model and the permission needed when
     the server does not grant it, after writing the refusal into the audit trail of the candidates model
     (the one registered model an engineer may write to); the production model is untouched.

The server enforces the same rule on its own (an engineer's direct `set_registered_model_alias` on `<model>`
gets 403): this check only makes the refusal early, one line, and audited.
"""

from __future__ import annotations

from typing import Any

from pfactory.promote import registry as reg
from pfactory.tracking.identity import PermissionRefused

PROMOTE_NEEDS = "EDIT"  # copy_model_version into the model and set_registered_model_alias on it
USER_TAG = "pfactory.user"


def team() -> Any:
    """The authenticated `Identity` of the registry's server, None without a team (module docstring)."""
    from pfactory.tracking.identity import current

    return current(reg.registry_uri())


def candidates_model(model: str) -> str:
    from pfactory.team.services import candidates_name

    return candidates_name(model)


def registering_model(model: str) -> str:
    """Where a new candidate of `model` is registered: `<model>-candidates` with a team, else `model`."""
    return candidates_model(model) if team() is not None else model


def who_may(c: Any, model: str) -> str:
    """`maintainers bob, carol` from the production model's tags, else who holds the permission."""
    from pfactory.team.users import maintainers

    names = maintainers(c, model)
    return (
        f"maintainers: {', '.join(names)}"
        if names
        else f"a user with {PROMOTE_NEEDS} on {model} (a maintainer)"
    )


def may(ident: Any, model: str, needed: str = PROMOTE_NEEDS) -> tuple[bool, str]:
    """(whether `ident` has `needed` on registered model `model`, the permission it has)."""
    from pfactory.tracking.identity import allows, permission

    has = permission(ident, model)
    return allows(has, needed), has


def refusal(
    c: Any, ident: Any, model: str, action: str, has: str, needed: str = PROMOTE_NEEDS
) -> PermissionRefused:
    """The one-line refusal of `action` on `model` for `ident`."""
    return PermissionRefused(
        f"{action} refused: user {ident.username!r} has {has} on registered model {model!r}; {action} needs "
        f"{needed} ({who_may(c, model)}); nothing was changed",
        user=ident.username, model=model, needed=needed, has=has,
    )  # fmt: skip


def audit_refusal(c: Any, err: PermissionRefused, action: str, champion: int | None, version: int | None,
                  model: str, run_id: str | None = None) -> str:  # fmt: skip
    """Write the refusal as an audit record `refused-<action>` of the candidates model; returns where (or why
    not: a user without EDIT there cannot write it, and says so)."""
    from mlflow.exceptions import MlflowException

    where = candidates_model(model)
    record = {
        "id": reg.next_audit_id(c, where), "action": f"refused-{action}", "from": champion, "to": version,
        "at": reg.now_iso(), "by": reg.actor(), "run_id": run_id,
        "reason": f"{err.user} has {err.has} on {model}, {action} needs {err.needed}; {model} unchanged",
    }  # fmt: skip
    try:
        reg.write_audit(c, where, record)
    except MlflowException as e:
        return f"not audited ({e.error_code} writing to {where})"
    return f"audit record {record['id']} of {where}"


def require(c: Any, ident: Any, model: str, action: str, champion: int | None = None,
            version: int | None = None, run_id: str | None = None) -> None:  # fmt: skip
    """`PermissionRefused` (audited, nothing else changed) unless `ident` may `action` on `model`."""
    if ident is None:
        return
    ok, has = may(ident, model)
    if ok:
        return
    err = refusal(c, ident, model, action, has)
    where = audit_refusal(c, err, action, champion, version, model, run_id)
    err.args = (f"{err.args[0]} ({where})",)
    raise err
