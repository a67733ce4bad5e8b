"""The registered detector as a real MLflow model: the ONNX Runtime artifact with MLflow's `onnx` flavor.

What a registered version is (docs/PROMOTE.md, "What a version is"): an MLflow LoggedModel of the pipeline
run, whose directory holds
```
MLmodel                 flavors onnx + python_function, signature, pip requirements, metadata
model.onnx              the artifact `load_runner(optimized/)` serves on CPU (backend.json's primary when it
                        is an ONNX Runtime one, e.g. onnxruntime/model.int8.onnx; else the best ORT one)
input_example.json      one val frame (`example_feed`), serving_input_example.json: the same as a REST body
requirements.txt, python_env.yaml, conda.yaml   numpy, onnx, onnxruntime (+ mlflow), exact versions
optimized/              the whole optimized directory (backend.json, every artifact, parity.json, latency.json)
eval/kpis.json          the candidate's evaluation
```
so `mlflow.pyfunc.load_model("models:/pfactory-detector@champion")` and `mlflow models serve -m
models:/pfactory-detector@champion --env-manager local` work with nothing of this project installed, and
rollback / champion re-evaluation download `optimized/` and `eval/kpis.json` as before.

Signature (tensor-based, from backend.json's `onnx` block; -1 = any size):
    inputs   points [-1, -1, 4] float32 (x, y, z, intensity; lidar frame, m; rows >= num_points ignored)
             num_points [-1] int64, images [-1, N, 3, H, W] float32 (normalized), proj [-1, N, 3, 4] float32
    outputs  boxes [-1, K, 7] float32 (x, y, z, l, w, h, yaw), scores [-1, K] float32, labels [-1, K] int64
             (K = max_detections; score 0 = padding, keep scores >= a threshold > 0)
A REST request: `{"inputs": {"points": [[[x, y, z, i], ...]], "num_points": [n], "images": ..., "proj": ...}}`
to `POST /invocations`; the answer is `{"predictions": {"boxes": ..., "scores": ..., "labels": ...}}`.

The session is configured like the optimize stage's runner (`ort_backend.session_options`: every graph
optimization, sequential executor, ORT's default thread count, CPU provider), so the served detections are
the runner's (tested equal on a val frame).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.detectors.params import DEFAULT_ARCH  # records from before architectures had names
from pfactory.storage import artifacts as af

MODEL_NAME = "detector"  # the LoggedModel's name (its artifact folder in the run's "Logged models")
EXAMPLE_MAX_POINTS = 4096  # the input example keeps the first points of its frame (a few MB of JSON)
# Session options of the runner (pfactory.optimize.ort_backend.session_options with the defaults the
# optimize stage uses) in the form MLflow's onnx flavor records in MLmodel: 99 = ORT_ENABLE_ALL.
SESSION_OPTIONS = {"graph_optimization_level": 99, "execution_mode": "sequential"}
PROVIDERS = ["CPUExecutionProvider"]
REQUIREMENTS = ("numpy", "onnx", "onnxruntime", "mlflow")


def served_artifact(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The backend.json entry of the artifact the MLflow model serves: the ONNX Runtime one `load_runner`
    picks on CPU (the primary's precision when the primary is ONNX Runtime, else the best one built)."""
    from pfactory.optimize.manifest import find_artifact

    return find_artifact(dict(manifest), "onnxruntime", None)


def signature(manifest: Mapping[str, Any]) -> Any:
    """The `ModelSignature` of the exported graph (backend.json's `onnx.inputs` / `onnx.outputs`)."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    def spec(io: Mapping[str, Any]) -> Any:
        shape = tuple(d if isinstance(d, int) else -1 for d in io["shape"])
        return TensorSpec(np.dtype(io["dtype"]), shape, io["name"])

    onnx = manifest["onnx"]
    return ModelSignature(
        inputs=Schema([spec(i) for i in onnx["inputs"]]), outputs=Schema([spec(o) for o in onnx["outputs"]])
    )


def example_feed(prepared: Path, split: str = "val", max_points: int = EXAMPLE_MAX_POINTS) -> dict[str, Any]:
    """The first frame of `split` as the model's input (`{"points", "num_points", "images", "proj"}`, batch 1),
    its points cut to `max_points` rows (num_points clipped). Falls back to the train split when `split` has
    no frames."""
    from pfactory.optimize.calibration import load_feeds, pad_points

    try:
        feeds = load_feeds(prepared, split, batch_size=1, max_frames=1, num_threads=1)
    except ValueError:
        feeds = load_feeds(prepared, "train", batch_size=1, max_frames=1, num_threads=1)
    feed = feeds.feeds[0]
    return pad_points(feed, min(max_points, feed["points"].shape[1]))


def requirements() -> list[str]:
    """Pinned pip requirements of the served model (what `--env-manager virtualenv|uv` installs)."""
    from importlib import metadata

    return [f"{name}=={metadata.version(name)}" for name in REQUIREMENTS]


def log_detector(
    run_id: str,
    optimized: Path,
    kpis_file: Path,
    example: Mapping[str, np.ndarray] | None,
    tags: Mapping[str, str] | None = None,
) -> tuple[str, str]:
    """Log the candidate as an MLflow model of run `run_id` (module docstring); returns (model URI, model id).

    `example`: the input example (`example_feed`); None logs the model without one (no serving check).
    """
    import mlflow
    import mlflow.onnx
    import onnx
    from mlflow import MlflowClient
    from mlflow.models import Model

    from pfactory.optimize.manifest import verify_directory

    optimized, kpis_file = Path(optimized), Path(kpis_file)
    manifest = af.backend_manifest(optimized)
    if manifest is None:
        raise FileNotFoundError(f"{optimized / af.BACKEND}: missing; not an optimized directory")
    verify_directory(optimized, dict(manifest))  # what is logged and served is what optimize gated
    served = served_artifact(manifest)
    if example is not None:  # the graph's own inputs (a lidar-only architecture takes points, num_points)
        names = [i["name"] for i in manifest["onnx"]["inputs"]]
        example = {k: example[k] for k in names}
    info = Model.log(
        artifact_path=None,
        name=MODEL_NAME,
        flavor=mlflow.onnx,
        run_id=run_id,
        onnx_model=onnx.load(str(optimized / served["file"])),
        signature=signature(manifest),
        input_example=dict(example) if example is not None else None,
        pip_requirements=requirements(),
        onnx_execution_providers=PROVIDERS,
        onnx_session_options=SESSION_OPTIONS,
        save_as_external_data=False,
        metadata={
            "served_artifact": served["file"],
            "served_sha256": served["sha256"],
            "backend": served["backend"],
            "precision": served["precision"],
            "classes": list(manifest.get("model", {}).get("classes", [])),
            "output_contract": manifest.get("outputs", {}).get("contract", ""),
            "arch": manifest.get("model", {}).get("arch", DEFAULT_ARCH),
            "plugin": manifest.get("model", {}).get("plugin"),
        },
        tags=dict(tags or {}),
    )
    # The evidence beside the served file: what rollback and champion re-evaluation download.
    with tempfile.TemporaryDirectory(prefix="pfactory-model-") as tmp:
        stage = Path(tmp)
        shutil.copytree(optimized, stage / "optimized", ignore=shutil.ignore_patterns(".*"))
        (stage / "eval").mkdir()
        shutil.copy2(kpis_file, stage / "eval" / af.KPIS)
        MlflowClient(tracking_uri=mlflow.get_tracking_uri()).log_model_artifacts(info.model_id, str(stage))
    return info.model_uri, info.model_id
