"""The `train` stage: prepared shards (`paths.prepared`) -> a trained detector (`paths.model`).

Files out: checkpoint.pt, model.pt + model_config.json, curves.json, val_curves.json,
metrics.json (see `pfactory.train.trainer`). Metrics back: the summary dict.

Run: `python -m tasks.train [-S train.epochs=5 ...]` (what dvc.yaml calls; paths from params.yaml),
`factory train --data DIR --out DIR`, or `torchrun --nproc_per_node N -m tasks.train` for DDP.
Resumes from its checkpoint when it belongs to the same params and data: `$PFACTORY_RESUME_DIR/train/`
when that is set (a pipeline run's workspace keeps it there, outside DVC's outputs, which DVC deletes before
it reruns the stage: `flows.workspace`), else `out/checkpoint.pt`. SIGTERM: checkpoint, then exit 143.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks._command import Command, Option

STAGE = "train"
RESUME_ENV = "PFACTORY_RESUME_DIR"  # set by the pipeline's workspace: where stages keep what a resume needs


def sections() -> Mapping[str, type]:
    """What this stage reads of params.yaml (besides `paths`), and `evaluate.score_threshold` (`SHARED`)."""
    from pfactory.detectors.params import ModelSection
    from pfactory.train.params import TrainParams

    return {"train": TrainParams, "model": ModelSection}


def run(params: Any, data: str | Path, out: Path, track: bool = True, **options: Any) -> dict[str, Any]:
    """Train the architecture `params.model.arch` with `params.train` on `data`, writing into `out`; returns the summary.

    `data` may be an `s3://` prepared output: training reads a verified local copy of it (manifest first,
    every file's sha256 checked) under `paths.artifacts/.state/prepared`. `options` go to
    `pfactory.train.trainer.Trainer`: `max_steps` (overrides `train.max_steps`), `loader_factory` (replaces
    the shard loader: tests), `progress` (the rich bar; default: when stderr is a terminal), `resume_dir`
    (where the checkpoint written while training lives; default: `out`).
    """
    from pfactory.data.storage import is_url, local_prepared
    from pfactory.train.trainer import Trainer

    if is_url(data):
        data = local_prepared(data, Path(params.paths.artifacts) / ".state" / "prepared")
    return Trainer(params, data, out, track, **options).train()


def body(params: Any, o: Any) -> dict | None:
    """The stage's work (`tasks._stage.run_stage`); `o`: the values of `COMMAND.options`.
    With a team's Prefect server, training waits for one of its slots (pfactory/team/slots.py); else no-op."""
    from pfactory.team import slots

    resume = os.environ.get(RESUME_ENV)
    resume_dir = Path(resume) / STAGE if resume else None
    with slots.training_slot(slots.run_label(), slots.user()) as slot:
        summary = run(params, o.data or params.paths.prepared, o.out or Path(params.paths.model), not o.no_track,
                      resume_dir=resume_dir)  # fmt: skip
    slots.record_on_run(summary.get("mlflow_run_id"), slot)
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return {k: v for k, v in summary.items() if k != "val"}


COMMAND = Command(
    STAGE,
    "Train the detector; resumes when OUT holds a checkpoint of the same params and data. Multi-process: "
    "torchrun --nproc_per_node N -m tasks.train.\n\n"
    "Example: factory train --data artifacts/prepared --out artifacts/model -S train.epochs=2",
    (
        Option("data", "Prepared shards: a directory or s3://bucket/prefix. Default: paths.prepared."),
        Option("out", "Model output directory (resumes from its checkpoint). Default: paths.model.", Path),
        Option("no_track", "Do not log to MLflow.", bool, False),
    ),
    body,
    sections,
)


def main(argv: list[str] | None = None) -> None:
    """`python -m tasks.train [--data DIR] [--out DIR] [--no-track] [-S k=v ...] [--params FILE]` (= `factory
    train`; defaults: paths.*)."""
    from tasks._stage import stage_main

    stage_main(COMMAND, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
