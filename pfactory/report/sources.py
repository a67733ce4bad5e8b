"""Where a run report's inputs come from besides an evaluation directory: MLflow runs, registered models, and
the registry's current champion (the baseline `factory report` and the pipeline's parent run compare with).

Not imported by the evaluate stage: its report is a function of its own inputs (a DVC-cached output), so it
never reads the registry, whose champion changes outside DVC's view.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

from pfactory.report.inputs import Baseline, ReportError, ReportInputs, load_eval_dir

_RUN_ID = re.compile(r"[0-9a-f]{32}")


# ---------------------------------------------------------------------------------------------
# MLflow: runs and registered models
# ---------------------------------------------------------------------------------------------


def mlflow_client() -> Any:
    """A client on the project's tracking URI (`MLFLOW_TRACKING_URI`, else the project's sqlite DB)."""
    from mlflow.tracking import MlflowClient

    from pfactory.runtime.project import configure_environment

    configure_environment()
    return MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])


def resolve_run(c: Any, ref: str, default_model: str) -> tuple[Any, str]:
    """A run from a run id, a pipeline run name (the latest such run of any user: the experiment
    `perception-factory` and a team's `perception-factory/<user>`), or `MODEL@ALIAS` / `MODEL/VERSION` /
    `models:/...` (the run a registered version came from). Returns `(run, how it was named)`."""
    from mlflow.exceptions import MlflowException

    from pfactory.promote.errors import RegistryError
    from pfactory.promote.promotion import resolve
    from pfactory.promote.registry import get_version

    if "@" in ref or ref.startswith("models:/") or re.fullmatch(r"[^/\s]+/\d+", ref):
        try:
            name, version = resolve(c, ref, default_model, "champion")
            mv = get_version(c, name, version)
        except RegistryError as e:
            raise ReportError(str(e)) from None
        if not mv.run_id:
            raise ReportError(f"models:/{name}/{version} has no run: nothing to report on")
        return c.get_run(mv.run_id), f"models:/{name}/{version} ({ref})"
    if _RUN_ID.fullmatch(ref):
        try:
            return c.get_run(ref), f"run {ref}"
        except MlflowException:
            pass
    from pfactory.tracking.runs import experiment_ids

    ids = experiment_ids(c)  # the shared experiment and a team's per-user ones: a run of any user
    found = (
        c.search_runs(
            ids,
            filter_string=f"attributes.run_name = '{ref}' and tags.pipeline = 'true'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if ids and "'" not in ref
        else []
    )
    if not found:
        raise ReportError(
            f"{ref!r}: not an evaluation directory, a run id, a pipeline run name or MODEL@ALIAS "
            f"(tracking URI {c.tracking_uri})"
        )
    return found[0], f"pipeline run {ref}"


def _stage_run(c: Any, run: Any, stage: str) -> Any | None:
    """`run` itself if it is that stage's run, else the latest such stage run under its pipeline run, else
    (the stage was restored from DVC's run-cache: no run of its own) the run the pipeline run's
    `stage.<stage>.run_id` tag names (the run that computed those outputs, flows/parent_run.py)."""
    if run.data.tags.get("stage") == stage:
        return run
    parent = run.data.tags.get("mlflow.parentRunId") if run.data.tags.get("stage") else None
    parent = parent or run.info.run_id
    found = c.search_runs(
        [run.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent}' and tags.stage = '{stage}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if found:
        return found[0]
    pipeline = run if parent == run.info.run_id else c.get_run(parent)
    linked = pipeline.data.tags.get(f"stage.{stage}.run_id")
    return c.get_run(linked) if linked else None


def load_run(
    c: Any, ref: str, workdir: Path, default_model: str, prepared: Path | None = None
) -> ReportInputs:
    """Inputs of a tracked run (module docstring): its artifacts are downloaded under `workdir`."""
    import mlflow

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one line per file otherwise
    run, how = resolve_run(c, ref, default_model)
    ev = _stage_run(c, run, "evaluate")
    if ev is None:
        raise ReportError(f"{how}: no evaluate stage run under it (nothing to report on)")
    mlflow.set_tracking_uri(c.tracking_uri)
    try:
        mlflow.artifacts.download_artifacts(
            run_id=ev.info.run_id, artifact_path="eval", dst_path=str(workdir)
        )
    except Exception as e:
        raise ReportError(f"{how}: cannot download the evaluate run's 'eval' artifacts ({e})") from None
    opt_run = _stage_run(c, run, "optimize")
    opt_dir = workdir / "optimized"
    if opt_run is not None:
        opt_dir.mkdir(parents=True, exist_ok=True)
        for fname in ("parity.json", "latency.json"):  # not the model files
            with contextlib.suppress(Exception):  # a missing file is reported by load_eval_dir
                mlflow.artifacts.download_artifacts(
                    run_id=opt_run.info.run_id, artifact_path=f"optimized/{fname}", dst_path=str(opt_dir)
                )
    parent_id = run.data.tags.get("mlflow.parentRunId") if run.data.tags.get("stage") else run.info.run_id
    name = (
        run.info.run_name
        if not run.data.tags.get("stage")
        else f"{run.info.run_name} ({run.info.run_id[:8]})"
    )
    inputs = load_eval_dir(workdir / "eval", opt_dir if opt_dir.is_dir() else workdir / "no-optimize-run",
                           prepared if prepared is not None else workdir / "no-prepared-data", name=name)  # fmt: skip
    inputs.provenance = [
        ("source", how),
        ("pipeline run", f"{parent_id}"),
        ("evaluate run", ev.info.run_id),
        ("user", ev.data.tags.get("pfactory.user") or ev.data.tags.get("mlflow.user", "?")),  # who ran it
        (
            "git commit",
            f"{ev.data.tags.get('git.commit', '?')} (dirty: {ev.data.tags.get('git.dirty', '?')})",
        ),
    ] + [p for p in inputs.provenance if p[0] == "prepared data"]
    inputs.notes = [n for n in inputs.notes if "no-prepared-data" not in n]
    if prepared is None and not inputs.prerendered:
        inputs.notes.append(
            "the run logged no drawn worst frames and no --data was given: worst frames not drawn"
        )
    inputs.run_ids = {"pipeline": parent_id, "evaluate": ev.info.run_id}
    return inputs


def champion_baseline(
    c: Any, kpis: dict[str, Any], model_name: str, alias: str, this_run: str | None
) -> Baseline | None:
    """The champion's KPIs on the same evaluation data when the registry has them (its registered KPIs, or
    a cached re-evaluation on this data), else its registered KPIs with a note. None without a champion."""
    from pfactory.promote import registry as reg
    from pfactory.promote.errors import EvidenceError
    from pfactory.promote.evidence import data_key, kpis_from_tags, same_data
    from pfactory.promote.promotion import REEVAL_TAG

    version = reg.champion(c, model_name, alias)
    if version is None:
        return None
    mv = reg.get_version(c, model_name, version)
    tags = dict(mv.tags)
    source = f"models:/{model_name}/{version}"
    label = f"{alias} v{version}" + (" (this run)" if this_run and mv.run_id == this_run else "")
    data = kpis.get("data") or {}
    champ_data = {"prepared_hash": tags.get("data.prepared_hash"), "split": tags.get("data.split")}
    try:
        if same_data(champ_data, data):
            return Baseline(label, kpis_from_tags(tags, source))
        key = REEVAL_TAG + data_key(data) if data.get("prepared_hash") else None
        if key and key in tags:
            return Baseline(label + ", re-evaluated on this data", kpis_from_tags(tags, source, key))
        return Baseline(
            label,
            kpis_from_tags(tags, source),
            f"the champion was evaluated on other data ({str(champ_data['prepared_hash'])[:12]}..., split "
            f"{champ_data['split']}); `factory promote` re-evaluates it on this data",
        )
    except EvidenceError as e:
        raise ReportError(str(e)) from None
