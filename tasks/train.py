"""The `train` stage: prepared shards (`paths.prepared`) -> a trained detector (`paths.model`).

Out: checkpoint.pt, model.pt + model_config.json, curves.json, val_curves.json, metrics.json; the summary.

Run: `python -m tasks.train [-S train.epochs=5 ...]` (what dvc.yaml calls; paths from params.yaml),
`factory train --data DIR --out DIR`, or `torchrun --nproc_per_node N -m tasks.train` for DDP.
Without torchrun: `--nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT]` starts the agent
itself (`pfactory.train.runtime.launch`, workers run `_worker`); only local rank 0 of `--node-rank 0` writes
(its `--out`), the other nodes' `--out` is left untouched; docs/MODEL.md "DDP".
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
    """What this stage reads of params.yaml (besides `paths`): `evaluate` only through its view (the score cut)."""
    from pfactory.detectors.params import ModelSection
    from pfactory.metrics.cut import DetectionCut
    from pfactory.train.params import TrainParams

    return {"train": TrainParams, "model": ModelSection, "evaluate": DetectionCut}


def run(params: Any, data: str | Path, out: Path, track: bool = True, **options: Any) -> dict[str, Any]:
    """Train the architecture `params.model.arch` with `params.train` on `data`, writing into `out`; returns the summary.

    `data` may be an `s3://` prepared output: training reads a verified local copy of it (manifest first,
    every file's sha256 checked) under `paths.artifacts/.state/prepared`. `options` go to
    `pfactory.train.trainer.Trainer`: `max_steps` (overrides `train.max_steps`), `loader_factory` (replaces
    the shard loader: tests), `progress` (the rich bar; default: when stderr is a terminal), `resume_dir`
    (where the checkpoint written while training lives; default: `out`).
    """
    from pfactory.train.trainer import Trainer

    return Trainer(params, _local(params, data), out, track, **options).train()


def _local(params: Any, data: str | Path) -> str | Path:
    """`data`, or for an s3:// URL its verified local copy (once per node: before a launch, not per worker)."""
    from pfactory.prepare.publish import is_url, local_prepared

    return local_prepared(data, Path(params.paths.artifacts) / ".state" / "prepared") if is_url(data) else data


def _worker(doc: dict[str, Any], data: str, out: Path, track: bool, resume_dir: Path | None, node_rank: int,
            nnodes: int, timeout_s: float) -> dict[str, Any] | None:  # fmt: skip
    """One process of a launch (`pfactory.train.runtime.launch` spawns it, torchrun's environment set). `doc`:
    the launching process's validated params as JSON. Takes its global rank from `node_rank` once the nodes
    agree, checks that every rank resumes from the same step, trains; the summary on global rank 0, else None."""
    from pfactory.config.params_file import sections_model, validate
    from pfactory.train import runtime as rt
    from pfactory.train.trainer import Trainer

    try:
        digest = rt.params_digest({k: v for k, v in doc.items() if k != "paths"})
        rank = rt.adopt_node_rank(node_rank, nnodes, digest, timeout_s)
        params = validate(sections_model(tuple(sections().items())), doc, "params of the launching process")
        trainer = Trainer(params, data, out, track, resume_dir=resume_dir, progress=False)
        rt.check_same_start(trainer.step, trainer.finished)
        summary = trainer.train()
    except Exception as e:
        rt.exit_worker(STAGE, e)  # an error a user can act on: exits with its code
        raise
    return summary if rank == 0 else None


def body(params: Any, o: Any) -> dict | None:
    """The stage's work (`tasks._stage.run_stage`); `o`: the values of `COMMAND.options`.
    With a team's Prefect server, training waits for one of its slots (pfactory/team/slots.py); else no-op."""
    from pfactory.team import slots

    resume = os.environ.get(RESUME_ENV)
    resume_dir = Path(resume) / STAGE if resume else None
    data, out = o.data or params.paths.prepared, o.out or Path(params.paths.model)
    spec = None
    if "WORLD_SIZE" not in os.environ and "LOCAL_RANK" not in os.environ:  # else torchrun's worker already
        from pfactory.train.runtime import launch_spec

        spec = launch_spec(o.nproc_per_node, o.nnodes, o.node_rank, o.rdzv_endpoint, o.rdzv_id, o.rdzv_timeout, out,
                           params.train.batch_size)  # fmt: skip
    with slots.training_slot(slots.run_label(), slots.user()) as slot:
        if spec is not None and spec.world_size > 1:
            from pfactory.train.runtime import launch

            args = (params.model_dump(mode="json"), str(_local(params, data)), Path(out), not o.no_track, resume_dir,
                    spec.node_rank, spec.nnodes, spec.timeout_s)  # fmt: skip
            summary = launch(spec, _worker, args)
        else:
            summary = run(params, data, out, not o.no_track, resume_dir=resume_dir)
    if summary is None:  # a launch whose global rank 0 ran on another node
        print(f"train: node {spec and spec.node_rank} done; --node-rank 0 wrote the outputs", file=sys.stderr)
        return None
    slots.record_on_run(summary.get("mlflow_run_id"), slot)
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return {k: v for k, v in summary.items() if k != "val"}


COMMAND = Command(
    STAGE,
    "Train the detector; resumes when OUT holds a checkpoint of the same params and data. Multi-process: "
    "--nproc-per-node N; multi-node: --nnodes M --node-rank R --rdzv-endpoint HOST:PORT on every node.\n\n"
    "Example: factory train --data artifacts/prepared --out artifacts/model -S train.epochs=2\n\n"
    "Two nodes: factory train --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400 (--node-rank 1 on the other)",
    (
        Option("data", "Prepared shards: a directory or s3://bucket/prefix. Default: paths.prepared."),
        Option("out", "Model output directory (resumes from its checkpoint). Default: paths.model.", Path),
        Option("no_track", "Do not log to MLflow.", bool, False),
        Option("nproc_per_node", "Training processes on this node (DDP; gloo on CPU).", int, 1),
        Option("nnodes", "Nodes taking part (each runs this command with its own --node-rank).", int, 1),
        Option(
            "node_rank", "This node's rank, 0..NNODES-1; node 0 writes the outputs. Required with --nnodes > 1.", int
        ),
        Option(
            "rdzv_endpoint",
            "HOST:PORT of node 0, where the nodes meet (c10d rendezvous; node 0 listens). Required with --nnodes > 1.",
        ),
        Option("rdzv_id", "Rendezvous id, the same on every node. Default: train-<name of --out>."),
        Option("rdzv_timeout", "Seconds the nodes wait for each other to join.", int, 600),  # = launch's default
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
