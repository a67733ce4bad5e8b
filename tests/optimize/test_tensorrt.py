"""TensorRT backend, the parts that run without TensorRT: engine spec, builder configuration, calibrator feeding.

Engine building itself needs `tensorrt` + a CUDA GPU (never here: the PyPI wheels come from NVIDIA's
index); that test skips with the reason. The builder configuration is applied to a recording fake of
the TensorRT Python API, which checks the exact calls `apply_spec` makes.
"""

from __future__ import annotations

import ctypes
import enum
import importlib.util
from types import SimpleNamespace

import numpy as np
import onnx
import pytest

from pfactory.optimize.export import TensorSpec
from pfactory.optimize.params import OptimizeParams
from pfactory.optimize.tensorrt_backend import (
    CalibrationBatches,
    EngineSpec,
    apply_spec,
    cast_onnx_fp16,
    engine_spec,
    fix_points,
    make_calibrator,
    trt_major,
)

INPUTS = [
    TensorSpec("points", "float32", ["batch", "points", 4]),
    TensorSpec("num_points", "int64", ["batch"]),
    TensorSpec("images", "float32", ["batch", 2, 3, 32, 64]),
    TensorSpec("proj", "float32", ["batch", 2, 3, 4]),
]


# --------------------------------------------------------------------------------------------------
# a recording fake of the TensorRT Python API (only what apply_spec / make_calibrator touch)
# --------------------------------------------------------------------------------------------------
class BuilderFlag(enum.Enum):
    FP16 = 0
    INT8 = 1
    PREFER_PRECISION_CONSTRAINTS = 2


class _Profile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple] = {}

    def set_shape(self, name, mn, opt, mx) -> None:
        self.shapes[name] = (list(mn), list(opt), list(mx))


class _Config:
    def __init__(self) -> None:
        self.flags: list[BuilderFlag] = []
        self.pools: dict = {}
        self.profiles: list[_Profile] = []
        self.calibration_profile = None
        self.int8_calibrator = None
        self.builder_optimization_level = None
        self.timing_cache = None

    def set_flag(self, f) -> None:
        self.flags.append(f)

    def set_memory_pool_limit(self, pool, size) -> None:
        self.pools[pool] = size

    def add_optimization_profile(self, p) -> int:
        self.profiles.append(p)
        return len(self.profiles) - 1

    def set_calibration_profile(self, p) -> None:
        self.calibration_profile = p

    def create_timing_cache(self, blob: bytes):
        return SimpleNamespace(blob=blob)

    def set_timing_cache(self, cache, ignore_mismatch) -> None:
        self.timing_cache = (cache, ignore_mismatch)


class _Layer:
    def __init__(self, name: str) -> None:
        self.name, self.precision, self.num_outputs, self.output_types = name, None, 2, {}

    def set_output_type(self, i, t) -> None:
        self.output_types[i] = t


class _Network:
    def __init__(self, names: list[str]) -> None:
        self.layers = [_Layer(n) for n in names]
        self.num_layers = len(self.layers)

    def get_layer(self, i) -> _Layer:
        return self.layers[i]


class _CalibratorBase:
    def __init__(self) -> None:
        self.base_initialised = True


FAKE_TRT = SimpleNamespace(
    BuilderFlag=BuilderFlag,
    MemoryPoolType=SimpleNamespace(WORKSPACE="workspace"),
    float32="float32",
    float16="float16",
    IInt8EntropyCalibrator2=type("IInt8EntropyCalibrator2", (_CalibratorBase,), {}),
    IInt8MinMaxCalibrator=type("IInt8MinMaxCalibrator", (_CalibratorBase,), {}),
)


def _spec(precision: str, version: str, **over) -> EngineSpec:
    params = OptimizeParams.model_validate(over)
    return engine_spec(
        params, precision, version, INPUTS, max_batch=4, fp16_layers=["node_conv2d_14", "node_Conv_991"]
    )


# --------------------------------------------------------------------------------------------------
# engine spec
# --------------------------------------------------------------------------------------------------
def test_trt10_fp16_uses_the_fp16_flag() -> None:
    s = _spec("fp16", "10.3.0.26")
    assert s.flags == ["FP16"] and s.calibrator is None and s.onnx_source == "fp32" and not s.strongly_typed


@pytest.mark.parametrize("calibrator", ["entropy", "minmax"])
def test_trt10_int8_uses_implicit_calibration_with_a_fixed_profile(calibrator: str) -> None:
    s = _spec("int8", "10.3.0.26", int8={"calibrator": calibrator}, tensorrt={"opt_points": 5000})
    assert s.flags == ["INT8", "FP16", "PREFER_PRECISION_CONSTRAINTS"]
    assert s.calibrator == calibrator and s.calibration_points == 5000
    assert s.calibration_profile["points"] == ([1, 5000, 4], [1, 5000, 4], [1, 5000, 4])
    assert s.fp16_layers == ["node_Conv_991", "node_conv2d_14"]


@pytest.mark.parametrize(
    ("precision", "source"), [("fp16", "fp16_cast"), ("int8", "int8_qdq"), ("fp32", "fp32")]
)
def test_trt11_is_strongly_typed_without_precision_flags(precision: str, source: str) -> None:
    """TensorRT 11 removed BuilderFlag.FP16/INT8 and the calibrators: precision comes from the ONNX file."""
    s = _spec(precision, "11.4.0.106")
    assert s.strongly_typed and s.flags == [] and s.calibrator is None and s.onnx_source == source


def test_profile_covers_batch_and_points_with_fixed_camera_dims() -> None:
    s = _spec("fp16", "10.0.1", tensorrt={"min_points": 2, "opt_points": 100, "max_points": 900})
    assert s.profile["points"] == ([1, 2, 4], [1, 100, 4], [4, 900, 4])
    assert s.profile["num_points"] == ([1], [1], [4])
    assert s.profile["images"] == ([1, 2, 3, 32, 64], [1, 2, 3, 32, 64], [4, 2, 3, 32, 64])
    assert s.profile["proj"][2] == [4, 2, 3, 4]
    assert s.workspace_bytes == 4 << 30 and s.optimization_level == 3


def test_fixed_batch_export_gets_a_batch_1_profile() -> None:
    inputs = [TensorSpec(i.name, i.dtype, [1, *i.shape[1:]]) for i in INPUTS]
    s = engine_spec(OptimizeParams(), "fp16", "10.1", inputs, max_batch=8)
    assert all(mn[0] == opt[0] == mx[0] == 1 for mn, opt, mx in s.profile.values())


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="precision"):
        _spec("bf16", "10.0")
    with pytest.raises(ValueError, match="TensorRT version"):
        trt_major("ten")
    with pytest.raises(ValueError, match="min_points <= opt_points <= max_points"):
        OptimizeParams.model_validate({"tensorrt": {"opt_points": 10, "max_points": 5}})


# --------------------------------------------------------------------------------------------------
# builder configuration against the fake API
# --------------------------------------------------------------------------------------------------
def test_apply_spec_sets_flags_pools_profiles_calibrator_and_timing_cache() -> None:
    spec = _spec("int8", "10.3.0")
    builder = SimpleNamespace(create_optimization_profile=_Profile)
    network = _Network(["node_conv2d_14", "node_conv2d_14_1", "node_Conv_991", "node_Conv_9910", "other"])
    config = _Config()
    calibrator = object()
    cache = apply_spec(FAKE_TRT, builder, network, config, spec, calibrator, timing_cache=b"old")
    assert config.flags == [BuilderFlag.INT8, BuilderFlag.FP16, BuilderFlag.PREFER_PRECISION_CONSTRAINTS]
    assert config.pools == {"workspace": 4 << 30} and config.builder_optimization_level == 3
    assert len(config.profiles) == 1 and config.profiles[0].shapes == spec.profile
    assert config.int8_calibrator is calibrator
    assert config.calibration_profile.shapes == spec.calibration_profile
    # Kept out of INT8, in FP16: the sensitivity-chosen nodes' layers (exact or "_suffix"), not a name
    # that merely starts alike.
    pinned = [layer.name for layer in network.layers if layer.precision == "float16"]
    assert pinned == ["node_conv2d_14", "node_conv2d_14_1", "node_Conv_991"]
    assert network.layers[0].output_types == {0: "float16", 1: "float16"}
    assert cache.blob == b"old" and config.timing_cache == (cache, False)


def test_apply_spec_fp16_without_calibrator_or_cache() -> None:
    spec = _spec("fp16", "10.3.0", tensorrt={"timing_cache": False})
    config = _Config()
    cache = apply_spec(
        FAKE_TRT, SimpleNamespace(create_optimization_profile=_Profile), _Network([]), config, spec
    )
    assert (
        config.flags == [BuilderFlag.FP16]
        and config.int8_calibrator is None
        and config.calibration_profile is None
    )
    assert cache is None and config.timing_cache is None


def test_apply_spec_needs_the_calibrator_it_names() -> None:
    with pytest.raises(ValueError, match="calibrator"):
        apply_spec(
            FAKE_TRT,
            SimpleNamespace(create_optimization_profile=_Profile),
            _Network([]),
            _Config(),
            _spec("int8", "10.0"),
        )


# --------------------------------------------------------------------------------------------------
# calibrator batch feeding (numpy buffers stand in for device memory)
# --------------------------------------------------------------------------------------------------
def _host_to_device(a: np.ndarray):
    buf = np.ascontiguousarray(a).copy()
    return buf.ctypes.data, buf


def _read(ptr: int, like: np.ndarray) -> np.ndarray:
    raw = ctypes.string_at(ptr, like.nbytes)
    return np.frombuffer(raw, dtype=like.dtype).reshape(like.shape)


def _cal_feeds(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "points": rng.normal(size=(1, 50 + 40 * i, 4)).astype(np.float32),
            "num_points": np.array([45 + 40 * i], np.int64),
            "images": rng.normal(size=(1, 2, 3, 32, 64)).astype(np.float32),
            "proj": rng.normal(size=(1, 2, 3, 4)).astype(np.float32),
        }
        for i in range(n)
    ]


def test_calibration_batches_feed_inputs_in_requested_order_then_stop(tmp_path) -> None:
    feeds = _cal_feeds(3)
    batches = CalibrationBatches(
        feeds, points=100, cache_path=tmp_path / "cal.cache", to_device=_host_to_device
    )
    assert batches.get_batch_size() == 1
    names = ["images", "points", "num_points", "proj"]
    for i, feed in enumerate(feeds):
        ptrs = batches.get_batch(names)
        assert len(ptrs) == 4 and all(isinstance(p, int) for p in ptrs)
        fixed = fix_points(feed, 100)
        for name, ptr in zip(names, ptrs):
            np.testing.assert_array_equal(_read(ptr, fixed[name]), fixed[name])
        # Points are exactly the calibration profile's P: padded (frame 0, 1) or truncated (frame 2).
        assert fixed["points"].shape == (1, 100, 4)
        assert fixed["num_points"][0] == min(45 + 40 * i, 100)
    assert batches.get_batch(names) is None and batches.batches_served == 3


def test_calibration_cache_roundtrip(tmp_path) -> None:
    batches = CalibrationBatches(
        [], points=10, cache_path=tmp_path / "sub" / "cal.cache", to_device=_host_to_device
    )
    assert batches.read_calibration_cache() is None
    batches.write_calibration_cache(memoryview(b"TRT-cache"))
    assert batches.read_calibration_cache() == b"TRT-cache"


def test_calibration_batches_refuse_wrong_batch_or_unknown_inputs() -> None:
    feeds = _cal_feeds(1)
    with pytest.raises(KeyError, match="voxels"):
        CalibrationBatches(feeds, 64, to_device=_host_to_device).get_batch(["voxels"])
    with pytest.raises(ValueError, match="batch"):
        CalibrationBatches(feeds, 64, to_device=_host_to_device, batch_size=2).get_batch(["points"])


@pytest.mark.parametrize(
    ("kind", "base"), [("entropy", "IInt8EntropyCalibrator2"), ("minmax", "IInt8MinMaxCalibrator")]
)
def test_make_calibrator_subclasses_the_chosen_calibrator(kind: str, base: str, tmp_path) -> None:
    batches = CalibrationBatches(_cal_feeds(1), 64, cache_path=tmp_path / "c", to_device=_host_to_device)
    cal = make_calibrator(FAKE_TRT, kind, batches)
    assert isinstance(cal, getattr(FAKE_TRT, base)) and cal.base_initialised
    assert cal.get_batch_size() == 1
    assert len(cal.get_batch(["points", "proj"])) == 2 and cal.get_batch(["points"]) is None
    cal.write_calibration_cache(b"x")
    assert cal.read_calibration_cache() == b"x"
    with pytest.raises(ValueError, match=r"entropy \| minmax"):
        make_calibrator(FAKE_TRT, "legacy", batches)


# --------------------------------------------------------------------------------------------------
# TensorRT >= 11 FP16 source model, and the real build (GPU machines)
# --------------------------------------------------------------------------------------------------
def test_fp16_cast_keeps_io_fp32_and_blocked_ops_fp32(exported, tmp_path) -> None:
    keep = ["ScatterElements", "TopK", "Sigmoid", "MaxPool"]
    out = cast_onnx_fp16(exported.path, tmp_path / "model.fp16.onnx", keep)
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    f16 = onnx.TensorProto.FLOAT16
    assert any(i.data_type == f16 for i in model.graph.initializer), "weights should be FP16"
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {
        v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.value_info, *inferred.graph.output]
    }
    for node in model.graph.node:
        if node.op_type in ("TopK", "ScatterElements"):
            assert types.get(node.output[0]) != f16, f"{node.op_type} should stay FP32"


@pytest.mark.skipif(
    importlib.util.find_spec("tensorrt") is None,
    reason="tensorrt is not installed (PyPI wheels come from NVIDIA's index; GPU machines only: "
    "pip install '.[tensorrt]' and run benchmarks/bench_optimize.py --tensorrt)",
)
def test_real_tensorrt_engine_builds(exported, tmp_path) -> None:  # pragma: no cover - GPU machines
    import torch

    if not torch.cuda.is_available():
        pytest.skip("tensorrt imports but no CUDA GPU is visible")
    import tensorrt as trt

    from pfactory.optimize.tensorrt_backend import build_engine

    spec = engine_spec(OptimizeParams(), "fp16", trt.__version__, exported.inputs, max_batch=2)
    source = exported.path
    if spec.onnx_source == "fp16_cast":
        source = cast_onnx_fp16(
            exported.path, tmp_path / "fp16.onnx", OptimizeParams().tensorrt.fp16_keep_fp32_op_types
        )
    entry = build_engine(source, spec, tmp_path)
    assert (tmp_path / entry["file"]).is_file() and entry["metadata"]["gpu"]


def test_fp16_layers_come_from_the_sensitivity_report_by_weight(exported) -> None:
    """The report names ORT's pre-processed nodes; TensorRT parses the export, whose node names can differ
    (the point MLP's Gemm is renamed by pre-processing): layers are matched by their weight initializer."""
    import onnx

    from pfactory.optimize.tensorrt_backend import sensitivity_fp16_layers

    model = onnx.load(str(exported.path))
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    report = {
        "layers": [
            {"name": "renamed/GemmTransposeFusion/", "weight": gemm.input[1]},
            {"name": conv.name, "weight": conv.input[1]},
            {"name": "quantized", "weight": "w.quantized"},
        ],
        "kept_float": ["renamed/GemmTransposeFusion/", conv.name],
    }
    assert sensitivity_fp16_layers(model, report, []) == sorted([gemm.name, conv.name])
    by_pattern = sensitivity_fp16_layers(model, None, ["head.heatmap"])
    assert len(by_pattern) == 1 and by_pattern[0] != conv.name
    assert sensitivity_fp16_layers(model, None, []) == []


def test_trt11_int8_qdq_keeps_the_sensitivity_layers_unquantized_in_fp16(exported, tmp_path) -> None:
    """TensorRT >= 11 (strongly typed) INT8: the symmetric QDQ model with the kept-float layer left
    unquantized, then its float part cast to FP16 around the Q/DQ pairs: that layer runs in FP16."""
    import onnx

    from pfactory.optimize.ort_backend import quantize_int8
    from pfactory.optimize.tensorrt_backend import cast_onnx_fp16

    from .helpers import make_feed, make_model

    model = make_model()
    feeds = [make_feed(model, 1, 600, seed=i) for i in range(3)]
    conv = next(n for n in onnx.load(str(exported.path)).graph.node if n.op_type == "Conv")
    int8 = OptimizeParams().int8.model_copy(update={"ort_method": "minmax", "exclude_op_types": []})
    q = quantize_int8(
        exported.path, tmp_path / "qdq.onnx", feeds, int8, for_tensorrt=True, keep_float=[conv.input[1]]
    )
    assert q.format["weight_bits"] == 8 and q.symmetric_activations  # TensorRT's QDQ: symmetric int8
    kept = [n for n, why in q.excluded_nodes.items() if why == "kept float (sensitivity)"]
    assert len(kept) == 1
    keep32 = [*OptimizeParams().tensorrt.fp16_keep_fp32_op_types, "QuantizeLinear", "DequantizeLinear"]
    out = onnx.load(str(cast_onnx_fp16(tmp_path / "qdq.onnx", tmp_path / "qdq16.onnx", keep32)))
    inits = {i.name: i.data_type for i in out.graph.initializer}
    node = next(n for n in out.graph.node if n.name == kept[0])
    assert inits[node.input[1]] == onnx.TensorProto.FLOAT16  # the kept layer: FP16 weights
    scales = [
        inits[n.input[1]] for n in out.graph.node if n.op_type == "DequantizeLinear" and n.input[1] in inits
    ]
    assert scales and all(t == onnx.TensorProto.FLOAT for t in scales)  # Q/DQ stay FP32
