"""A TensorRT engine is trusted only after its self-check (`tensorrt_backend.verify_engine` / `open_engine`).

TensorRT cannot be installed here, so the engine under check is stood in for by a real ONNX Runtime
session: of the tiny detector's own graph (a correct "engine": verified) and of the same graph with one
altered initializer (the heatmap conv's weights shifted: a wrong engine). The reference is ONNX Runtime
FP32 of the export, as for a real engine. What is tested is the decision around the engine, which is
the same for both: the verdict and its key (the engine's and the ONNX graph's hashes, the version), the
store read back instead of a rerun, the one warning line naming the path and its figures, and
`open_engine` handing out the ONNX Runtime FP32 model beside the engine instead of a failed one.
The real build and parity on a GPU: tests/optimize/test_tensorrt_gpu.py.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kernels import selfcheck
from pfactory.optimize.errors import BackendUnavailable
from pfactory.optimize.runtime import OrtRunner, open_runner
from pfactory.optimize.tensorrt_backend import (
    ENGINE_PATH,
    compare_engine_outputs,
    open_engine,
    synthetic_feeds,
    tensorrt_missing,
    verify_engine,
)

from .helpers import make_feed

STAND_IN = "onnxruntime stand-in"  # the `version` the stand-in engines are keyed with


def _optimized_dir(root: Path, exported, fp32_model: Path, wrong: bool) -> Path:
    """An optimized directory's layout: model.onnx, onnxruntime/model.fp32.onnx, and tensorrt/model.fp32.plan
    holding the ONNX graph the stand-in engine runs (the export, or with the heatmap weights shifted)."""
    root.mkdir(parents=True)
    shutil.copy(exported.path, root / "model.onnx")
    (root / "onnxruntime").mkdir()
    shutil.copy(fp32_model, root / "onnxruntime" / "model.fp32.onnx")
    (root / "tensorrt").mkdir()
    model = onnx.load(str(exported.path))
    if wrong:
        init = next(i for i in model.graph.initializer if "heatmap" in i.name and i.name.endswith("weight"))
        w = numpy_helper.to_array(init)
        init.CopyFrom(numpy_helper.from_array((w + 0.05).astype(w.dtype), init.name))
    plan = root / "tensorrt" / "model.fp32.plan"
    onnx.save(model, str(plan))
    return plan


def _feeds(tiny_model) -> list[dict[str, np.ndarray]]:
    return [make_feed(tiny_model, 1, 600, seed=s) for s in (0, 1)]


@pytest.fixture
def warned() -> list[str]:
    """The WARNING lines of the `pfk.selfcheck` logger during the test, from a handler on that logger itself
    (pytest's caplog sits on the root logger, whose handlers a library's logging set-up may replace
    mid-suite)."""
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == logging.WARNING:
                lines.append(record.getMessage())

    logger = logging.getLogger("pfk.selfcheck")
    handler, level = Lines(logging.WARNING), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_correct_engine_verifies_once_and_is_read_back(
    tmp_path, selfcheck_store, exported, fp32_model, tiny_model
):
    plan = _optimized_dir(tmp_path / "opt", exported, fp32_model, wrong=False)
    opened = []

    def engine():
        opened.append(1)
        return OrtRunner(plan, "fp32", "cpu")

    kw = {"feeds": _feeds(tiny_model), "engine": engine, "version": STAND_IN, "device_types": ("cpu",)}
    v = verify_engine(plan, tmp_path / "opt" / "model.onnx", "fp32", "cpu", **kw)
    assert v.status == selfcheck.VERIFIED, v.reason
    assert v.figures["fp32 scores"] == 0.0 and v.figures["fp32 boxes"] == 0.0
    source = v.key["source"]
    assert source.startswith(f"tensorrt {STAND_IN}; engine {selfcheck.sources_hash([plan])}; onnx ")
    assert Path(v.recorded).parent == selfcheck_store and opened == [1]
    selfcheck.forget()
    again = verify_engine(plan, tmp_path / "opt" / "model.onnx", "fp32", "cpu", **kw)
    assert again.status == selfcheck.VERIFIED and again.recorded == v.recorded and opened == [1]  # not rerun
    # another TensorRT version (or engine, or graph) is another key: checked again
    other = verify_engine(plan, tmp_path / "opt" / "model.onnx", "fp32", "cpu", **{**kw, "version": "11.0"})
    assert other.recorded != v.recorded and opened == [1, 1]


def test_a_wrong_engine_fails_with_one_line_and_onnx_runtime_runs_instead(
    tmp_path, selfcheck_store, exported, fp32_model, tiny_model, warned
):
    plan = _optimized_dir(tmp_path / "opt", exported, fp32_model, wrong=True)
    fallbacks: list[Path] = []

    def fallback(path: Path):
        fallbacks.append(path)
        return OrtRunner(path, "fp32", "cpu")

    def engine():
        return OrtRunner(plan, "fp32", "cpu")

    feeds = _feeds(tiny_model)
    kw = {"engine": engine, "version": STAND_IN, "device_types": ("cpu",)}
    verdict = verify_engine(plan, tmp_path / "opt" / "model.onnx", "fp32", "cpu", feeds, **kw)
    assert verdict.status == selfcheck.FAILED and verdict.reason.startswith("fp32 scores: max|err|")
    assert verdict.figures["fp32 scores"] > 5e-3
    # open_engine: the stored verdict (no feeds needed), the ONNX Runtime FP32 model beside the engine
    runner = open_engine(plan, "fp32", "cpu", fallback, **kw)
    runner2 = open_engine(plan, "fp32", "cpu", fallback, **kw)
    assert fallbacks == [tmp_path / "opt" / "onnxruntime" / "model.fp32.onnx"] * 2
    assert runner.backend == "onnxruntime" and runner2.backend == "onnxruntime"
    lines = warned
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"pfk self-check: {ENGINE_PATH} (model.fp32.plan) on cpu: ")
    assert "FAILED (fp32 scores: max|err| " in lines[0] and lines[0].endswith("; using ONNX Runtime FP32")
    # what runs instead computes what the reference computes
    ref = OrtRunner(tmp_path / "opt" / "model.onnx", "fp32", "cpu").run(feeds[0])
    got = runner.run(feeds[0])
    figures: dict[str, float] = {}
    compare_engine_outputs(figures, "fp32", 0, got, ref)
    assert figures["fp32 scores"] < 1e-5
    assert f"{ENGINE_PATH}@" in selfcheck.used_json() and "failed: fp32 scores" in selfcheck.used_json()


def test_the_comparison_catches_a_moved_box_and_a_missing_label() -> None:
    scores = np.array([[0.9, 0.5, 0.2, 0.0]], np.float32)
    boxes = np.zeros((1, 4, 7), np.float32)
    boxes[0, :, 0] = [1.0, 5.0, 9.0, 0.0]
    want = {"scores": scores, "boxes": boxes, "labels": np.array([[0, 1, 0, 0]])}
    figures: dict[str, float] = {}
    compare_engine_outputs(figures, "fp16", 0, want, want)
    assert figures == {"fp16 scores": 0.0, "fp16 boxes": 0.0}
    moved = {**want, "boxes": boxes.copy()}
    moved["boxes"][0, 1, 3] += 0.3  # the confident label-1 box 0.3 m longer
    with pytest.raises(selfcheck.Mismatch, match=r"fp16 boxes: max\|err\| 0.3 > tol 0.1"):
        compare_engine_outputs({}, "fp16", 0, moved, want)
    relabelled = {**want, "labels": np.array([[0, 2, 0, 0]])}
    with pytest.raises(selfcheck.Mismatch, match=r"fp16 boxes: max\|err\| inf"):
        compare_engine_outputs({}, "fp16", 0, relabelled, want)
    swapped = {**want, "scores": scores[:, [1, 0, 2, 3]]}  # a rank swap alone is no error of the scores
    compare_engine_outputs(figures, "fp16", 0, swapped, want)


def test_synthetic_feeds_fit_the_graph(exported, fp32_model) -> None:
    """The default inputs of an engine's check (profile shapes) run through the graph."""
    shapes = {"points": [1, 300, 4], "num_points": [1], "images": [1, 1, 3, 32, 64], "proj": [1, 1, 3, 4]}
    feeds = synthetic_feeds(shapes)
    assert len(feeds) == 2 and feeds[0]["num_points"].tolist() == [150]
    assert not np.array_equal(feeds[0]["points"], feeds[1]["points"])
    out = OrtRunner(fp32_model, "fp32", "cpu").run(feeds[0])
    assert out["scores"].shape[0] == 1 and np.isfinite(out["scores"]).all()


@pytest.mark.skipif(tensorrt_missing() is None, reason="TensorRT is installed here")
def test_without_tensorrt_an_engine_is_refused_with_the_install_hint(
    tmp_path, exported, fp32_model, selfcheck_store
):
    plan = _optimized_dir(tmp_path / "opt", exported, fp32_model, wrong=False)
    with pytest.raises(BackendUnavailable, match="TensorRT is not installed"):
        open_runner(plan, "tensorrt", "fp32")


def test_doctor_has_the_engine_and_loader_rows_skipped_with_their_reasons(selfcheck_store) -> None:
    from factory import doctor

    rows = {r["path"]: r for r in doctor.run_checks(rerun=True)}
    for path in ("tensorrt.engine.fp32", "tensorrt.engine.fp16"):
        assert rows[path]["device"] == "cuda" or rows[path]["device"].startswith("NVIDIA")
        if tensorrt_missing() is not None:
            assert rows[path]["status"] == "skipped"
            assert rows[path]["reason"].startswith("TensorRT is not installed")
    import torch

    if not torch.cuda.is_available():
        assert rows["dali.gpu_loader"]["status"] == "skipped"
        assert "no CUDA device here" in rows["dali.gpu_loader"]["reason"]
