"""The `evaluate` stage: an optimized detector (and its PyTorch checkpoint) over a prepared split on Dask -> KPIs.

Files in:  `optimized` (`paths.optimized`: backend.json + artifacts, latency.json), `model` (`paths.model`,
           optional: the PyTorch reference), `data` (`paths.prepared`: the `evaluate.split` shards).
Files out (`out` = `paths.eval`, built in a temporary sibling and renamed into place on success):
    kpis.json                     DVC metrics: mAP, NDS, per class / range, latency, reference, delta, lineage
    pr/<class>.csv                DVC plots: precision-recall at the 2 m threshold (101 points)
    report/predictions.parquet    every GT / optimized / reference box, sorted (pfactory.evaluate.predictions)
    report/kitti/{ground_truth,optimized,reference}/<frame_id>.txt   KITTI label / result files
    report/per_frame.json         TP/FP/FN per frame and class (error analysis), both models
    report/pr_curves.json         PR curves of every class and distance threshold, both models
    report/pr.png, report/bev/NN_<frame_id>.png   PR curves; BEV of the worst frames
    report/timings.json           per task: worker, pid, load/read/infer seconds; per run: throughput, overhead
Metrics back: flat dict with mAP, NDS, reference_mAP, delta_mAP, frames, data_hash, kpis_path, throughput and
the MLflow scalars (`eval/...`, `time/...`; docs/EVALUATE.md). The work: `pfactory.evaluate.evaluation`.

Run: `python -m tasks.evaluate [-S evaluate.workers=2 ...]` (DVC; paths from params.yaml) or
`factory evaluate --model OPTIMIZED --data PREPARED --out DIR [--reference MODEL] [--dask ADDRESS|local:N]`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pfactory.evaluate.params import EvaluateParams
from pfactory.section import section_of

STAGE = "evaluate"


def run(
    params: Any,
    optimized: Path,
    model: Path | None,
    data: Path,
    out: Path,
    dask_address: str | None = None,
    track: bool = True,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Evaluate `optimized` (and `model`, the PyTorch reference, unless None) on `data`; build `out`.

    `dask_address`: None -> `evaluate.dask_address` -> a LocalCluster of `evaluate.workers`; "local:N"; or a
    scheduler address. `track`: one MLflow run (`pfactory.tracking.stage_run`). `progress`: a rich bar on
    stderr (None = when stderr is a terminal). Raises `EvaluateInputError` on a bad input (before any
    work starts), `EvaluateTaskError` when a unit fails on a worker.
    """
    from pfactory.evaluate.evaluation import evaluate
    from pfactory.tracking import configure_environment

    ev = section_of(params, STAGE, EvaluateParams)
    configure_environment()  # Dask scratch inside the project, offline MLflow
    address = dask_address or ev.dask_address
    if progress is None:
        progress = sys.stderr.isatty()
    args = (
        ev,
        Path(optimized),
        None if model is None else Path(model),
        Path(data),
        Path(out),
        address,
        progress,
    )
    if not track:
        return evaluate(*args, None)
    from pfactory.tracking import stage_run

    with stage_run(STAGE, ev.model_dump(mode="json")) as active:
        return evaluate(*args, active)


def main(argv: list[str] | None = None) -> None:
    from pfactory.cli_stage import stage_main

    def body(p: Any) -> dict:
        from pfactory.evaluate.distributed import EvaluateTaskError
        from pfactory.evaluate.inputs import EvaluateInputError

        try:
            return run(
                p, Path(p.paths.optimized), Path(p.paths.model), Path(p.paths.prepared), Path(p.paths.eval)
            )
        except EvaluateInputError as e:  # bad inputs: usage error, nothing ran
            print(f"evaluate: {e}", file=sys.stderr)
            sys.exit(2)
        except (EvaluateTaskError, ConnectionError) as e:  # it ran and failed
            print(f"evaluate: {e}", file=sys.stderr)
            sys.exit(1)

    stage_main(STAGE, argv, body)


if __name__ == "__main__":
    main()
