"""`factory compare` / `pfactory.report.compare`: real MLflow runs in a tmp sqlite store.

The runs carry the pipeline contract (flattened params, `eval/...`, `latency/...`, `time/...`
metrics, `pipeline=true`): "base" (oldest), "same" (within every tolerance), "worse" (mAP and
Car AP drop, train 1.4x slower, p99 1.5x, a changed param), a FAILED "broken" one (newest)
and a nested stage run named "train" (not a pipeline run).
"""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from factory.cli import app
from pfactory.report.compare import CompareError, NoRunsError, compare_runs, render_table, write_chart
from pfactory.tracking.runs import EXPERIMENT, flatten

T0_MS = 1_790_000_000_000
HOUR_MS = 3_600_000

BASE_PARAMS = {"data": {"frames": 100, "seed": 0}, "train": {"lr": 0.001, "epochs": 5}}
BASE_METRICS = {
    "eval/mAP": 0.50,
    "eval/NDS": 0.55,
    "eval/delta/mAP": 0.0,
    "eval/Car/mean_ap": 0.60,
    "eval/Pedestrian/mean_ap": 0.40,
    "eval/Cyclist/mean_ap": 0.50,
    **{f"eval/{c}/{e}": 0.3 for c in ("Car", "Pedestrian", "Cyclist") for e in ("ate", "ase", "aoe")},
    **{f"eval/Car/ap_{th}": 0.6 for th in ("0.5", "1.0", "2.0", "4.0")},
    "latency/p50_ms": 5.0,
    "latency/p99_ms": 8.0,
    "time/synth_s": 10.0,
    "time/prepare_s": 20.0,
    "time/train_s": 100.0,
    "time/optimize_s": 30.0,
    "time/evaluate_s": 15.0,
    "time/promote_s": 0.2,
    "time/total_s": 175.2,
    "time/orchestration_fraction": 0.05,  # not a duration: shown, never flagged
}


def _log_run(client, exp_id: str, name: str, start_ms: int, params: dict, metrics: dict, **kw) -> str:
    from mlflow.entities import Metric, Param

    tags = {"pipeline": "true", "git.commit": "0123456789abcdef", "git.dirty": "False"}
    tags |= kw.get("tags", {})
    run = client.create_run(exp_id, start_time=start_ms, tags=tags, run_name=name)
    rid = run.info.run_id
    client.log_batch(
        rid,
        metrics=[Metric(k, float(v), start_ms, 0) for k, v in metrics.items()],
        params=[Param(k, str(v)) for k, v in flatten(params).items()],
    )
    client.set_terminated(rid, status=kw.get("status", "FINISHED"), end_time=start_ms + 1000)
    return rid


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    """A sqlite MLflow store with the runs described in the module docstring."""
    from mlflow.tracking import MlflowClient

    d = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{d / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment(EXPERIMENT, artifact_location=(d / "artifacts").as_uri())
    ids = {}
    ids["base"] = _log_run(client, exp_id, "base", T0_MS, BASE_PARAMS, BASE_METRICS)
    same = BASE_METRICS | {"eval/mAP": 0.495, "time/train_s": 110.0, "time/promote_s": 0.6}
    ids["same"] = _log_run(client, exp_id, "same", T0_MS + HOUR_MS, BASE_PARAMS, same)
    worse = BASE_METRICS | {
        "eval/mAP": 0.44,
        "eval/NDS": 0.56,
        "eval/Car/mean_ap": 0.58,
        "time/train_s": 140.0,
        "latency/p99_ms": 12.0,
        "time/total_s": 215.2,
        "time/orchestration_fraction": 0.5,
    }
    worse_params = {**BASE_PARAMS, "train": {"lr": 0.01, "epochs": 5}}
    ids["worse"] = _log_run(client, exp_id, "worse", T0_MS + 2 * HOUR_MS, worse_params, worse)
    ids["broken"] = _log_run(
        client, exp_id, "broken", T0_MS + 3 * HOUR_MS, BASE_PARAMS, {"time/synth_s": 9.0}, status="FAILED"
    )
    # a stage run: same experiment, no pipeline tag, nested under "worse"
    stage = client.create_run(
        exp_id,
        start_time=T0_MS + 2 * HOUR_MS + 10,
        tags={"stage": "train", "mlflow.parentRunId": ids["worse"]},
        run_name="train",
    )
    client.set_terminated(stage.info.run_id, end_time=T0_MS + 2 * HOUR_MS + 500)
    return {"uri": uri, "ids": ids, "dir": d}


def _labels(result) -> list[str]:
    return [r.label for r in result.runs]


def test_default_is_latest_finished_pipeline_runs_oldest_first(store):
    res = compare_runs(tracking_uri=store["uri"])
    assert _labels(res) == ["base", "same", "worse"]  # no FAILED run, no stage run
    assert res.baseline.label == "base"
    assert compare_runs(last=2, tracking_uri=store["uri"]).baseline.label == "same"


def test_kpi_and_time_deltas_against_the_baseline(store):
    res = compare_runs(tracking_uri=store["uri"])
    m = res.row("eval/mAP")
    assert m.values == [0.50, 0.495, 0.44]
    assert m.deltas[0] is None
    assert m.deltas[1] == pytest.approx(-0.005)
    assert m.deltas[2] == pytest.approx(-0.06)
    t = res.row("time/train_s")
    assert t.deltas[1:] == [pytest.approx(1.1), pytest.approx(1.4)]
    assert [r.key for r in res.section("time")][-1] == "time/total_s"
    assert res.row("latency/p99_ms").deltas[2] == pytest.approx(1.5)
    assert res.row("eval/Car/ate").values == [0.3, 0.3, 0.3]
    assert res.row("time/orchestration_fraction").deltas[2] == pytest.approx(10.0)


def test_regressions_flag_kpi_drops_and_slowdowns_beyond_tolerance(store):
    res = compare_runs(tracking_uri=store["uri"])
    flagged = {(g.run_label, g.key) for g in res.regressions}
    assert flagged == {
        ("worse", "eval/mAP"),  # -0.06 > 0.01
        ("worse", "eval/Car/mean_ap"),  # -0.02 > 0.01
        ("worse", "time/train_s"),  # 1.4x > 1.25x
        ("worse", "latency/p99_ms"),  # 1.5x
    }
    # "same": mAP -0.005 within tolerance, train 1.1x, promote 3x but only +0.4 s (< min_time_s)
    assert not any(g.run_label == "same" for g in res.regressions)
    assert res.row("eval/mAP").regressed == [False, False, True]
    # looser tolerances: nothing flagged
    loose = compare_runs(kpi_tolerance=0.1, time_tolerance=2.0, tracking_uri=store["uri"])
    assert loose.regressions == []
    # min_time_s=0: the 3x sub-second promote stage is flagged too
    strict = compare_runs(min_time_s=0.0, tracking_uri=store["uri"])
    assert ("same", "time/promote_s") in {(g.run_label, g.key) for g in strict.regressions}


def test_only_params_that_differ_are_shown(store):
    res = compare_runs(tracking_uri=store["uri"])
    params = res.section("param")
    assert [p.key for p in params] == ["train.lr"]
    assert params[0].values == ["0.001", "0.001", "0.01"]


def test_runs_by_name_and_id_with_explicit_baseline(store):
    ids = store["ids"]
    res = compare_runs(["worse", ids["broken"]], baseline="same", tracking_uri=store["uri"])
    assert _labels(res) == ["same", "worse", "broken"]  # baseline added, chronological
    assert res.baseline.run_id == ids["same"]
    assert res.runs[2].status == "FAILED"
    drop = next(g for g in res.regressions if g.key == "eval/mAP")
    assert drop.run_label == "worse" and drop.change == pytest.approx(-0.055)
    assert res.row("eval/mAP").values[2] is None  # the failed run has no KPIs: shown, not flagged


def test_unknown_run_stage_run_and_experiment_are_clear_errors(store):
    with pytest.raises(CompareError, match=r"run 'nosuch': no run with that id.*perception-factory"):
        compare_runs(["nosuch"], tracking_uri=store["uri"])
    with pytest.raises(CompareError, match="run 'train'"):  # a stage run's name is not a pipeline run
        compare_runs(["train"], tracking_uri=store["uri"])
    with pytest.raises(CompareError, match="experiment 'other': not found"):
        compare_runs(experiment="other", tracking_uri=store["uri"])
    with pytest.raises(CompareError, match="time_tolerance"):
        compare_runs(time_tolerance=0.5, tracking_uri=store["uri"])


def test_empty_experiment_is_no_runs_error(store):
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=store["uri"]).create_experiment("empty")
    with pytest.raises(NoRunsError, match="no finished pipeline run"):
        compare_runs(experiment="empty", tracking_uri=store["uri"])


def test_json_table_and_png(store, tmp_path):
    from PIL import Image
    from rich.console import Console

    res = compare_runs(tracking_uri=store["uri"])
    doc = json.loads(res.to_json())
    assert doc["baseline"] == store["ids"]["base"]
    assert len(doc["regressions"]) == 4
    assert any("eval/mAP dropped 0.5000 -> 0.4400" in g["message"] for g in doc["regressions"])

    console = Console(record=True, width=200)
    console.print(render_table(res))
    text = console.export_text()
    assert "base (base)" in text and "eval/mAP" in text and "train.lr" in text
    assert "0.4400 (-0.0600)" in text and "(x1.40)" in text

    png = write_chart(res, tmp_path / "out" / "cmp.png")
    with Image.open(png) as im:
        assert im.format == "PNG" and im.width > 500 and im.height > 300
    assert not list(png.parent.glob(".*tmp"))  # atomic write left no temp file


def test_cli_exit_codes(store, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    runner = CliRunner()
    res = runner.invoke(app, ["compare", "--json", "--png", str(tmp_path / "c.png")])
    assert res.exit_code == 0, res.output
    assert [r["label"] for r in json.loads(res.stdout)["runs"]] == ["base", "same", "worse"]
    assert (tmp_path / "c.png").stat().st_size > 1000

    res = runner.invoke(app, ["compare", "--fail-on-regression"])
    assert res.exit_code == 1
    assert re.search(r"regression.*worse: eval/mAP dropped", res.stdout)
    assert runner.invoke(app, ["compare", "base", "same", "--fail-on-regression"]).exit_code == 0

    res = runner.invoke(app, ["compare", "nosuch"])
    assert res.exit_code == 2
    assert "nosuch" in res.output


def test_compare_module_has_no_heavy_imports_at_import_time():
    # MLflow and matplotlib load only when a comparison runs.
    import subprocess
    import sys

    code = "import sys, pfactory.report.compare; print([m for m in ('mlflow', 'matplotlib') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
