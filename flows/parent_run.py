"""What the pipeline's MLflow parent run shows in the MLflow UI besides its params and headline metrics.

- per stage, how it was done and by which MLflow run: tags `stage.<stage>.how` (ran | run-cache | up to
  date) and `stage.<stage>.run_id`. A stage DVC restored from its run-cache has no run of its own in this
  pipeline run: its `stage.<stage>.run_id` is the run that computed those outputs (found by the output's
  md5, recorded as `data.<out>.md5` on the parent that ran it; for train also the run id the train stage
  wrote into its metrics.json), with `stage.<stage>.from_parent` = that run's pipeline run;
- the run's description (`mlflow.note.content`, markdown on the run page): a table of the stages with links
  to those runs, the DVC experiment and the workspace;
- the run report (report.html, PR curves, bird's-eye views of the worst frames) under `report/` and its
  PNGs as MLflow images (`pfactory.report.run.log_report`): `champion_report`, made by the flow right after
  the evaluate stage from the workspace's files (there whether evaluate ran in this run or was restored from
  the run-cache) and compared with the registry's champion as it is then, before this run's promote stage
  (read then; the page is drawn in a thread while promote runs);
  the evaluate stage's own report (no champion: a cached output depends only on its inputs) when that
  could not be made.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pfactory.storage import artifacts as af

STAGE_TAG = "stage.{}.{}"
REPORT_DIR = "report"  # under the workspace's logs/: the run report compared with the champion


def champion_report(ws: Any) -> Future[str | None]:
    """The run report of the workspace's evaluation compared with the registry's champion as it is now
    (`factory report`'s page: `pfactory.report.run`), in `<workspace>/logs/report/`. The champion and the
    evaluation are read before this returns (the promote stage may change the champion next); the page and its
    images (~2 s of drawing) are made in a background thread while the next stage runs: the future's result is
    the folder, or None (and a warning in the log) when it cannot be made -- the evaluate stage's own report is
    logged instead."""
    from pfactory.report.run import resolve_report

    p, prm = ws.params.paths, ws.params.promote
    out = ws.path / "logs" / REPORT_DIR
    try:
        with tempfile.TemporaryDirectory(prefix="pfactory-report-") as tmp:  # an evaluation folder: not used
            inputs = resolve_report(str(ws.abs(p.eval)), Path(tmp), "champion", ws.abs(p.optimized),
                                    ws.abs(p.prepared), prm.model_name, prm.alias)  # fmt: skip
    except Exception as e:  # the report explains; the run's work is done
        return _done(_cannot_report(e))
    future: Future[str | None] = Future()

    def draw() -> None:
        from pfactory.report.build import write_report
        from pfactory.report.frames import write_pngs

        try:
            report = write_report(inputs, out / "report.html", ws.params.evaluate.worst_frames)
            if report.worst:
                write_pngs(out / "worst", report.worst)
            pr = ws.abs(p.eval) / af.REPORT_DIR / "pr.png"  # the evaluation's PR curves (no champion in them)
            if pr.is_file():
                shutil.copy2(pr, out / "pr.png")
        except Exception as e:
            future.set_result(_cannot_report(e))
        else:
            future.set_result(str(out))

    threading.Thread(target=draw, name="champion-report", daemon=True).start()
    return future


def _cannot_report(e: Exception) -> None:
    logging.getLogger("pfactory.run").warning("the run report vs the champion could not be made: %r", e)


def _done(value: str | None) -> Future[str | None]:
    future: Future[str | None] = Future()
    future.set_result(value)
    return future


def _md5_of_stage(lock: dict[str, Any], stage: str) -> tuple[str, str] | None:
    """(out path, md5) of the first output `stage` records in dvc.lock, or None."""
    for out in ((lock.get("stages") or {}).get(stage) or {}).get("outs", []):
        if out.get("md5"):
            return out["path"], out["md5"]
    return None


def _own_stage_runs(client: Any, exp_id: str, parent_id: str) -> dict[str, str]:
    """{stage: run id} of the stage runs nested under `parent_id`."""
    runs = client.search_runs([exp_id], f"tags.mlflow.parentRunId = '{parent_id}'", max_results=200)
    return {r.data.tags["stage"]: r.info.run_id for r in runs if r.data.tags.get("stage")}


def _producer(client: Any, exp_id: str, parent_id: str, stage: str, out: tuple[str, str]) -> tuple[str, str] | None:
    """(stage run id, its parent run id) of the earliest pipeline run that ran `stage` producing `out`."""
    path, md5 = out
    runs = client.search_runs(
        [exp_id],
        f"tags.`data.{path}.md5` = '{md5}' and tags.`stage.{stage}.how` = 'ran'",
        order_by=["attributes.start_time ASC"],
        max_results=5,
    )
    for r in runs:
        if r.info.run_id != parent_id and r.data.tags.get(STAGE_TAG.format(stage, "run_id")):
            return r.data.tags[STAGE_TAG.format(stage, "run_id")], r.info.run_id
    return None


def _computed_by(ws: Any, lock: dict[str, Any], stage: str) -> str | None:
    """"run <factory run id> (<user>@<host>:<project>)" from the cache's producer record of the stage's first
    output: the run that computed it, also in another clone sharing the cache (`pfactory.storage.dvccache`)."""
    from pathlib import Path

    from pfactory.storage.dvccache import read_producer

    key = _md5_of_stage(lock, stage)
    rec = read_producer(Path(ws.cache_dir), key[1]) if key else None
    if not rec:
        return None
    return f"run {rec.get('run_id')} ({rec.get('user')}@{rec.get('host')}:{rec.get('project')})"


def stage_lineage(client: Any, exp_id: str, parent_id: str, ws: Any, stages: dict[str, Any]) -> dict[str, dict]:
    """Per stage of this run: `{"how", "run_id", "from_parent"}` (module docstring); also set as tags."""
    lock = ws.lock()
    own = _own_stage_runs(client, exp_id, parent_id)
    out: dict[str, dict] = {}
    for stage, r in stages.items():
        entry: dict[str, Any] = {"how": r["how"], "run_id": own.get(stage), "from_parent": None}
        if entry["run_id"] is None and r["how"] != "ran":
            key = _md5_of_stage(lock, stage)
            found = _producer(client, exp_id, parent_id, stage, key) if key else None
            if found:
                entry["run_id"], entry["from_parent"] = found
            elif stage == "train":  # the train stage records its MLflow run in its metrics file
                doc = af.read_json(ws.abs(ws.params.paths.model) / af.TRAIN_METRICS) or {}
                entry["run_id"] = doc.get("mlflow_run_id")
        if r["how"] != "ran" and getattr(ws, "cache_dir", None):
            entry["computed_by"] = _computed_by(ws, lock, stage)
        out[stage] = entry
    tags = {STAGE_TAG.format(s, "how"): e["how"] for s, e in out.items()}
    tags.update({STAGE_TAG.format(s, "run_id"): e["run_id"] for s, e in out.items() if e["run_id"]})
    tags.update({STAGE_TAG.format(s, "from_parent"): e["from_parent"] for s, e in out.items() if e["from_parent"]})
    tags.update({STAGE_TAG.format(s, "computed_by"): e["computed_by"] for s, e in out.items() if e.get("computed_by")})
    from mlflow.entities import RunTag

    client.log_batch(parent_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
    return out


def description(exp_id: str, results: dict[str, Any], lineage: dict[str, dict]) -> str:
    """The parent run's markdown description (module docstring)."""

    def link(run_id: str | None) -> str:
        return f"[{run_id[:8]}](#/experiments/{exp_id}/runs/{run_id})" if run_id else "-"

    lines = [f"**factory run** `{results['run_id']}`", ""]
    exp = results.get("experiment")
    if exp:
        lines.append(
            f"DVC experiment **`{exp['name']}`** (commit `{exp['rev'][:8]}` on `{exp['baseline'][:8]}`): "
            f"`dvc exp show`, `dvc exp apply {exp['name']}`"
        )
    else:
        lines.append("Not a DVC experiment: the project has no git commit (`git init && git add -A && git commit`).")
    lines += ["", f"Workspace `{results.get('workspace')}`", "", "| stage | how | MLflow run | note |", "|---|---|---|---|"]
    for stage, e in lineage.items():
        note = ""
        if e["how"] != "ran" and e["run_id"]:
            note = f"outputs computed by {link(e['run_id'])}" + (
                f" in pipeline run {link(e['from_parent'])}" if e["from_parent"] else ""
            )
        elif e["how"] != "ran" and e.get("computed_by"):
            note = f"outputs computed by {e['computed_by']} (a clone sharing the DVC cache)"
        elif e["how"] != "ran":
            note = "outputs restored by DVC; the run that computed them is not in this experiment"
        lines.append(f"| {stage} | {e['how']} | {link(e['run_id'])} | {note} |")
    promo = results.get("promotion") or {}
    if promo.get("decision"):
        lines += ["", f"Promotion: **{promo['decision']}** (version {promo.get('version')}): {promo.get('reason', '')}"]
    return "\n".join(lines)


def record_lineage(client: Any, exp_id: str, parent_id: str, ws: Any, results: dict[str, Any]) -> dict[str, dict]:
    """Stage lineage tags, the run report and lineage.json on parent run `parent_id` (all but the description,
    `describe`, which names the DVC experiment: this part runs while `dvc exp save` does); returns the lineage."""
    lineage = stage_lineage(client, exp_id, parent_id, ws, results.get("stages", {}))
    from pfactory.report.run import log_report

    report = results.get("report") or ws.abs(ws.params.paths.eval) / af.REPORT_DIR
    log_report(Path(report), parent_id, client)
    client.log_text(parent_id, json.dumps(lineage, indent=2, sort_keys=True), "lineage.json")
    return lineage


def describe(client: Any, exp_id: str, parent_id: str, results: dict[str, Any], lineage: dict[str, dict]) -> None:
    """The parent run's description (`description`), once `results` names its DVC experiment."""
    client.set_tag(parent_id, "mlflow.note.content", description(exp_id, results, lineage))
