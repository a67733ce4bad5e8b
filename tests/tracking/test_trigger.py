"""`pfactory.tracking.trigger`: who triggered a flow run, backed by a record only that user could write (their
own experiment on a team's MLflow server), checked on the worker's side. Real servers (tests/team's fixture)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.team.conftest import team  # noqa: F401 - the team's servers (module scope)


def test_a_trigger_is_verified_only_from_the_claimed_users_own_record(team, monkeypatch, tmp_path: Path) -> None:  # noqa: F811
    from mlflow import MlflowClient

    from pfactory.tracking.trigger import (
        FLOW_RUN_TAG,
        RECORD_PREFIX,
        TRIGGERED_BY,
        VERIFIED,
        bind_trigger,
        claims,
        record_trigger,
        verify_trigger,
    )

    monkeypatch.chdir(tmp_path)
    team.become(monkeypatch, "alice")
    record = record_trigger("dep-1")
    assert record is not None
    bind_trigger(record, "flow-run-1")
    team.become(monkeypatch, "eve")
    forged = record_trigger("dep-1")  # eve's own record: it can only be in her experiment
    bind_trigger(forged, "flow-run-2")
    with pytest.raises(Exception) as refused:  # nor can she rebind alice's record to her flow run
        MlflowClient().set_tag(record, FLOW_RUN_TAG, "flow-run-2")
    assert "403" in str(refused.value) or "PERMISSION_DENIED" in str(refused.value), refused.value

    team.become(monkeypatch, "bob")  # the worker's account: reads everyone's experiments
    tags = ["pfactory.triggered-by:alice", RECORD_PREFIX + record]
    assert claims(tags) == ("alice", record)
    ok = verify_trigger("alice", record, "flow-run-1", wait_s=0)
    assert ok[TRIGGERED_BY] == "alice" and ok[VERIFIED].startswith("yes: record"), ok
    # eve claims alice with her own record; alice's record on another flow run; no record; nothing claimed
    assert verify_trigger("alice", forged, "flow-run-2", wait_s=0)[VERIFIED].startswith(
        f"no: record {forged} is in 'perception-factory/eve', not alice's experiment"
    )
    assert verify_trigger("alice", record, "flow-run-2", wait_s=0)[VERIFIED] == (
        f"no: record {record} names flow run flow-run-1, not flow-run-2"
    )
    assert verify_trigger("alice", None, "flow-run-1")[VERIFIED].startswith("no: no MLflow record")
    assert verify_trigger(None, None, "flow-run-1") == {}
    team.become(monkeypatch, "alice")
    unbound = record_trigger("dep-1")
    team.become(monkeypatch, "bob")
    assert verify_trigger("alice", unbound, "flow-run-3", wait_s=1)[VERIFIED] == (
        f"no: record {unbound} names no flow run after 1 s, not flow-run-3"
    )


def test_no_record_without_per_user_experiments(tmp_path: Path, monkeypatch) -> None:
    """A local store (no team): one experiment anyone writes to, so nothing could back a claim."""
    from pfactory.tracking.trigger import record_trigger

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    assert record_trigger("dep-1") is None
