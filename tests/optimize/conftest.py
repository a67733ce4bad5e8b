"""Fixtures of the inference tests: the real detector at a tiny size, exported once per session.

The detector is `pfactory.archs.painted_pillars.detector` with small params (a 16 m x 16 m grid of 0.4 m pillars,
64x32 images), random-init weights: export ~5-10 s on 2 cores, a forward pass a few ms.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import make_model


@pytest.fixture(scope="session")
def tiny_model():
    return make_model()


@pytest.fixture(scope="session")
def exported(tiny_model, tmp_path_factory):
    """`ExportResult` of the tiny detector (dynamic batch asked for; may fall back to a fixed batch)."""
    from pfactory.optimize.export import export_onnx

    path = tmp_path_factory.mktemp("export") / "model.onnx"
    return export_onnx(tiny_model, path, cameras=1, opset=18, dynamic_batch=True, export_points=512)


@pytest.fixture(scope="session")
def fp32_model(exported, tmp_path_factory) -> Path:
    """The ONNX Runtime FP32 artifact as the stage builds it: exact rewrites, then ORT's optimizations."""
    from pfactory.optimize.ort_backend import save_optimized_fp32, write_rewritten

    out = tmp_path_factory.mktemp("ort")
    write_rewritten(exported.path, out / "rewritten.onnx")
    return save_optimized_fp32(out / "rewritten.onnx", out / "model.fp32.onnx")
