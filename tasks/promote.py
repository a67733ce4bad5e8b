"""The `promote` stage: a candidate -> a new registered version -> gates -> `champion` alias + release.

Files in:  `optimized` (`paths.optimized`: backend.json, parity.json, latency.json, model files),
           `eval_dir` (`paths.eval`: kpis.json), `data` (`paths.prepared`: the evaluation data, used to
           re-evaluate the champion when it was evaluated on another data version).
Files out: `release` (`paths.release`, only on a promotion): the champion's files, MODEL_CARD.md,
           release.json, audit.jsonl (pfactory/promote/release.py).
Registry:  a new version of `promote.model_name` (its files logged to run `run_id`, the pipeline's run;
           default: this stage's own run), tagged with KPIs, parity, latency, data identity, run, commit;
           on a pass the `promote.alias` alias moves and an audit record is written.
Metrics back: `{"decision", "version", "champion_before", "champion_after", "gates", "reevaluated_champion",
           "release", ...}` (pfactory/promote/promotion.py), also logged to this stage's MLflow run.
A refusal by the gates exits 1 and says which gate failed by how much, unless `--no-fail-if-refused`: dvc.yaml
runs the stage so, because in a pipeline a refused candidate is an outcome (promotion.json), not an error.
With a team's registry the candidate is registered in `<model>-candidates`; a user who may not move the alias
(an engineer) gets the decision "awaiting-maintainer" (gated, not promoted, who may promote it), exit 0.

Run: `python -m tasks.promote [REF] [--run-id ID] [--dry-run] [--no-fail-if-refused] [-S promote.min_map=0.5 ...]`
or `factory promote` with the same arguments (one declaration: `COMMAND`); REF (a registered version, `last`,
a run id) gates a registered candidate instead of the files in `paths.optimized` + `paths.eval`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tasks._command import Command, Option

STAGE = "promote"


def sections() -> Mapping[str, type]:
    """What this stage reads of params.yaml (besides `paths`): its gates, and `evaluate` to re-evaluate a
    champion."""
    from pfactory.evaluate.params import EvaluateParams
    from pfactory.promote.params import PromoteParams

    return {"promote": PromoteParams, "evaluate": EvaluateParams}


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
    from pfactory.config.section import section_of
    from pfactory.promote.candidates import champion_evaluator
    from pfactory.promote.params import PromoteParams
    from pfactory.promote.promotion import Candidate, promote
    from pfactory.promote.report import log_result
    from pfactory.storage import artifacts as af

    prm = section_of(params, STAGE, PromoteParams)
    fn = evaluate_fn or champion_evaluator(params)
    optimized, eval_dir, data, release = Path(optimized), Path(eval_dir), Path(data), Path(release)
    if not track:
        if run_id is None and not dry_run:
            raise ValueError("run(track=False) needs run_id: the candidate's files are logged to that run")
        return promote(prm, Candidate(optimized, eval_dir / af.KPIS, run_id), data, release, dry_run, fn, False)
    from pfactory.tracking.runs import stage_run

    with stage_run(STAGE, prm.model_dump(mode="json")) as active:
        candidate = Candidate(optimized, eval_dir / af.KPIS, run_id or active.info.run_id)
        # A team member who may not move the alias gets a gated candidate "awaiting-maintainer", exit 0.
        result = promote(prm, candidate, data, release, dry_run, fn, require_permission=False)
        log_result(result)
        result["mlflow_run_id"] = active.info.run_id
    return result


def body(p: Any, o: Any) -> dict:
    """The stage's body (`tasks._stage.run_stage`); `o`: the options of `tasks.options.COMMANDS["promote"]`.

    `o.ref` None: the candidate in `o.optimized` + `o.eval_dir` (`run`); else a registered version, `last` or a
    run id through the same gates (`pfactory.promote.candidates.promote_ref`). Either way the decision is
    recorded (`pfactory.promote.release.record_decision`: promotion.json, the gate table; a refusal by the
    gates exits 1 only with `o.fail_if_refused`). Missing or unreadable evidence, or the registry refused:
    the stage failed."""
    from pfactory.promote.release import record_decision
    from pfactory.tracking.runs import PARENT_ENV

    release = o.release or Path(p.paths.release)
    data = o.data or Path(p.paths.prepared)
    if o.ref is None:
        optimized, eval_dir = o.optimized or Path(p.paths.optimized), o.eval_dir or Path(p.paths.eval)
        run_id = o.run_id or os.environ.get(PARENT_ENV) or None
        result = run(p, optimized, eval_dir, data, release, run_id=run_id, dry_run=o.dry_run)
    else:
        from pfactory.promote.candidates import last_registered, promote_ref

        ref = last_registered(Path(p.paths.artifacts)) if o.ref == "last" else o.ref
        result = promote_ref(p, ref, data, release, o.dry_run)
    record_decision(result, Path(p.paths.artifacts), release, p.promote, o.fail_if_refused)
    return result


COMMAND = Command(
    STAGE,
    "Register a candidate, gate it (params.promote) against the champion, and on a pass move the alias.\n\n"
    "REF absent: the candidate in --optimized + --eval (what dvc.yaml runs). REF: a registered version "
    "(3, MODEL/3, MODEL@alias), `last` (the version <paths.artifacts>/promotion.json names) or an MLflow "
    "run id (its candidate files). The decision is written to <paths.artifacts>/promotion.json (not by a dry "
    "run); the gate table goes to stderr, the result as JSON to stdout.\n"
    "Exit 0 promoted (or a dry run that would promote, or gated and awaiting a maintainer), 1 refused "
    "(0 with --no-fail-if-refused) / bad evidence / lock timeout, 2 unknown version or run.\n"
    "Examples: factory promote --dry-run  |  factory promote 3 --dry-run  |  factory promote last  |  "
    "factory promote 0a1b...(run id) -S promote.min_map=0.5",
    (
        Option("ref", "A registered version (3, MODEL/3, MODEL@alias), `last`, or an MLflow run id. Default: "
               "the candidate in --optimized and --eval.", positional=True),
        Option("optimized", "The candidate's optimize output. Default: paths.optimized.", Path),
        Option("eval_dir", "The candidate's evaluate output (kpis.json). Default: paths.eval.", Path, flag="--eval"),
        Option("data", "Evaluation data, for a champion re-evaluation. Default: paths.prepared.", Path),
        Option("release", "Release folder. Default: paths.release.", Path),
        Option("run_id", "MLflow run the candidate's files are logged to. Default: $PFACTORY_PARENT_RUN_ID, "
               "else this stage's own run."),
        Option("dry_run", "Gate only: register and change nothing.", bool, False),
        Option("fail_if_refused", "Exit 1 when the gates refuse (dvc.yaml runs the stage with "
               "--no-fail-if-refused: a refusal is a result the pipeline records).", bool, True),
    ),
    body,
    sections,
)


def main(argv: list[str] | None = None) -> None:
    """`python -m tasks.promote [REF] [--dry-run] [--no-fail-if-refused] [-S k=v ...]` (= `factory promote`)."""
    from tasks._stage import stage_main

    stage_main(COMMAND, argv)


if __name__ == "__main__":
    main()
