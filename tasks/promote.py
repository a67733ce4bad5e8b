"""The `promote` stage: a candidate -> a new registered version -> gates -> `champion` alias + release.

Files in:  `optimized` (`paths.optimized`: backend.json, parity.json, latency.json, model files),
           `eval_dir` (`paths.eval`: kpis.json), `data` (`paths.prepared`: the evaluation data, used to
           re-evaluate the champion when it was evaluated on another data version).
Files out: `release` (`paths.release`, only on a promotion): the champion's files, MODEL_CARD.md,
           release.json, audit.jsonl (pfactory/registry/release.py).
Registry:  a new version of `promote.model_name` (its files logged to run `run_id`, the pipeline's run;
           default: this stage's own run), tagged with KPIs, parity, latency, data identity, run, commit;
           on a pass the `promote.alias` alias moves and an audit record is written.
Metrics back: `{"decision", "version", "champion_before", "champion_after", "gates", "reevaluated_champion",
           "release", ...}` (pfactory/registry/promotion.py), also logged to this stage's MLflow run.
A refused candidate is an outcome, not an error: the stage exits 0 and says which gate failed by how much.

Run: `python -m tasks.promote [--run-id ID] [--dry-run] [-S promote.min_map=0.5 ...]` (DVC; paths from
params.yaml; run id default: $PFACTORY_PARENT_RUN_ID) or `factory promote RUN_OR_VERSION [--dry-run]`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pfactory.registry.params import PromoteParams

STAGE = "promote"
PROMOTION_FILE = "promotion.json"
RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def _section(params: Any) -> PromoteParams:
    """The promote section of the full `Params` (or a `PromoteParams` given directly)."""
    if isinstance(params, PromoteParams):
        return params
    section = getattr(params, "promote", None)
    if not isinstance(section, PromoteParams):
        raise TypeError("run() needs the project Params (with a `promote` section) or a PromoteParams")
    return section


def default_evaluate_fn(params: Any) -> Callable[[Path, Path], dict]:
    """`evaluate(optimized_dir, data_dir) -> kpis` through the evaluate stage (no MLflow, temporary output)."""

    def evaluate(optimized_dir: Path, data_dir: Path) -> dict:
        try:
            import tasks.evaluate
        except ImportError as e:
            raise RuntimeError(
                f"re-evaluating the champion needs the evaluate stage (tasks/evaluate.py): {e}"
            ) from e
        if isinstance(params, PromoteParams):
            raise TypeError(
                "re-evaluating the champion needs the full project Params, not only PromoteParams"
            )
        with tempfile.TemporaryDirectory(prefix="pfactory-reeval-") as tmp:
            out = Path(tmp) / "eval"
            tasks.evaluate.run(params, Path(optimized_dir), None, Path(data_dir), out, track=False)
            return json.loads((out / "kpis.json").read_text())

    return evaluate


def _log_result(result: dict[str, Any]) -> None:
    import mlflow

    metrics = {"promote/promoted": float(result["decision"] == "promoted")}
    if result["version"] is not None:
        metrics["promote/version"] = float(result["version"])
    for g in result["gates"]:
        key = g["name"].replace("/", "_")
        for field in ("value", "margin"):
            v = g[field]
            if isinstance(v, int | float) and not isinstance(v, bool):
                metrics[f"gate/{key}/{field}"] = float(v)
        metrics[f"gate/{key}/passed"] = float(bool(g["passed"]))
    mlflow.log_metrics(metrics)
    mlflow.set_tags({"promote.decision": result["decision"], "promote.version": str(result["version"])})
    mlflow.log_dict(result, "promote/result.json")


def run(
    params: Any,
    optimized: Path,
    eval_dir: Path,
    data: Path,
    release: Path,
    run_id: str | None = None,
    dry_run: bool = False,
    track: bool = True,
    evaluate_fn: Callable[[Path, Path], dict] | None = None,
) -> dict:
    """Register the candidate in `optimized` + `eval_dir/kpis.json`, gate it, promote it (module docstring).

    `run_id`: the MLflow run the candidate's files are logged to and the version points at (the pipeline's
    run); None = this stage's own run (needs `track`). `evaluate_fn(champion_optimized_dir, data) -> kpis`
    re-evaluates the champion when its evaluation data differs; None = the evaluate stage.
    """
    from pfactory.registry.promotion import Candidate, promote

    prm = _section(params)
    fn = evaluate_fn or default_evaluate_fn(params)
    optimized, eval_dir, data, release = Path(optimized), Path(eval_dir), Path(data), Path(release)
    if not track:
        if run_id is None and not dry_run:
            raise ValueError("run(track=False) needs run_id: the candidate's files are logged to that run")
        return promote(prm, Candidate(optimized, eval_dir / "kpis.json", run_id), data, release, dry_run, fn)
    from pfactory.tracking import stage_run

    with stage_run(STAGE, prm.model_dump(mode="json")) as active:
        candidate = Candidate(optimized, eval_dir / "kpis.json", run_id or active.info.run_id)
        result = promote(prm, candidate, data, release, dry_run, fn)
        _log_result(result)
        result["mlflow_run_id"] = active.info.run_id
    return result


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


def _run_candidate(c: Any, run_id: str, dst: Path) -> tuple[Path, Path]:
    """Download a run's candidate (its `candidate/` folder, else its or its stage runs' `optimized/` and
    kpis.json) into `dst`; returns (optimized dir, kpis.json)."""
    import mlflow

    from pfactory.registry import RegistryError

    run = c.get_run(run_id)
    runs = [run_id] + [
        r.info.run_id
        for r in c.search_runs(
            [run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'", max_results=100
        )
    ]
    found: dict[str, tuple[str, str]] = {}
    for rid in runs:
        for name, prefer in (("backend.json", "candidate/optimized"), ("kpis.json", "candidate/eval")):
            if name not in found and (path := _find_file(c, rid, name, prefer)):
                found[name] = (rid, path)
    missing = [n for n in ("backend.json", "kpis.json") if n not in found]
    if missing:
        raise RegistryError(
            f"run {run_id} (and its {len(runs) - 1} stage runs) has no {' or '.join(missing)} artifact: "
            "not a candidate (it needs the optimize and evaluate stages' outputs)"
        )
    rid, path = found["backend.json"]
    folder = path.rsplit("/", 1)[0] if "/" in path else ""
    optimized = Path(mlflow.artifacts.download_artifacts(run_id=rid, artifact_path=folder or None,
                                                         dst_path=str(dst / "optimized-dl")))  # fmt: skip
    rid, path = found["kpis.json"]
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
    run id (32 hex: its candidate files), through the same gates as the stage. Returns `run`'s dict."""
    from pfactory.registry import registry as reg
    from pfactory.registry.promotion import Candidate, promote, resolve

    prm = _section(params)
    fn = evaluate_fn or default_evaluate_fn(params)
    c = reg.client()
    with tempfile.TemporaryDirectory(prefix="pfactory-promote-") as tmp:
        if RUN_ID.match(ref):
            optimized, kpis = _run_candidate(c, ref, Path(tmp))
            candidate = Candidate(optimized, kpis, ref)
        else:
            name, version = resolve(c, ref, prm.model_name, prm.alias)
            if name != prm.model_name:
                prm = prm.model_copy(update={"model_name": name})
            files = reg.download_version(c, name, version, Path(tmp))
            tags = reg.get_version(c, name, version).tags
            candidate = Candidate(
                files / "optimized", files / "eval" / "kpis.json", reg.get_version(c, name, version).run_id,
                version, {"git_commit": tags.get("git.commit"), "git_dirty": tags.get("git.dirty")},
            )  # fmt: skip
        return promote(prm, candidate, Path(data), Path(release), dry_run, fn)


def _empty_release(release: Path, prm: PromoteParams, result: dict) -> None:
    """DVC requires a declared out to exist after its stage. When this run released nothing (refused, dry
    run) the folder says which version is the champion (None before any promotion) and where its files
    are: the champion's release was written by the run that promoted it, and the registry has its files."""
    from pfactory.fsutil import atomic_directory, atomic_write_json

    champion = result.get("champion_after")
    with atomic_directory(release) as tmp:
        atomic_write_json(
            tmp / "release.json",
            {
                "model": prm.model_name,
                "alias": prm.alias,
                "version": champion,
                "released_by_this_run": False,
                "decision": result.get("decision"),
                "reason": result.get("reason"),
                "files": f"models:/{prm.model_name}@{prm.alias}" if champion is not None else None,
            },
        )


def main(argv: list[str] | None = None) -> None:
    import argparse

    from pfactory.cli_stage import stage_main
    from pfactory.fsutil import atomic_write_json
    from pfactory.registry import EvidenceError, RegistryError
    from pfactory.tracking import PARENT_ENV

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--optimized", type=Path, default=None, help="default: paths.optimized")
        parser.add_argument("--eval", dest="eval_dir", type=Path, default=None, help="default: paths.eval")
        parser.add_argument("--data", type=Path, default=None, help="default: paths.prepared")
        parser.add_argument("--release", type=Path, default=None, help="default: paths.release")
        parser.add_argument(
            "--run-id", default=os.environ.get(PARENT_ENV) or None,
            help=f"MLflow run to log the candidate to (default: ${PARENT_ENV}, else this stage's run)",
        )  # fmt: skip
        parser.add_argument("--dry-run", action="store_true", help="gate only: register and change nothing")

    def body(p: Any, args: argparse.Namespace) -> dict:
        release = args.release or Path(p.paths.release)
        try:
            result = run(
                p,
                args.optimized or Path(p.paths.optimized),
                args.eval_dir or Path(p.paths.eval),
                args.data or Path(p.paths.prepared),
                release,
                run_id=args.run_id,
                dry_run=args.dry_run,
            )
        except (EvidenceError, RegistryError) as e:
            print(f"promote: {e}", file=sys.stderr)
            sys.exit(1)
        if not release.exists():
            _empty_release(release, p.promote, result)
        # The decision record the pipeline flow reads (dvc.yaml: a metrics file of this stage).
        atomic_write_json(Path(p.paths.artifacts) / PROMOTION_FILE, result)
        return result

    stage_main(STAGE, argv, body, add_arguments)


if __name__ == "__main__":
    main()
