"""The run summary's where/look lines: one command per line, the MLflow link opens the KPI runs table."""

from __future__ import annotations

import json

from factory.summary import where_and_look
from pfactory.tracking.runs import EXPERIMENT_KIND, KPI_VIEW


def test_look_lines_link_the_runs_table_with_the_kpi_columns() -> None:
    text = where_and_look(
        {"workspace": "artifacts/runs/r1", "mlflow_experiment_id": "7", "experiment": {"name": "lr-a"}}
    )
    url = f"http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning&viewStateShareKey={KPI_VIEW}"
    assert url in text.splitlines()[text.splitlines().index("look:") + 2]
    assert "dvc exp apply lr-a" in text and "dvc metrics diff lr-a <other run>" in text
    # The view the link opens is MLflow's shared-view state (plain JSON) on the experiment.
    view = json.loads(EXPERIMENT_KIND[f"mlflow.sharedViewState.{KPI_VIEW}"])
    assert view["selectedColumns"][:2] == ["metrics.`eval/mAP`", "metrics.`eval/NDS`"]
    assert view["columnOrder"] == view["selectedColumns"]


def test_without_a_git_commit_the_summary_says_how_to_get_an_experiment() -> None:
    text = where_and_look({"workspace": "artifacts/runs/r2", "mlflow_experiment_id": "1"})
    assert "git init && git add -A && git commit" in text and "dvc metrics show" in text
