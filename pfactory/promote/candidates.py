"""Candidates that are not the pipeline's own outputs: an MLflow run's candidate files or a registered version
(`factory promote RUN_OR_VERSION`), and the champion's re-evaluation on the candidate's data (through
`pfactory.evaluate`, the library the evaluate stage runs).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pfactory.config.section import section_of
from pfactory.promote.errors import UnknownRef
from pfactory.promote.params import PromoteParams
from pfactory.storage import artifacts as af

RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def champion_evaluator(params: Any) -> Callable[[Path, Path], dict]:
    """`evaluate(optimized_dir, data_dir) -> kpis` with the project's `evaluate` params (no MLflow, output in
    a temporary folder): how promotion re-evaluates a champion evaluated on other data."""
    from pfactory.promote.params import PromoteParams

    def evaluate(optimized_dir: Path, data_dir: Path) -> dict:
        from pfactory.evaluate.evaluation import evaluate_to_kpis

        if isinstance(params, PromoteParams):
            raise TypeError(
                "re-evaluating the champion needs the full project Params, not only PromoteParams"
            )
        return evaluate_to_kpis(params.evaluate, Path(optimized_dir), Path(data_dir))

    return evaluate


def _find_file(c: Any, run_id: str, filename: str, prefer: str, depth: int = 3) -> str | None:
    """Artifact path of `filename` in run `run_id` (breadth-first, `prefer` folder first), or None."""
    queue = [prefer, ""] if prefer else [""]
    seen: set[str] = set()
    while queue:
        path = queue.pop(0)
        if path in seen or path.count("/") >= depth:
            continue
        seen.add(path)
        for a in c.list_artifacts(run_id, path or None):
            if a.is_dir:
                queue.append(a.path)
            elif a.path.rsplit("/", 1)[-1] == filename:
                return a.path
    return None


def run_candidate(c: Any, run_id: str, dst: Path) -> tuple[Path, Path]:
    """Download a run's candidate (its `candidate/` folder, else its or its stage runs' `optimized/` and
    kpis.json) into `dst`; returns (optimized dir, kpis.json)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        run = c.get_run(run_id)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise UnknownRef(f"run {run_id}: no such MLflow run on {mlflow.get_tracking_uri()}") from None
    runs = [run_id] + [
        r.info.run_id
        for r in c.search_runs(
            [run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'", max_results=100
        )
    ]
    found: dict[str, tuple[str, str]] = {}
    for rid in runs:
        for name, prefer in ((af.BACKEND, "candidate/optimized"), (af.KPIS, "candidate/eval")):
            if name not in found and (path := _find_file(c, rid, name, prefer)):
                found[name] = (rid, path)
    missing = [n for n in (af.BACKEND, af.KPIS) if n not in found]
    if missing:
        raise UnknownRef(
            f"run {run_id} (and its {len(runs) - 1} stage runs) has no {' or '.join(missing)} artifact: "
            "not a candidate (it needs the optimize and evaluate stages' outputs)"
        )
    rid, path = found[af.BACKEND]
    folder = path.rsplit("/", 1)[0] if "/" in path else ""
    optimized = Path(mlflow.artifacts.download_artifacts(run_id=rid, artifact_path=folder or None,
                                                         dst_path=str(dst / "optimized-dl")))  # fmt: skip
    rid, path = found[af.KPIS]
    kpis = Path(
        mlflow.artifacts.download_artifacts(run_id=rid, artifact_path=path, dst_path=str(dst / "eval-dl"))
    )
    return optimized, kpis


def promote_ref(
    params: Any,
    ref: str,
    data: Path,
    release: Path,
    dry_run: bool = False,
    evaluate_fn: Callable[[Path, Path], dict] | None = None,
) -> dict:
    """`factory promote RUN_OR_VERSION`: a registered version (`3`, `MODEL/3`, `MODEL@alias`) or an MLflow
    run id (32 hex: its candidate files), through the same gates as the stage. Returns `promote`'s dict."""
    from pfactory.promote import access
    from pfactory.promote import registry as reg
    from pfactory.promote.promotion import Candidate, promote, resolve

    prm = section_of(params, "promote", PromoteParams)
    fn = evaluate_fn or champion_evaluator(params)
    c = reg.client()
    ident = access.team()  # a team: a bare version number is a candidate (`<model>-candidates`)
    cands = access.candidates_model(prm.model_name) if ident is not None else None
    name, version = (None, None) if RUN_ID.match(ref) else resolve(
        c, ref, cands if cands and ref.isdigit() else prm.model_name, prm.alias
    )
    if not dry_run:  # the caller's permission first: a refusal changes nothing (pfactory/promote/access.py)
        access.require(c, ident, prm.model_name, "promote", reg.champion(c, prm.model_name, prm.alias),
                       version, ref if RUN_ID.match(ref) else None)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pfactory-promote-") as tmp:
        if name is None or version is None:
            optimized, kpis = run_candidate(c, ref, Path(tmp))
            candidate = Candidate(optimized, kpis, ref)
        else:
            if name != prm.model_name and name != cands:
                prm = prm.model_copy(update={"model_name": name})
            files = reg.download_version(c, name, version, Path(tmp))
            mv = reg.get_version(c, name, version)
            candidate = Candidate(
                files / "optimized", files / "eval" / af.KPIS, mv.run_id, version,
                {"git_commit": mv.tags.get("git.commit"), "git_dirty": mv.tags.get("git.dirty")}, name,
            )  # fmt: skip
        return promote(prm, candidate, Path(data), Path(release), dry_run, fn)


def last_registered(artifacts: Path) -> str:
    """The ref of the version `<artifacts>/promotion.json` names (the last promotion decision made here;
    `factory promote last`): `MODEL/V` for a team's candidate, else `V`. UsageError (exit 2) when none."""
    from pfactory.runtime.failures import UsageError

    last = af.promotion(artifacts) or {}
    if last.get("version") is None:
        raise UsageError(f"{Path(artifacts) / af.PROMOTION}: no registered version (no promotion ran here yet); "
                         "pass VERSION, MODEL@ALIAS or a run id (`factory lineage` lists them)")  # fmt: skip
    return f"{last['model']}/{last['version']}" if last.get("model") else str(last["version"])
