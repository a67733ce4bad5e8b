"""`backend.json`: the manifest of an optimized directory (what was built, how, and its hashes).

Layout of an optimized directory (`paths.optimized`):
```
backend.json                    this manifest
model.onnx                      the export: padded points -> boxes, default ONNX domain only
onnxruntime/model.fp32.onnx     graph-optimized FP32 (ORT EXTENDED level, portable across CPUs)
onnxruntime/model.int8.onnx     static INT8 QDQ (when precision is int8)
onnxruntime/calibration.json    ORT calibration cache (tensor ranges) of the INT8 model
tensorrt/model.<prec>.plan      TensorRT engine (GPU machines), + calibration.cache, timing.cache
parity.json, latency.json       the evidence
```
Manifest fields: `format`, `primary` {backend, precision} (what `load_runner(dir)` serves by default),
`artifacts` [{backend, precision, file, sha256, bytes, ...backend details}], `onnx` (opset, I/O names,
dtypes and shapes with symbolic dims, dynamic batch), `model` (source checkpoint sha256, classes,
image size, cameras, max_detections), `outputs` (the fixed-K / invalid-detection contract),
`files` {relative path: sha256} of every file but backend.json, `versions`, `tensorrt` metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pfactory.optimize.errors import ArtifactError
from pfactory.storage import artifacts as af
from pfactory.storage.fsutil import check_listed_file, read_json_object, sha256_file

# File names: pfactory/storage/artifacts.py (the one home of every stage's output layout).
MANIFEST = af.BACKEND
FORMAT = 1
ONNX_FILE = af.ONNX_FILE
ORT_DIR = af.ORT_DIR
TRT_DIR = af.TRT_DIR
PARITY = af.PARITY
LATENCY = af.LATENCY

OUTPUT_CONTRACT = (
    "K = max_detections entries per frame, always (static shape). Entries are sorted by descending score; "
    "score 0 marks padding (fewer than K peaks: non-peak cells are zeroed before top-K), its box and label "
    "are meaningless. Nothing is thresholded in the graph: keep scores >= a threshold > 0 (the evaluate "
    "stage uses evaluate.score_threshold)."
)


def file_hashes(root: Path) -> dict[str, str]:
    """{relative posix path: sha256} of every file under `root` except the manifest itself."""
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    }


def read_manifest(optimized_dir: str | Path) -> dict[str, Any]:
    """`backend.json` of an optimized directory, format-checked."""
    path = Path(optimized_dir) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path}: no manifest; not an optimized directory (run `factory optimize`)")
    manifest = read_json_object(path, ArtifactError)
    if int(manifest.get("format", 0)) > FORMAT:
        raise ArtifactError(
            f"{path}: manifest format {manifest['format']} is newer than this pfactory ({FORMAT})"
        )
    return manifest


def find_artifact(manifest: dict[str, Any], backend: str, precision: str | None) -> dict[str, Any]:
    """The artifact entry for (backend, precision); precision None = the primary's when backends agree,
    else the best one built for `backend` (int8 > fp16 > fp32)."""
    built = [a for a in manifest["artifacts"] if a["backend"] == backend]
    if not built:
        have = sorted({a["backend"] for a in manifest["artifacts"]})
        raise ArtifactError(f"no {backend} artifact in this optimized directory (built: {have})")
    if precision is None:
        primary = manifest.get("primary", {})
        if primary.get("backend") == backend:
            precision = primary["precision"]
        else:
            order = {"int8": 0, "fp16": 1, "fp32": 2}
            precision = min(built, key=lambda a: order.get(a["precision"], 9))["precision"]
    for a in built:
        if a["precision"] == precision:
            return a
    raise ArtifactError(
        f"no {backend}/{precision} artifact in this optimized directory "
        f"(built: {sorted(a['backend'] + '/' + a['precision'] for a in manifest['artifacts'])})"
    )


GATED_HINT = ": not the file the optimize stage gated (re-run `factory optimize`)"


def verify_directory(optimized_dir: str | Path, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of `optimized_dir` after checking every file it lists against its sha256.

    Checked: `files` {relative path: sha256} (every file optimize wrote: `model.onnx`, each artifact, the
    evidence), each artifact's own `sha256` and `onnx.sha256`. A missing or replaced file (other bytes,
    same name) raises `ArtifactError` with one line naming the file: what runs is what was gated.
    `manifest`: backend.json already read (else it is read here).
    """
    root = Path(optimized_dir)
    manifest = read_manifest(root) if manifest is None else manifest
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ArtifactError(
            f"{root / MANIFEST}: field 'files': a {{path: sha256}} map of the directory (written by "
            "`factory optimize`); cannot check what would run"
        )
    expected: dict[str, str] = {str(k): str(v) for k, v in files.items()}
    for a in manifest.get("artifacts") or []:
        expected.setdefault(str(a["file"]), str(a["sha256"]))
        if expected[str(a["file"])] != str(a["sha256"]):
            raise ArtifactError(
                f"{root / MANIFEST}: artifact {a['file']}: sha256 differs between 'artifacts' and 'files'"
            )
    onnx_sha = (manifest.get("onnx") or {}).get("sha256")
    if onnx_sha is not None:
        expected.setdefault(ONNX_FILE, str(onnx_sha))
    for rel, sha in expected.items():
        check_listed_file(root / rel, sha, MANIFEST, ArtifactError, hint=GATED_HINT)
    return manifest


def verify_file(optimized_dir: str | Path, relpath: str, expected_sha256: str) -> Path:
    """The path of `relpath`, after checking its sha256 against the manifest (corrupt/swapped files)."""
    path = Path(optimized_dir) / relpath
    check_listed_file(path, expected_sha256, MANIFEST, ArtifactError, hint=GATED_HINT)
    return path
