"""`factory report` from every source (evaluation directory, run id, pipeline run name, MODEL@ALIAS), its
baselines (champion, none, another evaluation), the MLflow logging of the stage's report, and bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from factory.cli import app
from tests.report.helpers import Page, external_references

PARAMS = Path(__file__).resolve().parents[2] / "params.yaml"


@pytest.fixture
def cli(tracked_eval, tmp_path: Path, monkeypatch):
    """Run `factory ...` against the fixture's tracking store, from an empty directory."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracked_eval["uri"])
    monkeypatch.chdir(tmp_path)

    def run(*args: str, code: int = 0) -> str:
        res = CliRunner().invoke(app, [*args, "--params", str(PARAMS)])
        assert res.exit_code == code, res.output
        return res.output

    return run


def _headline(path: Path) -> str:
    """The text of the headline section (KPI cards with their deltas)."""
    text = Page(path.read_text()).all_text
    return text[text.index("Headline KPIs") : text.index("Per class × range")]


def test_the_flow_owns_the_parent_runs_report(tracked_eval) -> None:
    """Under a pipeline the stage logs its report to its own run only (`eval/report/`); the parent run's
    `report/` (+ images) comes from `log_report`, which the flow calls (flows/parent_run.py), once."""
    import mlflow

    from pfactory.report.run import log_report

    c = mlflow.MlflowClient(tracking_uri=tracked_eval["uri"])
    pid = tracked_eval["parent"]
    ev = c.get_run(tracked_eval["metrics"]["mlflow_run_id"])
    assert ev.data.tags["mlflow.parentRunId"] == pid
    logged = {a.path for a in c.list_artifacts(ev.info.run_id, "eval/report")}
    assert {"eval/report/report.html", "eval/report/worst"} <= logged
    assert c.list_artifacts(pid, "report") == [], "the stage must leave the parent's report to the flow"

    paths = log_report(Path(tracked_eval["eval"]) / "report", pid, c)
    assert "report/report.html" in paths and "report/pr.png" in paths
    assert any(p.startswith("report/worst/") and p.endswith(".png") for p in paths), paths
    assert {a.path for a in c.list_artifacts(pid, "report")} >= {"report/report.html", "report/pr.png", "report/worst"}
    images = [a.path for a in c.list_artifacts(pid, "images")]
    assert any("pr_curves" in p for p in images) and any("worst_frames_bev" in p for p in images), images


def test_the_error_breakdown_is_on_the_runs_as_scalars(tracked_eval) -> None:
    """The evaluate run and the pipeline's headline (`headline_scalars`) carry the breakdown's counts + dAP."""
    import mlflow

    from pfactory.storage.artifacts import headline_scalars

    kpis = tracked_eval["kpis"]
    head = headline_scalars(kpis)
    ev = mlflow.MlflowClient(tracking_uri=tracked_eval["uri"]).get_run(tracked_eval["metrics"]["mlflow_run_id"])
    for cls, block in kpis["errors"].items():
        for label in ("tp", "duplicate", "classification", "localization", "both", "background", "missed", "heading_flip"):
            assert head[f"eval/{cls}/errors/{label}"] == block[label] == ev.data.metrics[f"eval/{cls}/errors/{label}"]
        for k, v in block["dap"].items():
            if v == v:  # nan (no detections of the class) is left out
                assert head[f"eval/{cls}/dap/{k}"] == pytest.approx(v) == ev.data.metrics[f"eval/{cls}/dap/{k}"]
    assert sum(block["num_gt"] for block in kpis["errors"].values()) > 0


def test_eval_dir_against_the_champion(tracked_eval, cli, tmp_path: Path) -> None:
    out = cli("report", str(tracked_eval["eval"]), "--out", "a.html")
    assert "baseline: champion v1" in out
    text = _headline(tmp_path / "a.html")
    # The champion is this very evaluation (same data): every delta is zero.
    assert "Baseline: champion v1" in text and "vs baseline +0.000" in text
    assert "vs baseline -" not in text.replace("vs baseline –", "")
    page = Page((tmp_path / "a.html").read_text())
    assert len(page.images()) >= 2  # drawn from the prepared data beside the evaluation


@pytest.mark.parametrize("how", ["run_id", "run_name", "model_alias"])
def test_tracked_sources(tracked_eval, cli, tmp_path: Path, how: str) -> None:
    ref = {
        "run_id": tracked_eval["parent"],
        "run_name": "report-test-run",
        "model_alias": "pfactory-detector@champion",
    }[how]
    cli("report", ref, "--out", "r.html", *(["--vs", "none"] if how == "model_alias" else []))
    html = (tmp_path / "r.html").read_text()
    page = Page(html)
    assert external_references(html, page) == []
    assert tracked_eval["parent"] in page.all_text  # provenance: the pipeline run
    # No --data: the worst frames come from the panels the evaluate stage logged.
    stage_panels = sorted((tracked_eval["eval"] / "report" / "worst").glob("*.png"))
    assert sorted(page.images()) == sorted(p.read_bytes() for p in stage_panels)
    assert f"{tracked_eval['kpis']['mAP']:.3f}" in page.all_text
    if how == "model_alias":
        assert "Baseline: none" in page.all_text
    else:
        assert "Baseline: champion v1 (this run)" in page.all_text
    assert "Parity vs PyTorch" in page.all_text  # the optimize stage run's files, downloaded


def test_vs_another_evaluation(tracked_eval, cli, tmp_path: Path) -> None:
    import json

    other = tmp_path / "other"
    shutil.copytree(tracked_eval["eval"], other)
    doc = json.loads((other / "kpis.json").read_text())
    doc["mAP"] -= 0.25
    doc["classes"]["Car"]["mean_ap"] -= 0.5
    (other / "kpis.json").write_text(json.dumps(doc))
    cli("report", str(tracked_eval["eval"]), "--out", "v.html", "--vs", str(other))
    text = _headline(tmp_path / "v.html")
    assert f"Baseline: evaluation {other}" in text
    assert "vs baseline +0.250" in text and "vs baseline +0.500" in text
    assert "evaluated on other data" not in text
    doc["data"]["prepared_hash"] = "f" * 64  # another evaluation set: the page says so
    (other / "kpis.json").write_text(json.dumps(doc))
    cli("report", str(tracked_eval["eval"]), "--out", "w.html", "--vs", str(other))
    assert "the baseline was evaluated on other data (ffffffffffff..." in _headline(tmp_path / "w.html")


def test_bad_sources_exit_2(tracked_eval, cli, tmp_path: Path) -> None:
    out = cli("report", "no-such-run", "--out", "x.html", code=2)
    assert "'no-such-run': not an evaluation directory, a run id, a pipeline run name or MODEL@ALIAS" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    out = cli("report", str(empty), "--out", "x.html", code=2)
    assert f"{empty / 'kpis.json'}: missing" in out
    broken = tmp_path / "broken"
    shutil.copytree(tracked_eval["eval"], broken)
    (broken / "report" / "predictions.parquet").write_bytes(b"not parquet")
    out = cli("report", str(broken), "--out", "x.html", code=2)
    assert "predictions.parquet: not a readable Parquet file" in out
    out = cli("report", "pfactory-detector@nope", "--out", "x.html", code=2)
    assert "no alias 'nope'" in out
    assert not (tmp_path / "x.html").exists()
