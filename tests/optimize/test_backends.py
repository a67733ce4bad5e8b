"""The optimize stage's backends behind one interface (`pfactory.optimize.backends`): which ones a run builds,
in which order (backend.json's artifact order and the fastest-artifact ties), from the asked backend and
precision and `optimize.aoti.enabled`; what the stage refuses before building anything."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pfactory.optimize.backends import BACKENDS, Build
from pfactory.optimize.errors import BackendUnavailable
from pfactory.optimize.params import OptimizeParams
from pfactory.optimize.stage import _plan

FP32, INT8, AOTI, TRT = "onnxruntime/fp32", "onnxruntime/int8", "aoti/fp32", "tensorrt"


def _run(backend: str, asked_precision: str | None, **over: object) -> Build:
    """The stage's plan on a CPU machine for `backend` / `asked_precision` (None: `optimize.precision`)."""
    opt = OptimizeParams.model_validate({"device": "cpu", **over})
    return _plan(opt, Path("model"), Path("data"), Path("out"), backend, asked_precision, None)


def _wanted(b: Build) -> list[str]:
    return [backend.name for backend in BACKENDS if backend.wanted(b)]


def test_the_backends_a_cpu_run_builds_in_build_order() -> None:
    assert [backend.name for backend in BACKENDS] == [FP32, INT8, AOTI, TRT]
    assert _wanted(_run("onnxruntime", "fp32")) == [FP32]  # FP32 always: the export's own baseline
    assert _wanted(_run("onnxruntime", "int8")) == [FP32, INT8]
    assert _wanted(_run("auto", None, precision="int8")) == [FP32, INT8]  # precision from params
    assert _wanted(_run("aoti", "fp32")) == [FP32, AOTI]
    # auto on a CPU with AOTInductor enabled: a second CPU backend, and the fastest that passes is primary.
    auto = _run("auto", "int8", aoti={"enabled": True})
    assert _wanted(auto) == [FP32, INT8, AOTI] and auto.choose_fastest
    # An explicit backend is built (and served) as asked, whatever optimize.aoti.enabled says.
    explicit = _run("onnxruntime", "int8", aoti={"enabled": True})
    assert _wanted(explicit) == [FP32, INT8] and not explicit.choose_fastest


def test_tensorrt_int8_builds_the_int8_profile_first() -> None:
    """The TensorRT INT8 engine reuses the sensitivity profile the ONNX Runtime INT8 step measures (the ORT
    model itself is then dropped); an FP16 engine needs none. (The backend is set directly: asking for
    tensorrt on a machine without it is refused, below.)"""
    cpu = _run("onnxruntime", "int8")
    assert _wanted(dataclasses.replace(cpu, backend="tensorrt")) == [FP32, INT8, TRT]
    assert _wanted(dataclasses.replace(cpu, backend="tensorrt", precision="fp16")) == [FP32, TRT]


def test_combinations_no_backend_builds_are_refused_when_planning() -> None:
    with pytest.raises(BackendUnavailable, match="fp32 only"):
        _run("aoti", "int8")
    with pytest.raises(BackendUnavailable, match="no fast FP16 path"):
        _run("onnxruntime", "fp16")
