"""TensorRT on a GPU machine (`scripts/gpu_check.sh`; skipped here: TensorRT cannot be installed and there
is no GPU): the tiny detector's engine builds, verifies itself against ONNX Runtime FP32 and agrees with
PyTorch; an engine built from a wrong graph fails its self-check and ONNX Runtime runs instead.
"""

from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path

import onnx
import pytest
import torch
from onnx import numpy_helper

from kernels import selfcheck
from pfactory.optimize.params import OptimizeParams
from pfactory.optimize.runtime import TorchRunner, open_runner
from pfactory.optimize.tensorrt_backend import (
    ENGINE_PATH,
    ENGINE_TOLERANCES,
    TensorRTRunner,
    build_engine,
    cast_onnx_fp16,
    compare_engine_outputs,
    engine_spec,
    tensorrt_missing,
)

from .helpers import make_feed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(tensorrt_missing() is not None, reason=f"{tensorrt_missing()}"),
]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PFK_SELFCHECK_DIR", str(tmp_path / "selfcheck"))
    selfcheck.forget()
    yield tmp_path / "selfcheck"
    selfcheck.forget()


def _build(root: Path, exported, precision: str, graph: Path | None = None) -> Path:
    """`root` laid out as an optimized directory (model.onnx = the export) with the `precision` engine of
    `graph` (default the export) in tensorrt/; returns the plan's path."""
    import tensorrt as trt

    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(exported.path, root / "model.onnx")
    opt = OptimizeParams()
    spec = engine_spec(opt, precision, trt.__version__, exported.inputs, max_batch=2)
    source = graph or root / "model.onnx"
    if spec.onnx_source == "fp16_cast":
        source = cast_onnx_fp16(source, root / "model.fp16.onnx", opt.tensorrt.fp16_keep_fp32_op_types)
    entry = build_engine(source, spec, root / "tensorrt")
    assert entry["selfcheck"]["path"] == ENGINE_PATH and entry["selfcheck"]["key"]["source"].startswith(
        f"tensorrt {trt.__version__}; engine "
    )
    return root / "tensorrt" / entry["file"]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_engine_builds_verifies_and_agrees_with_pytorch(tmp_path, store, exported, tiny_model, precision):
    plan = _build(tmp_path / "opt", exported, precision)
    verdict = selfcheck.verify(ENGINE_PATH, "cuda")  # what build_engine recorded, read back
    assert verdict.status == selfcheck.VERIFIED, verdict.reason
    runner = open_runner(plan, "tensorrt", precision)
    assert isinstance(runner, TensorRTRunner)
    eager = TorchRunner(copy.deepcopy(tiny_model), "cpu")  # PyTorch fp32, the stage's parity reference
    figures: dict[str, float] = {}
    for seed in range(3):
        feed = make_feed(tiny_model, 1, 600, seed=seed)
        compare_engine_outputs(figures, precision, seed, runner.run(feed), eager.run(feed))
    tol_scores, tol_boxes = ENGINE_TOLERANCES[precision]
    assert figures[f"{precision} scores"] <= tol_scores and figures[f"{precision} boxes"] <= tol_boxes


def test_an_engine_of_a_wrong_graph_fails_and_onnx_runtime_runs(tmp_path, store, exported, caplog):
    caplog.set_level(logging.WARNING, logger="pfk.selfcheck")
    model = onnx.load(str(exported.path))
    init = next(i for i in model.graph.initializer if "heatmap" in i.name and i.name.endswith("weight"))
    w = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array((w + 0.05).astype(w.dtype), init.name))
    wrong = tmp_path / "wrong.onnx"
    onnx.save(model, str(wrong))
    plan = _build(tmp_path / "opt", exported, "fp32", graph=wrong)
    runner = open_runner(plan, "tensorrt", "fp32")
    assert runner.backend == "onnxruntime"
    lines = [
        r.getMessage() for r in caplog.records if r.name == "pfk.selfcheck" and r.levelno == logging.WARNING
    ]
    assert len(lines) == 1 and f"{ENGINE_PATH} (model.fp32.plan)" in lines[0] and "fp32 scores" in lines[0]
