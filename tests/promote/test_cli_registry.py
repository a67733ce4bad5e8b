"""`factory promote | rollback | lineage` against a real sqlite registry, the registry lock's timeout, and
`factory promote RUN` on a pipeline-shaped run (optimized/ in one stage run, kpis.json in another)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from factory.cli import app

from .helpers import candidate, promote_params

runner = CliRunner()
S = [
    "-S",
    "promote.model_name=test-detector",
    "-S",
    "promote.min_map=0.2",
    "-S",
    "promote.max_p99_latency_ms=60000",
]


def _stage(bench, tmp_path, name, jitter):
    import tasks.promote

    c = candidate(tmp_path, bench, name, jitter)
    return tasks.promote.run(
        promote_params(), c["optimized"], c["eval"], bench["prepared_a"], tmp_path / "release"
    )


def _cli(tmp_path, bench, *args):
    extra = ["--release", str(tmp_path / "release")] if args[0] in ("promote", "rollback") else []
    if args[0] == "promote":  # its decision record goes to <paths.artifacts>/promotion.json: this test's own
        extra += ["--data", str(bench["prepared_a"]), "-S", f"paths.artifacts={tmp_path / 'artifacts'}"]
    return runner.invoke(app, [*args, *extra, *S])


def test_promote_rollback_lineage_commands(bench, tmp_path, registry) -> None:
    assert _stage(bench, tmp_path, "c1", 0.3)["decision"] == "promoted"
    assert _stage(bench, tmp_path, "c2", 1.5)["decision"] == "refused"

    res = _cli(tmp_path, bench, "promote", "2", "--dry-run")
    assert res.exit_code == 1, res.output
    assert "would be refused" in res.stderr and "class_ap_regression/Car" in res.stderr  # the gate table
    assert json.loads(res.stdout)["would_promote"] is False  # and the result, as JSON
    assert not (tmp_path / "artifacts" / "promotion.json").exists()  # a dry run changes nothing

    # Every gate but the registry's own relaxed from the command line (the fixture's jittered KPIs put the
    # "optimized vs PyTorch" delta near the 0.03 tolerance, on either side depending on the synthetic boxes).
    res = _cli(tmp_path, bench, "promote", "test-detector/2", "-S", "promote.max_class_ap_regression=1",
               "-S", "promote.max_map_regression=1", "-S", "promote.parity_map_tolerance=1")  # fmt: skip
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert (out["decision"], out["champion_before"], out["champion_after"]) == ("promoted", 1, 2)
    assert json.loads((tmp_path / "artifacts" / "promotion.json").read_text())["version"] == 2  # the record

    res = _cli(tmp_path, bench, "lineage", "test-detector@champion", "--json")
    assert res.exit_code == 0, res.output
    lin = json.loads(res.output)
    assert lin["version"] == 2 and lin["aliases"] == ["champion"]
    assert lin["run"]["id"] == registry.get_model_version("test-detector", "2").run_id
    assert lin["params"]["promote.model_name"] == "test-detector" and lin["kpis"]["mAP"] > 0
    assert lin["data"]["prepared_hash"] and [(a["from"], a["to"]) for a in lin["audit"]] == [(1, 2)]
    res = _cli(tmp_path, bench, "lineage", "test-detector/1")
    assert res.exit_code == 0 and "KPIs: mAP" in res.output and "git commit" in res.output, res.output

    res = _cli(tmp_path, bench, "rollback", "--reason", "pedestrian misses in the field")
    assert res.exit_code == 0, res.output  # readable by default
    assert "rolled back: champion v2 -> v1 (audit record 3)" in res.output and "pedestrian misses" in res.output
    res = _cli(tmp_path, bench, "rollback", "--to", "2", "--json")  # and JSON on request (undoes it)
    assert res.exit_code == 0 and json.loads(res.output)["champion_after"] == 2, res.output
    from pfactory.promote import registry as reg

    tags = registry.get_registered_model("test-detector").tags
    rec = reg.parse_audit("audit.000003", tags["audit.000003"])
    assert (rec["action"], rec["from"], rec["to"], rec["reason"]) == (
        "rollback", 2, 1, "pedestrian misses in the field"
    )  # fmt: skip
    assert tags["audit.000003"].startswith("rollback v2 -> v1 | ")

    assert _cli(tmp_path, bench, "lineage", "test-detector/9").exit_code == 2
    res = _cli(tmp_path, bench, "promote", "9")
    assert res.exit_code == 2 and "has no version 9" in res.output


def test_rollback_without_a_previous_champion_exits_1(bench, tmp_path, registry) -> None:
    res = _cli(tmp_path, bench, "rollback")
    assert res.exit_code == 1 and "no 'champion' alias" in res.output
    _stage(bench, tmp_path, "c1", 0.3)
    res = _cli(tmp_path, bench, "rollback")
    assert res.exit_code == 1 and "no previous champion" in res.output, res.output


def test_promote_a_pipeline_run_by_id(bench, tmp_path, registry) -> None:
    """A parent run whose stage runs hold optimized/ and eval/kpis.json, as the pipeline logs them."""
    import mlflow

    c = candidate(tmp_path, bench, "c1", 0.3)
    with mlflow.start_run(run_name="pipeline") as parent:
        with mlflow.start_run(run_name="optimize", nested=True):
            mlflow.log_artifacts(str(c["optimized"]), "optimized")
        with mlflow.start_run(run_name="evaluate", nested=True):
            mlflow.log_artifact(str(c["eval"] / "kpis.json"), "eval")
    res = _cli(tmp_path, bench, "promote", parent.info.run_id)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["decision"] == "promoted" and out["version"] == 1
    assert registry.get_model_version("test-detector", "1").run_id == parent.info.run_id
    res = _cli(tmp_path, bench, "promote", parent.info.run_id)  # idempotent: same run, same files
    assert res.exit_code == 0 and json.loads(res.stdout)["version"] == 1, res.output


HOLDER = """
import sys, time
from pfactory.promote.registry import registry_lock
with registry_lock(sys.argv[1], 5):
    print("held", flush=True)
    time.sleep(30)
"""


def test_lock_timeout_names_the_lock_and_its_holder(tmp_path) -> None:
    from pfactory.promote import LockTimeout
    from pfactory.promote.registry import lock_path, registry_lock

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert lock_path(uri) == tmp_path / "mlflow.db.registry.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, uri], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with (
            pytest.raises(LockTimeout, match=r"mlflow.db.registry.lock: the registry lock is held .*pid \d+"),
            registry_lock(uri, timeout_s=0.3),
        ):
            pass
    finally:
        holder.kill()
        holder.wait()
    with registry_lock(uri, timeout_s=5):  # released when its holder died
        pass
