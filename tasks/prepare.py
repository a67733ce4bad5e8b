"""The `prepare` stage: a raw dataset (paths.raw) -> training-ready shards (paths.prepared).

Files in: a KITTI- or nuScenes-layout dataset directory. Files out: `manifest.json`,
`rejected.jsonl`, `{train,val}/shard-*.parquet` (format: `pfactory.data.shards`), written
atomically. Metrics back: frame counts per split, refused frames, throughput, seconds per part.
Lineage: an MLflow run "prepare" with the raw dataset as an MLflow dataset input (name = the
raw directory's name, digest = the first 32 hex digits of its content sha256, the full hash
in the input's tags), the prepared data's hash, the counts and the timings.

Run: `python -m tasks.prepare [-S prepare.key=value ...]` (what dvc.yaml calls) or
`factory prepare --raw DIR|URL --out DIR|URL [--dask local:N|tcp://HOST:PORT]`: `raw`/`out` may be fsspec
URLs (`s3://bucket/prefix`, `pfactory.data.storage`); with a cluster (`--dask`, `prepare.dask_address`, or
`prepare.workers` > 1) the work runs in units on Dask (`pfactory.data.scaleout`), same bytes. Exit status 1 when more than
`prepare.max_reject_fraction` of the frames are refused (the output is still written, with
`"passed": false` in its manifest, so the refusals can be read).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pfactory.data.errors import RejectFractionExceeded
from pfactory.data.lineage import log_mlflow, prepared_digest
from pfactory.data.params import PrepareParams
from pfactory.data.prepare import PrepareResult
from pfactory.data.scaleout import prepare_data

SECTIONS = {"prepare": PrepareParams}  # what this stage reads of params.yaml (besides `paths`)


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
    p = params.prepare
    if not track:
        return _metrics(prepare_data(raw, out, p, dask_address, progress))
    from pfactory.tracking import stage_run

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
    return {
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.metrics.items()},
        "raw_sha256": result.manifest["source"]["sha256"],
        "prepared_sha256": prepared_digest(result.manifest),
        "out": str(result.out),
    }


def main(argv: list[str] | None = None) -> None:
    """`python -m tasks.prepare [--raw R] [--out O] [--dask A] [-S k=v ...]` (= `factory prepare`; defaults:
    paths.*, prepare.dask_address)."""
    import argparse

    from tasks._stage import stage_main

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--raw", default=None, help="raw dataset: a directory or s3://bucket/prefix")
        parser.add_argument("--out", default=None, help="shards: a directory or s3://bucket/prefix")
        parser.add_argument("--dask", default=None, help="local:N (a LocalCluster) or tcp://host:8786")

    def body(params: Any, args: argparse.Namespace) -> dict[str, Any]:
        return run(
            params, args.raw or params.paths.raw, args.out or params.paths.prepared, dask_address=args.dask
        )

    # Too many refused frames (the output is still written), not a dataset, an output that cannot be
    # written, a task that failed on a worker: the stage failed (each error's own exit code, 1).
    stage_main("prepare", argv, body, add_arguments, sections=SECTIONS)


if __name__ == "__main__":
    main(sys.argv[1:])
