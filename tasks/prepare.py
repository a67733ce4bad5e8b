"""The `prepare` stage: a raw dataset (paths.raw) -> training-ready shards (paths.prepared).

Files in: a raw dataset directory of any registered layout (KITTI, nuScenes, plugins: docs/DATASETS.md). Files out: `manifest.json`,
`rejected.jsonl`, `{train,val}/shard-*.parquet` (format: `pfactory.prepare.shards`), written
atomically. Metrics back: frame counts per split, refused frames, throughput, seconds per part.
Lineage: an MLflow run "prepare" with the raw dataset as an MLflow dataset input (name = the
raw directory's name, digest = the first 32 hex digits of its content sha256, the full hash
in the input's tags), the prepared data's hash, the counts and the timings.

Run: `python -m tasks.prepare [-S prepare.key=value ...]` (what dvc.yaml calls) or
`factory prepare --raw DIR|URL --out DIR|URL [--dask local:N|tcp://HOST:PORT]`: `raw`/`out` may be fsspec
URLs (`s3://bucket/prefix`, `pfactory.storage.objects`); with a cluster (`--dask`, `prepare.dask_address`, or
`prepare.workers` > 1) the work runs in units on Dask (`pfactory.prepare.scaleout`), same bytes. Exit status 1 when more than
`prepare.max_reject_fraction` of the frames are refused (the output is still written, with
`"passed": false` in its manifest, so the refusals can be read).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks._command import DASK_HELP, Command, Option

if TYPE_CHECKING:
    from pfactory.prepare.stage import PrepareResult

STAGE = "prepare"


def sections() -> Mapping[str, type]:
    """What this stage reads of params.yaml (besides `paths`)."""
    from pfactory.prepare.params import PrepareParams

    return {"prepare": PrepareParams}


def run(
    params: Any,
    raw: str | Path,
    out: str | Path,
    track: bool = True,
    progress: Callable[[int, int], None] | None = None,
    dask_address: str | None = None,
) -> dict[str, Any]:
    """Prepare `raw` into `out` with `params.prepare`; returns the metrics.

    `dask_address` ("local:N" or a scheduler address) overrides `prepare.dask_address`. `track=False` skips
    MLflow (benchmarks). Raises RejectFractionExceeded (after writing the output and, when tracking, logging
    the run as FAILED with its metrics), DatasetError (`raw` is not a dataset), OutputError (`out` cannot be
    written), ConnectionError (no scheduler answers) and PrepareTaskError (a task failed on a worker).
    """
    from pfactory.prepare.errors import RejectFractionExceeded
    from pfactory.prepare.lineage import log_mlflow
    from pfactory.prepare.scaleout import prepare_data

    p = params.prepare
    if not track:
        return _metrics(prepare_data(raw, out, p, dask_address, progress))
    from pfactory.tracking.runs import stage_run

    with stage_run("prepare", p.model_dump(mode="json")):
        try:
            result = prepare_data(raw, out, p, dask_address, progress)
        except RejectFractionExceeded as e:
            if e.result is not None:
                log_mlflow(e.result, raw)
            raise
        log_mlflow(result, raw)
    return _metrics(result)


def _metrics(result: PrepareResult) -> dict[str, Any]:
    from pfactory.prepare.lineage import prepared_digest

    return {
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.metrics.items()},
        "raw_sha256": result.manifest["source"]["sha256"],
        "prepared_sha256": prepared_digest(result.manifest),
        "out": str(result.out),
    }


def body(params: Any, o: Any) -> dict[str, Any]:
    """The stage's work (`tasks._stage.run_stage`); `o`: the values of `COMMAND.options`.
    Too many refused frames (the output is still written), not a dataset, an output that cannot be written,
    a task that failed on a worker: the stage failed (each error's own exit code, 1)."""
    return run(params, o.raw or params.paths.raw, o.out or params.paths.prepared, dask_address=o.dask)


COMMAND = Command(
    STAGE,
    "Prepare a raw dataset into Parquet shards (+ manifest.json, rejected.jsonl).\n\n"
    "With --dask (or prepare.workers > 1) the frames are prepared in units on a Dask cluster; the files are "
    "the same bytes as one process writes. Exit 1 when more than prepare.max_reject_fraction of the frames "
    "are refused, a task fails on a worker or the scheduler cannot be reached.\n"
    "Example: factory prepare --raw ../shared/data/real/kitti --out /tmp/prepared\n"
    "Example: factory prepare --raw s3://bucket/raw/kitti --out s3://bucket/prepared --dask local:2",
    (
        Option("raw", "Raw dataset (any registered layout: KITTI, nuScenes, plugins): a directory or s3://bucket/prefix. "
               "Default: paths.raw."),
        Option("out", "Output for shards: a directory or s3://bucket/prefix. Default: paths.prepared."),
        Option("dask", DASK_HELP.format(key="prepare.dask_address")),
    ),
    body,
    sections,
)


def main(argv: list[str] | None = None) -> None:
    """`python -m tasks.prepare [--raw R] [--out O] [--dask A] [-S k=v ...]` (= `factory prepare`)."""
    from tasks._stage import stage_main

    stage_main(COMMAND, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
