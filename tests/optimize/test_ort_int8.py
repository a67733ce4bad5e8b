"""ONNX Runtime INT8: QDQ static quantization with a calibration reader, exclusions honoured, outputs close."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from pfactory.optimize.ort_backend import FeedReader, quantize_int8, select_excluded_nodes
from pfactory.optimize.params import Int8Params, ParityParams
from pfactory.optimize.parity import compare_outputs
from pfactory.optimize.runtime import OrtRunner, TorchRunner

from .helpers import make_feed


@pytest.fixture(scope="module")
def calib_feeds(tiny_model):
    return [make_feed(tiny_model, 1, 600, seed=100 + i) for i in range(6)]


@pytest.fixture(scope="module")
def quantized(exported, calib_feeds, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8")
    params = Int8Params(exclude_nodes=["head.heatmap", "head.reg"])  # forced exclusions by module path
    result = quantize_int8(
        exported.path, out / "model.int8.onnx", calib_feeds, params, cache_path=out / "calibration.json"
    )
    return out, result


def _producers(model: onnx.ModelProto) -> dict[str, str]:
    return {o: n.op_type for n in model.graph.node for o in n.output}


def test_qdq_model_is_calibrated_and_quantizes_convs(quantized, calib_feeds) -> None:
    out, r = quantized
    model = onnx.load(str(out / r.path))
    ops = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert r.calibration_frames == len(calib_feeds)
    assert r.quantized_nodes > 0 and r.activation_type == "uint8" and r.per_channel
    assert (out / "calibration.json").is_file() and r.calibration_cache == "calibration.json"
    # Convs outside the exclusions read dequantized activations.
    prod = _producers(model)
    convs = [n for n in model.graph.node if n.op_type == "Conv" and n.name not in r.excluded_nodes]
    assert convs and all(prod.get(n.input[0]) == "DequantizeLinear" for n in convs)


def test_excluded_nodes_stay_float(quantized, exported) -> None:
    out, r = quantized
    # The two output convs, found by their detector module path (`exclude_nodes`), and every
    # ConvTranspose by op type (the default `exclude_op_types`: no int8 ConvTranspose kernel in ORT's CPU EP).
    assert len(r.excluded_nodes) == 4 and not r.unmatched_patterns
    by_module = [w for w in r.excluded_nodes.values() if "head." in w]
    by_type = [w for w in r.excluded_nodes.values() if w == "op type ConvTranspose"]
    assert len(by_module) == 2 and len(by_type) == 2, r.excluded_nodes
    model = onnx.load(str(out / r.path))
    prod = _producers(model)
    inits = {i.name for i in model.graph.initializer}
    for node in model.graph.node:
        if node.name in r.excluded_nodes:
            assert node.input[1] in inits, f"{node.name}'s weight should be the float initializer"
            # The head's input feeds only excluded convs, so it stays unquantized; a ConvTranspose may read
            # a Q/DQ'd activation shared with a quantized conv (float math on it, no int8 kernel).
            if "head." in r.excluded_nodes[node.name]:
                assert prod.get(node.input[0]) != "DequantizeLinear", (
                    f"{node.name} reads a quantized activation"
                )


def test_select_excluded_nodes_by_op_type_name_and_module(exported) -> None:
    model = onnx.load(str(exported.path))
    names, why = select_excluded_nodes(
        model, ["Conv", "Gemm"], ["Gemm"], ["backbone.stages.0", "node_does_not_exist"]
    )
    assert any(w == "op type Gemm" for w in why.values())
    assert any("backbone.stages.0" in w for w in why.values())
    assert names == sorted(why)


def test_int8_outputs_close_to_pytorch(quantized, tiny_model) -> None:
    """Loose by design: INT8 of a *random* network on random points.

    Measured on this fixture (6 calibration frames, 4 test frames): score cosine 0.9998, max score
    diff 0.13, match rate 0.40 -- the peaks of an untrained net are arbitrary local maxima that a
    small perturbation moves. The limits check that INT8 runs and tracks FP32; INT8 *quality* is
    judged on a trained model (`optimize.parity.int8` + the evaluate stage's mAP delta,
    docs/OPTIMIZE.md "INT8").
    """
    out, r = quantized
    runner = OrtRunner(out / r.path, "int8", intra_op_threads=2)
    torch_runner = TorchRunner(tiny_model)
    feeds = [make_feed(tiny_model, 1, 600, seed=200 + i) for i in range(4)]
    ref = [torch_runner.run(f) for f in feeds]
    cand = [runner.run(f) for f in feeds]
    m = compare_outputs(ref, cand, ParityParams())
    assert m["scores"]["cosine"] > 0.999, m
    assert m["scores"]["max_abs_diff"] < 0.25, m
    assert m["match_rate"] > 0.25, m


def test_calibration_cache_is_reused_without_data(quantized, exported, tmp_path) -> None:
    """With the cache present, quantization needs no calibration frames and gives the same model."""
    out, r = quantized
    cache = tmp_path / "calibration.json"
    cache.write_bytes((out / "calibration.json").read_bytes())
    params = Int8Params(exclude_nodes=["head.heatmap", "head.reg"])
    again = quantize_int8(exported.path, tmp_path / "again.onnx", [], params, cache_path=cache)
    assert again.calibration_frames == 0
    a = onnx.load(str(out / r.path))
    b = onnx.load(str(tmp_path / "again.onnx"))
    scales_a = {i.name: onnx.numpy_helper.to_array(i) for i in a.graph.initializer if "scale" in i.name}
    scales_b = {i.name: onnx.numpy_helper.to_array(i) for i in b.graph.initializer if "scale" in i.name}
    assert scales_a.keys() == scales_b.keys() and scales_a
    for k in scales_a:
        np.testing.assert_array_equal(scales_a[k], scales_b[k])


def test_feed_reader_filters_inputs_and_counts() -> None:
    feeds = [{"a": np.zeros(1), "b": np.ones(1)}, {"a": np.ones(1), "b": np.zeros(1)}]
    reader = FeedReader(feeds, ["a"])
    assert set(reader.get_next()) == {"a"}
    assert reader.get_next() is not None and reader.get_next() is None
    assert reader.count == 2
    reader.rewind()
    assert reader.get_next() is not None
