"""The prepare stage's lineage: the prepared output's digest and its MLflow record.

`log_mlflow(result, raw)` logs the raw dataset as an MLflow dataset input (name = the raw directory's or
prefix's name, digest = the first 32 hex digits of its content sha256, the full hash in the input's tags; a
local directory is a LocalArtifactDatasetSource, an `s3://` prefix MLflow's S3 source), the prepared data's
hash, the counts and timings as metrics, and manifest.json + rejected.jsonl as artifacts (read back from the
published output, local or on object storage). Call it inside the stage's MLflow run.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from pfactory.prepare.stage import PrepareResult
from pfactory.storage import artifacts as af
from pfactory.storage.fsutil import sha256_bytes
from pfactory.storage.objects import Location, is_url


def prepared_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the prepared output: over its shard hashes and the rejected list's hash."""
    lines = [f"{s['file']}\t{s['sha256']}" for split in manifest["splits"].values() for s in split["shards"]]
    lines.append(f"{manifest['rejected']['file']}\t{manifest['rejected']['sha256']}")
    return sha256_bytes("\n".join(lines).encode())


def log_mlflow(result: PrepareResult, raw: str | Path) -> None:
    """MLflow: the raw dataset as an input, metrics, the manifest and refusals as artifacts."""
    import tempfile

    import mlflow
    from mlflow.data.dataset_source_registry import get_registered_sources, resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    m = result.manifest
    src_sha = m["source"]["sha256"]
    with warnings.catch_warnings():  # MLflow registers two identical local sources and says so
        warnings.simplefilter("ignore")
        if is_url(raw):  # s3://... -> MLflow's S3 artifact source
            source, name = (
                resolve_dataset_source(str(raw).rstrip("/")),
                str(raw).rstrip("/").rsplit("/", 1)[-1],
            )
        else:
            local = next(s for s in get_registered_sources() if s.__name__ == "LocalArtifactDatasetSource")
            source, name = local(str(Path(raw).resolve())), Path(raw).resolve().name
        dataset = MetaDataset(source, name=name, digest=src_sha[:32])
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
    with tempfile.TemporaryDirectory() as td:  # the published files, also when `out` is a URL
        for name in (af.PREPARED_MANIFEST, af.REJECTED):
            (Path(td) / name).write_bytes(Location(result.out).read_bytes(name))
            mlflow.log_artifact(str(Path(td) / name), artifact_path="prepare")
