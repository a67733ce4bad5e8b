"""One real team per test session: `mlflow server --app-name basic-auth` and `prefect server start` on
127.0.0.1 (free ports), started by `pfactory.team.services.up` exactly as `factory team up` does, with three
users -- alice and eve (engineers), bob (maintainer) -- added through MLflow's auth API; stopped at the end.
Start-up: ~12 s (MLflow) on a quiet 2-core box, over a minute under load."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.local_services import as_admin, free_port

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the repo's `tasks`
    sys.path.insert(0, str(ROOT))
PASSWORDS = {"alice": "alice-pw-0123456789", "bob": "bob-pw-0123456789", "eve": "eve-pw-0123456789"}
ROLES = {"alice": "engineer", "bob": "maintainer", "eve": "engineer"}
_VARS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_REGISTRY_URI",
         "PREFECT_API_URL", "PFACTORY_TRAIN_SLOT_LIMIT", "PFACTORY_TRAIN_SLOTS", "PFACTORY_PARENT_RUN_ID",
         "PREFECT_API_AUTH_STRING", "PREFECT_API_SSL_CERT_FILE", "MLFLOW_TRACKING_SERVER_CERT_PATH")  # fmt: skip


class Team:
    """The running team: its state and each user's environment."""

    def __init__(self, state) -> None:
        self.state = state

    def env(self, user: str | None) -> dict[str, str]:
        """The variables a user exports (None: no MLflow credentials; Prefect's auth string, which the whole
        team shares, is always there)."""
        from pfactory.team.services import admin_env, client_env

        env = {**client_env(self.state), "PFACTORY_TRAIN_SLOT_LIMIT": self.state.slot_limit}
        if user == "admin":
            env.update(admin_env(self.state))
        elif user is not None:
            env.update({"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": PASSWORDS[user]})
        return env

    def become(self, monkeypatch: pytest.MonkeyPatch, user: str | None) -> None:
        for k in _VARS:
            monkeypatch.delenv(k, raising=False)
        for k, v in self.env(user).items():
            monkeypatch.setenv(k, v)
        # mlflow.set_tracking_uri() by an earlier test in this process (an xdist worker runs many modules)
        # outranks MLFLOW_TRACKING_URI for a plain MlflowClient(): point it at this team's server too.
        import mlflow

        monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", None)

    def subprocess_env(self, user: str | None, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if k not in _VARS}
        return {**base, **self.env(user), "PYTHONPATH": str(ROOT), **extra}


@pytest.fixture(autouse=True)
def _prefect_follows_the_environment_after():
    """Prefect freezes its settings at import; `pfactory.team.slots` re-reads them when the team's
    PREFECT_API_URL differs. After a test's monkeypatch is undone (this fixture is set up before the test's
    own fixtures, so its teardown runs after theirs), re-read them again: a later test in the same xdist
    worker must not talk to this team's server."""
    yield
    if "prefect" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


@pytest.fixture(scope="module")  # stopped when tests/team/test_team.py ends: idle servers still cost CPU
def team(tmp_path_factory):
    from pfactory.team.services import down, up
    from pfactory.team.users import add_user

    d = tmp_path_factory.mktemp("team")
    state = up(d, "127.0.0.1", free_port(), free_port(), train_slots=1, slot_limit="pfactory-train-test")
    with as_admin(state, also=_VARS):
        for user, role in ROLES.items():
            add_user(state.mlflow_url, user, role, PASSWORDS[user])
    try:
        yield Team(state)
    finally:
        down(d)
