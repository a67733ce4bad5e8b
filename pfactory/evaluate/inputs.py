"""The evaluate stage's inputs, checked before any worker starts: model artifact, reference, data, work units.

In:  an optimized directory (`backend.json`), optionally a trained-model directory (the PyTorch
     reference), a prepared directory and the split to evaluate.
Out: `EvalInputs`: what each worker needs to load its models (`RunnerSpec`, picklable, with the
     sha256 that keys the per-process model cache), the data (`DataSpec`), the work units (`WorkUnit`:
     whole row groups of one shard, never a frame) and the lineage (data hash, model hashes, latency).
Every problem is an `EvaluateInputError` naming the file, the field and what was expected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pfactory.runtime.failures import EXIT_USAGE, UserError
from pfactory.storage import artifacts as af
from pfactory.storage.fsutil import check_listed_file, sha256_bytes, sha256_file


class EvaluateInputError(UserError, ValueError):
    """A bad input of the evaluate stage (exit 2 from the CLI): the message names file, field, expectation."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class RunnerSpec:
    """How a worker builds one model: `kind` "optimized" (an artifact of `path`) or "reference" (PyTorch)."""

    kind: str
    path: str
    sha256: str  # of the artifact / of model.pt: with `path`, the key of the worker's model cache
    backend: str  # optimized: onnxruntime | tensorrt; reference: pytorch
    precision: str  # optimized: fp32 | fp16 | int8; reference: eager
    device: str

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.precision}"


@dataclass(frozen=True)
class DataSpec:
    """The prepared split every unit reads from, and what turns outputs into detections."""

    root: str
    split: str
    classes: tuple[str, ...]
    batch_size: int
    score_threshold: float


@dataclass(frozen=True)
class WorkUnit:
    """Row groups `[rg_start, rg_stop)` of one shard = split rows `[row_start, row_stop)`."""

    index: int
    shard: str  # path relative to the prepared directory
    rg_start: int
    rg_stop: int
    row_start: int
    row_stop: int

    @property
    def frames(self) -> int:
        return self.row_stop - self.row_start


@dataclass
class EvalInputs:
    optimized: RunnerSpec
    reference: RunnerSpec | None
    data: DataSpec
    units: list[WorkUnit]
    frames: int
    data_hash: str
    shards: list[dict[str, Any]]
    model_info: dict[str, Any]
    latency: dict[str, Any] | None = field(default=None)


def split_hash(shards: list[dict[str, Any]]) -> str:
    """Content hash of a prepared split: sha256 over `file \\t sha256` of its shards (manifest order)."""
    return sha256_bytes("\n".join(f"{s['file']}\t{s['sha256']}" for s in shards).encode())


def plan_units(root: Path, shards: list[dict[str, Any]], slice_frames: int) -> list[WorkUnit]:
    """Cut every shard into runs of consecutive row groups of at most `slice_frames` rows (>= 1 group)."""
    from pfactory.prepare.shards import open_shard

    units: list[WorkUnit] = []
    row = 0
    for s in shards:
        try:
            md = open_shard(root / s["file"]).metadata
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError; SchemaError too
            raise EvaluateInputError(f"{root / s['file']}: a readable Parquet shard ({e})") from e
        sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        if sum(sizes) != int(s["frames"]):
            raise EvaluateInputError(
                f"{root / s['file']}: {sum(sizes)} rows, but manifest.json lists {s['frames']} frames for it"
            )
        start = 0
        while start < len(sizes):
            stop, n = start + 1, sizes[start]
            while stop < len(sizes) and n + sizes[stop] <= slice_frames:
                n += sizes[stop]
                stop += 1
            units.append(WorkUnit(len(units), s["file"], start, stop, row, row + n))
            row += n
            start = stop
    return units


def _checked_file(path: Path, sha256: str, listed_in: str, hashed_in: str, hint: str, what: str = "") -> str:
    """`path`'s sha256 when it exists and matches its manifest; else an EvaluateInputError (fsutil)."""
    return check_listed_file(
        path, sha256, listed_in, EvaluateInputError, hashed_in=hashed_in, hint=hint, what=what
    )


def _optimized_spec(
    optimized: Path, backend: str, precision: str | None, device: str
) -> tuple[RunnerSpec, dict]:
    from pfactory.optimize.errors import ArtifactError
    from pfactory.optimize.manifest import MANIFEST, find_artifact, read_manifest, verify_directory
    from pfactory.optimize.runtime import auto_backend

    if not optimized.is_dir():
        raise EvaluateInputError(
            f"{optimized}: optimized model directory: an existing directory (run `factory optimize`)"
        )
    try:
        manifest = read_manifest(optimized)
    except (ArtifactError, json.JSONDecodeError) as e:
        raise EvaluateInputError(f"{optimized / MANIFEST}: {e}") from e
    for key in ("artifacts", "model"):
        if key not in manifest:
            raise EvaluateInputError(
                f"{optimized / MANIFEST}: field {key!r}: required (written by `factory optimize`)"
            )
    if backend == "auto":
        backend = auto_backend(manifest, device)
    try:
        artifact = find_artifact(manifest, backend, precision)
    except ArtifactError as e:
        raise EvaluateInputError(f"{optimized / MANIFEST}: artifacts: {e}") from e
    # Every file backend.json lists (the artifact, model.onnx, the evidence) is checked once here; each
    # worker checks the directory again when it loads the artifact (load_runner).
    try:
        verify_directory(optimized, manifest)
    except ArtifactError as e:
        raise EvaluateInputError(str(e)) from e
    got = str(artifact["sha256"])
    spec = RunnerSpec("optimized", str(optimized.resolve()), got, backend, artifact["precision"], device)
    return spec, manifest


def _reference_spec(model: Path, device: str) -> RunnerSpec:
    from pfactory.detectors.io import CONFIG, WEIGHTS

    for name in (WEIGHTS, CONFIG):
        if not (model / name).is_file():
            raise EvaluateInputError(
                f"{model / name}: the PyTorch reference needs it (a `factory train` output)"
            )
    return RunnerSpec(
        "reference", str(model.resolve()), sha256_file(model / WEIGHTS), "pytorch", "eager", device
    )


def resolve_inputs(
    optimized: Path,
    model: Path | None,
    data: Path,
    split: str,
    backend: str,
    precision: str | None,
    device: str,
    slice_frames: int,
    batch_size: int,
    score_threshold: float,
) -> EvalInputs:
    """Check every input (module docstring) and plan the work units."""
    from pfactory.prepare.errors import SchemaError
    from pfactory.prepare.shards import open_prepared

    optimized, data = Path(optimized), Path(data)
    spec, manifest = _optimized_spec(optimized, backend, precision, device)
    reference = _reference_spec(Path(model), device) if model is not None else None

    if not data.is_dir():
        raise EvaluateInputError(f"{data}: prepared data: an existing directory (run `factory prepare`)")
    try:
        ds = open_prepared(data)
    except (SchemaError, json.JSONDecodeError) as e:
        raise EvaluateInputError(str(e)) from e
    where = data / af.PREPARED_MANIFEST
    splits = ds.manifest.get("splits", {})
    if split not in splits:
        raise EvaluateInputError(f"{where}: splits: a split {split!r} (evaluate.split); has {sorted(splits)}")
    shards = splits[split].get("shards", [])
    frames = int(splits[split].get("frames", 0))
    if frames <= 0 or not shards:
        raise EvaluateInputError(f"{where}: splits.{split}: at least one frame, got {frames}")
    for s in shards:
        _checked_file(
            data / s["file"],
            s["sha256"],
            f"{where} (splits.{split})",
            str(where),
            ": changed after prepare",
            "shard ",
        )

    m = manifest["model"]
    classes = tuple(m.get("classes") or ())
    if tuple(ds.classes) != classes:
        raise EvaluateInputError(
            f"{where}: classes: the model's {list(classes)} (backend.json), in that order; got {ds.classes}"
        )
    if int(m.get("cameras", len(ds.cameras))) != len(ds.cameras):
        raise EvaluateInputError(
            f"{where}: cameras: {m['cameras']} camera(s) as the model was built with, got {len(ds.cameras)}"
        )
    w, h = (int(v) for v in m.get("image_size", (ds.image_shape[2], ds.image_shape[1])))
    if (ds.image_shape[1], ds.image_shape[2]) != (h, w):
        raise EvaluateInputError(
            f"{where}: image.shape: (3, {h}, {w}) as the model was built with, got {list(ds.image_shape)}"
        )

    latency = None
    lat_path = optimized / af.LATENCY
    if lat_path.is_file():
        latency = _latency_summary(json.loads(lat_path.read_text()), spec.name)
    model_info = {
        "artifact": spec.name,
        "artifact_sha256": spec.sha256,
        "onnx_sha256": manifest.get("onnx", {}).get("sha256"),
        "weights_sha256": m.get("weights_sha256"),
        "reference_weights_sha256": reference.sha256 if reference else None,
        "classes": list(classes),
    }
    return EvalInputs(
        optimized=spec,
        reference=reference,
        data=DataSpec(str(data.resolve()), split, classes, batch_size, score_threshold),
        units=plan_units(data, shards, slice_frames),
        frames=frames,
        data_hash=split_hash(shards),
        shards=shards,
        model_info=model_info,
        latency=latency,
    )


def _latency_summary(latency: dict[str, Any], runner: str) -> dict[str, Any]:
    """latency.json of optimize, cut to the evaluated artifact and PyTorch eager, per batch size."""
    out: dict[str, Any] = {"runner": runner}
    for batch, runners in latency.items():
        if batch.startswith("batch_"):
            out[batch] = {k: v for k, v in runners.items() if k in (runner, "pytorch/eager")}
    speed = latency.get("speedup_vs_eager", {})
    out["speedup_vs_eager"] = {b: r[runner] for b, r in speed.items() if runner in r}
    return out
