"""The `prepare` stage: a raw dataset (paths.raw) -> training-ready shards (paths.prepared).

Files in: a KITTI- or nuScenes-layout dataset directory. Files out: `manifest.json`,
`rejected.jsonl`, `{train,val}/shard-*.parquet` (format: `pfactory.data.shards`), written
atomically. Metrics back: frame counts per split, refused frames, throughput, seconds per part.
Lineage: an MLflow run "prepare" with the raw dataset as an MLflow dataset input (name = the
raw directory's name, digest = the first 32 hex digits of its content sha256, the full hash
in the input's tags), the prepared data's hash, the counts and the timings.

Run: `python -m tasks.prepare [-S prepare.key=value ...]` (what dvc.yaml calls) or
`factory prepare --raw DIR --out DIR`. Exit status 1 when more than
`prepare.max_reject_fraction` of the frames are refused (the output is still written, with
`"passed": false` in its manifest, so the refusals can be read).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pfactory import artifacts as af
from pfactory.config import Params
from pfactory.data.errors import RejectFractionExceeded
from pfactory.data.prepare import PrepareResult, prepare_dataset
from pfactory.fsutil import sha256_bytes


def prepared_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the prepared output: over its shard hashes and the rejected list's hash."""
    lines = [f"{s['file']}\t{s['sha256']}" for split in manifest["splits"].values() for s in split["shards"]]
    lines.append(f"{manifest['rejected']['file']}\t{manifest['rejected']['sha256']}")
    return sha256_bytes("\n".join(lines).encode())


def _log(result: PrepareResult, raw: Path) -> None:
    """MLflow: the raw dataset as an input, metrics, the manifest and refusals as artifacts."""
    import mlflow
    from mlflow.data.dataset_source_registry import get_registered_sources
    from mlflow.data.meta_dataset import MetaDataset

    m = result.manifest
    src_sha = m["source"]["sha256"]
    local = next(s for s in get_registered_sources() if s.__name__ == "LocalArtifactDatasetSource")
    with warnings.catch_warnings():  # MLflow registers two identical local sources and says so
        warnings.simplefilter("ignore")
        dataset = MetaDataset(
            local(str(Path(raw).resolve())), name=Path(raw).resolve().name, digest=src_sha[:32]
        )
    mlflow.log_input(
        dataset,
        context="prepare",
        tags={"sha256": src_sha, "layout": m["source"]["layout"], "frames": str(m["source"]["frames"])},
    )
    out_sha = prepared_digest(m)
    mlflow.set_tags(
        {
            "prepare.raw_sha256": src_sha,
            "prepare.prepared_sha256": out_sha,
            "prepare.passed": str(m["passed"]),
        }
    )
    mlflow.log_metrics({f"prepare.{k}": float(v) for k, v in result.metrics.items()})
    mlflow.log_artifact(str(result.out / af.PREPARED_MANIFEST), artifact_path="prepare")
    mlflow.log_artifact(str(result.out / af.REJECTED), artifact_path="prepare")


def run(
    params: Params,
    raw: Path,
    out: Path,
    track: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Prepare `raw` into `out` with `params.prepare`; returns the metrics.

    `track=False` skips MLflow (benchmarks). Raises RejectFractionExceeded (after writing the
    output and, when tracking, logging the run as FAILED with its metrics) and DatasetError
    (`raw` is not a dataset).
    """
    p = params.prepare
    if not track:
        return _metrics(prepare_dataset(raw, out, p, progress))
    from pfactory.tracking import stage_run

    with stage_run("prepare", p.model_dump(mode="json")):
        try:
            result = prepare_dataset(raw, out, p, progress)
        except RejectFractionExceeded as e:
            if e.result is not None:
                _log(e.result, raw)
            raise
        _log(result, raw)
    return _metrics(result)


def _metrics(result: PrepareResult) -> dict[str, Any]:
    return {
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.metrics.items()},
        "raw_sha256": result.manifest["source"]["sha256"],
        "prepared_sha256": prepared_digest(result.manifest),
        "out": str(result.out),
    }


def main(argv: list[str] | None = None) -> None:
    """`python -m tasks.prepare [--raw DIR] [--out DIR] [-S k=v ...]` (= `factory prepare`; defaults: paths.*)."""
    import argparse

    from pfactory.sensors.errors import DatasetError
    from tasks._stage import stage_main

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--raw", type=Path, default=None, help="raw dataset (default: paths.raw)")
        parser.add_argument(
            "--out", type=Path, default=None, help="shards directory (default: paths.prepared)"
        )

    def body(params: Params, args: argparse.Namespace) -> dict[str, Any]:
        return run(params, args.raw or Path(params.paths.raw), args.out or Path(params.paths.prepared))

    # Too many refused frames (the output is still written) or not a dataset: the stage failed.
    stage_main("prepare", argv, body, add_arguments, failures={RejectFractionExceeded: 1, DatasetError: 1})


if __name__ == "__main__":
    main(sys.argv[1:])
