"""Runtime API: load_runner from backend.json (artifact choice, sha256 check), output contract helpers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pfactory.optimize.errors import ArtifactError, BackendUnavailable
from pfactory.optimize.manifest import MANIFEST, file_hashes, find_artifact, read_manifest
from pfactory.optimize.runtime import OrtRunner, load_runner, resolve_backend, valid_detections
from pfactory.storage.fsutil import sha256_file

from .helpers import make_feed


@pytest.fixture
def optimized_dir(tmp_path: Path, exported, fp32_model) -> Path:
    """A minimal optimized directory: the export and the FP32 model, primary onnxruntime/fp32."""
    out = tmp_path / "optimized"
    (out / "onnxruntime").mkdir(parents=True)
    shutil.copy(exported.path, out / "model.onnx")
    shutil.copy(fp32_model, out / "onnxruntime" / "model.fp32.onnx")
    hashes = file_hashes(out)
    artifact = {"backend": "onnxruntime", "precision": "fp32", "file": "onnxruntime/model.fp32.onnx"}
    artifact["sha256"] = hashes[artifact["file"]]
    manifest = {
        "format": 1,
        "primary": {"backend": "onnxruntime", "precision": "fp32"},
        "artifacts": [artifact],
        "files": hashes,
    }
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def test_load_runner_serves_the_primary_artifact(optimized_dir: Path, tiny_model) -> None:
    runner = load_runner(optimized_dir, intra_op_threads=1)
    assert isinstance(runner, OrtRunner) and runner.name == "onnxruntime/fp32" and runner.device == "cpu"
    feed = make_feed(tiny_model, 2, 300, seed=9)
    out = runner(feed["points"], feed["num_points"], feed["images"], feed["proj"])
    assert set(out) == {"boxes", "scores", "labels"}
    assert out["boxes"].shape == (2, 20, 7) and out["boxes"].dtype == np.float32
    assert out["labels"].dtype == np.int64
    assert np.all(np.diff(out["scores"], axis=1) <= 0), "scores are sorted descending"


def test_runner_converts_dtypes_and_torch_tensors(optimized_dir: Path, tiny_model) -> None:
    import torch

    runner = load_runner(optimized_dir, backend="onnxruntime", precision="fp32")
    feed = make_feed(tiny_model, 1, 200, seed=3)
    a = runner(*(feed[k] for k in ("points", "num_points", "images", "proj")))
    b = runner(
        torch.from_numpy(feed["points"]).double(),
        feed["num_points"].astype(np.int32),
        feed["images"],
        feed["proj"],
    )
    np.testing.assert_allclose(a["scores"], b["scores"], rtol=1e-6)
    with pytest.raises(ValueError, match="batch"):
        runner(feed["points"], np.zeros(2, np.int64), feed["images"], feed["proj"])


def test_a_tampered_artifact_is_refused(optimized_dir: Path) -> None:
    import onnx

    path = optimized_dir / "onnxruntime" / "model.fp32.onnx"
    model = onnx.load(str(path))
    model.doc_string = "swapped"  # still a valid model, no longer the one the manifest hashed
    onnx.save(model, str(path))
    with pytest.raises(ArtifactError, match="sha256"):
        load_runner(optimized_dir)
    load_runner(optimized_dir, verify=False)  # explicit opt-out still loads


def test_missing_precision_and_directory_are_explained(optimized_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=r"no onnxruntime/int8 .*onnxruntime/fp32"):
        load_runner(optimized_dir, precision="int8")
    with pytest.raises(ArtifactError, match="no tensorrt artifact"):
        load_runner(optimized_dir, backend="tensorrt")
    with pytest.raises(ArtifactError, match="factory optimize"):
        read_manifest(tmp_path / "nothing")


def test_find_artifact_prefers_int8_when_primary_is_another_backend() -> None:
    manifest = {
        "primary": {"backend": "tensorrt", "precision": "fp16"},
        "artifacts": [
            {"backend": "onnxruntime", "precision": "fp32"},
            {"backend": "onnxruntime", "precision": "int8"},
            {"backend": "tensorrt", "precision": "fp16"},
        ],
    }
    assert find_artifact(manifest, "onnxruntime", None)["precision"] == "int8"
    assert find_artifact(manifest, "tensorrt", None)["precision"] == "fp16"


def test_backend_resolution_without_tensorrt() -> None:
    pytest.importorskip("onnxruntime")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("tensorrt is installed here")
    except ImportError:
        pass
    assert resolve_backend("auto", "auto") == "onnxruntime"
    with pytest.raises(BackendUnavailable, match=r"pip install '\.\[tensorrt\]'"):
        resolve_backend("tensorrt")


def test_valid_detections_drop_padding_and_low_scores() -> None:
    out = {
        "boxes": np.zeros((1, 4, 7), np.float32),
        "scores": np.array([[0.9, 0.2, 0.01, 0.0]], np.float32),
        "labels": np.array([[1, 0, 2, 0]], np.int64),
    }
    (frame,) = valid_detections(out, 0.05)
    assert frame["scores"].tolist() == pytest.approx([0.9, 0.2]) and frame["labels"].tolist() == [1, 0]
    with pytest.raises(ValueError, match="padding"):
        valid_detections(out, 0.0)


def test_file_hashes_cover_nested_files_but_not_the_manifest(optimized_dir: Path) -> None:
    hashes = file_hashes(optimized_dir)
    assert set(hashes) == {"model.onnx", "onnxruntime/model.fp32.onnx"}
    assert hashes["model.onnx"] == sha256_file(optimized_dir / "model.onnx")


def test_parallel_executor_is_opt_in_and_computes_the_same_bits(optimized_dir: Path, tiny_model) -> None:
    """Sequential executor by default (1-thread evaluate workers get exactly what they asked for);
    `inter_op_threads` > 1 selects ORT_PARALLEL, with identical outputs."""
    import onnxruntime as ort

    from pfactory.optimize.ort_backend import session_options

    seq = session_options(1, spin=False)
    assert seq.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL and seq.intra_op_num_threads == 1
    assert seq.get_session_config_entry("session.inter_op.allow_spinning") == "0"
    assert session_options(1, inter_op_threads=1).execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    par = session_options(1, inter_op_threads=2)
    assert par.execution_mode == ort.ExecutionMode.ORT_PARALLEL and par.inter_op_num_threads == 2

    path = optimized_dir / "onnxruntime" / "model.fp32.onnx"
    default = load_runner(optimized_dir, intra_op_threads=1)
    parallel = OrtRunner(path, "fp32", "cpu", 1, spin=False, inter_op_threads=2)
    feed = make_feed(tiny_model, 2, 300, seed=5)
    a, b = default.run(feed), parallel.run(feed)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
