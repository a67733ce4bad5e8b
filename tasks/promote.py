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
With a team's registry the candidate is registered in `<model>-candidates`; a user who may not move the alias
(an engineer) gets the decision "awaiting-maintainer" (gated, not promoted, who may promote it), exit 0.

Run: `python -m tasks.promote [--run-id ID] [--dry-run] [-S promote.min_map=0.5 ...]` (DVC; paths from
params.yaml; run id default: $PFACTORY_PARENT_RUN_ID) or `factory promote RUN_OR_VERSION [--dry-run]`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pfactory import artifacts as af
from pfactory.evaluate.params import EvaluateParams
from pfactory.registry.params import PromoteParams
from pfactory.section import section_of

# What this stage reads of params.yaml (besides `paths`): its gates, and `evaluate` to re-evaluate a champion.
SECTIONS = {"promote": PromoteParams, "evaluate": EvaluateParams}

STAGE = "promote"
PROMOTION_FILE = af.PROMOTION


def _log_result(result: dict[str, Any]) -> None:
    import mlflow

    metrics = {"promote/promoted": float(result["decision"] == "promoted")}
    if result["version"] is not None:
        metrics["promote/version"] = float(result["version"])
    for g in result["gates"]:
        key = g["name"].replace("/", "_").replace("+", "-inf")  # MLflow names allow no "+" (range "40+")
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
    re-evaluates the champion when its evaluation data differs; None = `pfactory.evaluate` with `params.evaluate`.
    """
    from pfactory.registry.candidates import champion_evaluator
    from pfactory.registry.promotion import Candidate, promote

    prm = section_of(params, STAGE, PromoteParams)
    fn = evaluate_fn or champion_evaluator(params)
    optimized, eval_dir, data, release = Path(optimized), Path(eval_dir), Path(data), Path(release)
    if not track:
        if run_id is None and not dry_run:
            raise ValueError("run(track=False) needs run_id: the candidate's files are logged to that run")
        return promote(prm, Candidate(optimized, eval_dir / af.KPIS, run_id), data, release, dry_run, fn, False)
    from pfactory.tracking import stage_run

    with stage_run(STAGE, prm.model_dump(mode="json")) as active:
        candidate = Candidate(optimized, eval_dir / af.KPIS, run_id or active.info.run_id)
        # A team member who may not move the alias gets a gated candidate "awaiting-maintainer", exit 0.
        result = promote(prm, candidate, data, release, dry_run, fn, require_permission=False)
        _log_result(result)
        result["mlflow_run_id"] = active.info.run_id
    return result


def main(argv: list[str] | None = None) -> None:
    import argparse

    from pfactory.fsutil import atomic_write_json
    from pfactory.registry.release import write_empty_release
    from pfactory.tracking import PARENT_ENV
    from tasks._stage import stage_main

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
        result = run(
            p,
            args.optimized or Path(p.paths.optimized),
            args.eval_dir or Path(p.paths.eval),
            args.data or Path(p.paths.prepared),
            release,
            run_id=args.run_id,
            dry_run=args.dry_run,
        )
        if not release.exists():
            write_empty_release(release, p.promote, result)
        # The decision record the pipeline flow reads (dvc.yaml: a metrics file of this stage).
        atomic_write_json(Path(p.paths.artifacts) / PROMOTION_FILE, result)
        return result

    # Missing or unreadable evidence, or the registry refused: the stage failed (a refused gate is not).
    stage_main(STAGE, argv, body, add_arguments, sections=SECTIONS)


if __name__ == "__main__":
    main()
