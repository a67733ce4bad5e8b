"""The pipeline flow: synth -> prepare -> train -> optimize (evaluate and promote land next).

Prefect sequences the stages and adds retries, a run name and a UI; the stages themselves
are the plain `tasks.<stage>.run` functions (files in -> files out -> metrics back), so the
flow holds no ML logic. One MLflow parent run per pipeline run; every stage run nests under
it through `PFACTORY_PARENT_RUN_ID`.

Run: `factory run [-S section.key=value ...] [--name NAME]`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pfactory.tracking import configure_environment

configure_environment()  # before Prefect is imported: PREFECT_HOME, analytics off

from prefect import flow, task  # noqa: E402


@task(name="synth", retries=1, retry_delay_seconds=2)
def synth_task(params: Any, root: str) -> dict:
    import tasks.synth

    out = Path(root) / params.paths.raw
    if (out / "training").is_dir() or (out / "samples").is_dir():
        return {"skipped": f"{out} exists"}
    return tasks.synth.run(params, out)


@task(name="prepare", retries=1, retry_delay_seconds=2)
def prepare_task(params: Any, root: str) -> dict:
    import tasks.prepare

    return tasks.prepare.run(params, Path(root) / params.paths.raw, Path(root) / params.paths.prepared)


@task(name="train")
def train_task(params: Any, root: str) -> dict:
    import tasks.train

    summary = tasks.train.run(params, Path(root) / params.paths.prepared, Path(root) / params.paths.model)
    return {k: v for k, v in summary.items() if k != "val"} | {
        "val_mAP": (summary.get("val") or {}).get("mAP")
    }


@task(name="optimize")
def optimize_task(params: Any, root: str) -> dict:
    import tasks.optimize

    r = Path(root)
    return tasks.optimize.run(
        params, r / params.paths.model, r / params.paths.prepared, r / params.paths.optimized
    )


STAGES = (
    ("synth", synth_task),
    ("prepare", prepare_task),
    ("train", train_task),
    ("optimize", optimize_task),
)


@flow(name="perception-factory", log_prints=True)
def pipeline(overrides: list[str] | None = None, name: str | None = None, root: str | None = None) -> dict:
    """Run every landed stage in order on params.yaml + `overrides`; returns metrics per stage."""
    import mlflow

    from pfactory.config import load_params
    from pfactory.tracking import PARENT_ENV, artifact_location, lineage_tags

    root_path = configure_environment(root)
    params = load_params(root_path / "params.yaml", overrides or [])
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    exp = mlflow.get_experiment_by_name("perception-factory")
    exp_id = (
        exp.experiment_id
        if exp
        else mlflow.create_experiment("perception-factory", artifact_location=artifact_location(root_path))
    )
    results: dict[str, Any] = {"timings_s": {}}
    with mlflow.start_run(
        experiment_id=exp_id, run_name=name, tags={"pipeline": "true", **lineage_tags(root_path)}
    ) as run:
        mlflow.log_dict(params.model_dump(mode="json"), "params.json")
        os.environ[PARENT_ENV] = run.info.run_id
        try:
            for stage, fn in STAGES:
                t0 = time.perf_counter()
                results[stage] = fn(params, str(root_path))
                results["timings_s"][stage] = round(time.perf_counter() - t0, 3)
                mlflow.log_metric(f"time_{stage}_s", results["timings_s"][stage])
        finally:
            os.environ.pop(PARENT_ENV, None)
        results["mlflow_run_id"] = run.info.run_id
    return results
