"""One real evaluation, tracked, for the report tests: the tiny setup of tests/evaluate/helpers.py, the real
evaluate stage run under a pipeline (parent) MLflow run in a fresh sqlite store, the optimize stage's files
logged to a sibling stage run as tasks/optimize.py logs them, and the candidate registered as the champion
(the way `factory promote` tags a version), so every source of `factory report` can be tried."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.evaluate.helpers import build_eval_setup


@pytest.fixture(scope="session")  # ~14 s to build: once for the three test modules
def tracked_eval(tmp_path_factory) -> dict:
    import mlflow

    import tasks.evaluate
    from flows.params import Params
    from pfactory.evaluate.params import EvaluateParams
    from pfactory.promote.evidence import read_evidence
    from pfactory.tracking.runs import experiment_id, stage_run

    root = tmp_path_factory.mktemp("report")
    setup = build_eval_setup(root / "artifacts", frames=12)  # prepared/, model/, optimized/ beside eval/
    uri = f"sqlite:///{root / 'mlflow.db'}"
    params = Params(evaluate=EvaluateParams(workers=1, slice_frames=2, worst_frames=3, reference=False))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.chdir(root)
        mlflow.set_tracking_uri(uri)
        # A pipeline run as flows/pipeline.py opens it: no stage tag, pipeline=true.
        exp = experiment_id(root)
        with mlflow.start_run(
            experiment_id=exp, run_name="report-test-run", tags={"pipeline": "true"}
        ) as parent:
            pid = parent.info.run_id
            mp.setenv("PFACTORY_PARENT_RUN_ID", pid)
            with stage_run("optimize", {}):
                mlflow.log_artifacts(str(setup["optimized"]), artifact_path="optimized")
            metrics = tasks.evaluate.run(
                params, setup["optimized"], None, setup["prepared"], root / "artifacts" / "eval", "local:1"
            )
            mp.delenv("PFACTORY_PARENT_RUN_ID")
        ev = read_evidence(setup["optimized"], root / "artifacts" / "eval" / "kpis.json")
        c = mlflow.MlflowClient()
        c.create_registered_model("pfactory-detector")
        mv = c.create_model_version("pfactory-detector", f"runs:/{pid}/candidate", run_id=pid, tags=ev.tags())
        c.set_registered_model_alias("pfactory-detector", "champion", mv.version)
    return {
        **setup,
        "root": root,
        "eval": root / "artifacts" / "eval",
        "uri": uri,
        "parent": pid,
        "metrics": metrics,
        "kpis": json.loads((root / "artifacts" / "eval" / "kpis.json").read_text()),
    }


@pytest.fixture(scope="session")
def report_html(tracked_eval) -> Path:
    """The evaluate stage's own report."""
    return Path(tracked_eval["eval"]) / "report" / "report.html"
