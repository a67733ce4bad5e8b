"""pfactory.tracking.runs: orphaned runs reaped, URIs redacted, an unreachable server refused in seconds."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from pfactory.tracking.runs import (
    TrackingUnavailable,
    check_tracking_server,
    process_tags,
    reap_orphan_runs,
    redact_uri,
)


def test_runs_of_dead_processes_are_reaped_live_ones_kept(tmp_path, monkeypatch) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient()
    exp = client.create_experiment("e")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    tags = process_tags()
    orphan = client.create_run(exp, tags={**tags, "pfactory.pid": dead.stdout.strip()}).info.run_id
    mine = client.create_run(exp, tags=tags).info.run_id  # this process: alive
    untagged = client.create_run(exp).info.run_id  # not ours to judge
    assert reap_orphan_runs(exp) == [orphan]
    assert client.get_run(orphan).info.status == "KILLED"
    assert client.get_run(orphan).data.tags["pfactory.ended_by"].startswith("reaped: process")
    assert client.get_run(mine).info.status == "RUNNING" and client.get_run(untagged).info.status == "RUNNING"


@pytest.mark.parametrize(
    "uri, shown",
    [
        ("http://me:s3cret@host:5000", "http://me:***@host:5000"),
        ("https://token@host/path", "https://***@host/path"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("sqlite:////tmp/x/mlflow.db", "sqlite:////tmp/x/mlflow.db"),
    ],
)
def test_redact_uri(uri: str, shown: str) -> None:
    assert redact_uri(uri) == shown


def test_an_unreachable_server_is_refused_in_seconds() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    uri = f"http://user:pw@127.0.0.1:{port}"
    t0 = time.perf_counter()
    with pytest.raises(TrackingUnavailable, match=r"user:\*\*\*@127\.0\.0\.1") as info:
        check_tracking_server(uri, timeout_s=2)
    assert time.perf_counter() - t0 < 10 and "pw" not in str(info.value)
    check_tracking_server("sqlite:///x.db")  # not a server: nothing to check


def test_the_device_tag_does_not_import_torch_where_it_is_not_used() -> None:
    """A stage or flow that has not imported torch gets its device tag without importing it (~1.5 s)."""
    import subprocess
    import sys

    code = "import sys; from pfactory.runtime.lineage import device_info; print(device_info(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == "False", out
    assert out[0].startswith(("cpu:", "cuda:")), out


def test_the_gpu_name_is_read_from_the_nvidia_drivers_information_file(tmp_path) -> None:
    from pfactory.runtime.lineage import _nvidia_gpu

    assert _nvidia_gpu(tmp_path / "absent") is None
    (tmp_path / "0000:01:00.0").mkdir()
    (tmp_path / "0000:01:00.0" / "information").write_text("Model: \t\t NVIDIA H200\nIRQ:   145\n")
    (tmp_path / "0000:02:00.0").mkdir()
    (tmp_path / "0000:02:00.0" / "information").write_text("Model: \t\t NVIDIA L4\n")
    assert _nvidia_gpu(tmp_path) == "NVIDIA H200"  # the first GPU by bus id


def test_without_a_team_runs_stay_in_the_shared_experiment(tmp_path, monkeypatch) -> None:
    """A sqlite store (no authentication): a stage run goes to `perception-factory`, artifacts under the
    project, as `factory run` always did; a nested stage run goes to its parent's experiment, whichever that
    is; `experiment_ids` finds the shared experiment and the per-user ones `perception-factory/<user>`, not
    another name that merely starts the same."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from pfactory.tracking.runs import (
        EXPERIMENT,
        PARENT_ENV,
        artifact_location,
        experiment_ids,
        own_experiment,
        stage_run,
        user_experiment,
    )

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv(PARENT_ENV, raising=False)
    mlflow.set_tracking_uri(uri)
    assert own_experiment() == EXPERIMENT
    with stage_run("prepare", {"seed": 1}, root=tmp_path) as run:
        pass
    client = MlflowClient()
    shared = client.get_experiment_by_name(EXPERIMENT)
    assert run.info.experiment_id == shared.experiment_id
    assert shared.artifact_location == artifact_location(tmp_path)

    other = client.create_experiment("elsewhere")
    parent = client.create_run(other).info.run_id
    monkeypatch.setenv(PARENT_ENV, parent)
    with stage_run("train", {"lr": 0.1}, root=tmp_path) as child:
        pass
    assert child.info.experiment_id == other  # with its parent, not in the shared experiment
    assert client.get_run(child.info.run_id).data.tags["mlflow.parentRunId"] == parent

    alice = client.create_experiment(user_experiment("alice"))
    client.create_experiment(EXPERIMENT + "-old")
    client.create_experiment("perception_factory/bob")  # `_` is LIKE's one-character wildcard
    assert experiment_ids(client) == [shared.experiment_id, alice]
    assert experiment_ids(client, "nothing-here") == []
