"""Exact graph rewrites for ONNX Runtime: same outputs bit for bit, the slow ops gone."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pfactory.optimize.graph_rewrite import rewrite_for_ort

from .helpers import make_feed


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _shape_of(model, name: str) -> list:
    inferred = onnx.shape_inference.infer_shapes(model)
    for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        if v.name == name:
            return list(v.type.tensor_type.shape.dim)
    raise KeyError(name)


def test_detector_rewrite_is_bit_identical(exported, tiny_model) -> None:
    original = onnx.load(str(exported.path))
    rewritten, report = rewrite_for_ort(original)
    # The export writes the pillar scatter-max 1-D already (detector.scatter_max_nonnegative); the
    # pillar-mean scatter-add row scatter goes 1-D here; the camera sums (N = 1) go.
    scatters = [n for n in original.graph.node if n.op_type == "ScatterElements"]
    ranks = {n.name: len(_shape_of(original, n.input[0])) for n in scatters}
    assert sorted(ranks.values()) == [1, 2], ranks
    assert len(report["scatter_flattened"]) == 1 and len(report["reduce_sum"]) >= 1 and report["pruned"] >= 1
    ops = [n.op_type for n in rewritten.graph.node]
    # Still ScatterElements (sequential in ORT), never ScatterND: its reduction races on duplicate rows.
    assert "ScatterND" not in ops and ops.count("ScatterElements") == 2
    expands = [n.op_type for n in original.graph.node].count("Expand")
    assert ops.count("Expand") == expands - 1  # the [N, 1] -> [N, 4] index expansion is gone
    assert {n.domain for n in rewritten.graph.node} <= {"", "ai.onnx"}
    a, b = _session(original), _session(rewritten)
    for p, seed in ((333, 0), (1500, 1)):
        feed = make_feed(tiny_model, 1 if not exported.dynamic_batch else 2, p, seed=seed)
        for x, y in zip(a.run(None, feed), b.run(None, feed)):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("reduction", ["max", "add"])
def test_flattened_scatter_matches_2d_with_duplicates_and_negative_rows(reduction: str) -> None:
    """2-D axis-0 scatter -> 1-D: same result bit for bit, duplicate rows and negative (from-the-end) rows included."""
    n, m, c = 9, 4, 3
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c])
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, [n, c])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, c])
    base = numpy_helper.from_array(np.linspace(-1, 1, m * c, dtype=np.float32).reshape(m, c), "base")
    node = helper.make_node("ScatterElements", ["base", "idx", "x"], ["y"], axis=0, reduction=reduction)
    graph = helper.make_graph([node], "g", [x, idx], [y], initializer=[base])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    rewritten, report = rewrite_for_ort(model)
    assert (
        report["scatter_flattened"]
        and [nd.op_type for nd in rewritten.graph.node].count("ScatterElements") == 1
    )
    rng = np.random.default_rng(0)
    feed = {
        "x": rng.normal(size=(n, c)).astype(np.float32),
        "idx": rng.integers(-m, m, (n, c)).astype(np.int64),
    }
    for u, v in zip(_session(model).run(None, feed), _session(rewritten).run(None, feed)):
        np.testing.assert_array_equal(u, v)


def test_ort_fp32_artifact_is_repeatable_with_two_threads(fp32_model, tiny_model) -> None:
    """Same frame, same session, 2 intra-op threads: bit-identical every time (many points per pillar)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    session = ort.InferenceSession(str(fp32_model), so, providers=["CPUExecutionProvider"])
    feed = make_feed(tiny_model, 1, 4000, seed=7)  # 4000 points on 40 x 40 pillars: ~2.5 per pillar
    first = session.run(None, feed)
    for _ in range(6):
        for x, y in zip(first, session.run(None, feed)):
            np.testing.assert_array_equal(x, y)


def test_consumers_keep_node_metadata(exported) -> None:
    """INT8 exclusions find modules by node metadata: untouched nodes keep theirs."""
    from pfactory.optimize.export import node_module_paths

    rewritten, _ = rewrite_for_ort(onnx.load(str(exported.path)))
    assert {"head.heatmap", "head.reg"} <= set(node_module_paths(rewritten).values())


def test_only_static_size_one_sums_are_rewritten() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, "p"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "p"])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [1, "p"])
    inits = [
        numpy_helper.from_array(np.array([1], np.int64), "ax1"),
        numpy_helper.from_array(np.array([0], np.int64), "ax0"),
    ]
    nodes = [
        helper.make_node("ReduceSum", ["x", "ax1"], ["y"], keepdims=0),  # size-1 axis: becomes Squeeze
        helper.make_node("ReduceSum", ["x", "ax0"], ["w0"], keepdims=0),  # size 2: stays
        helper.make_node("Identity", ["w0"], ["w"]),
    ]
    graph = helper.make_graph(nodes, "g", [x], [y, w], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    rewritten, _ = rewrite_for_ort(model)
    assert [n.op_type for n in rewritten.graph.node] == ["Squeeze", "ReduceSum", "Identity"]
    feed = {"x": np.random.default_rng(1).normal(size=(2, 1, 5)).astype(np.float32)}
    for u, v in zip(_session(model).run(None, feed), _session(rewritten).run(None, feed)):
        np.testing.assert_array_equal(u, v)


def test_groupnorm_affine_as_depthwise_conv_is_within_float_rounding(exported, tiny_model) -> None:
    """`affine_conv`: every GroupNorm's Mul + Add becomes one depthwise 1x1 Conv (ORT then fuses the Relu)."""
    original = onnx.load(str(exported.path))
    plain, _ = rewrite_for_ort(original)
    fused, report = rewrite_for_ort(original, affine_conv=True)
    norms = sum(n.op_type == "InstanceNormalization" for n in original.graph.node)
    assert norms > 0 and len(report["affine_conv"]) == norms
    convs = [n for n in fused.graph.node if n.name.endswith("_dwconv")]
    assert len(convs) == norms and all(helper.get_attribute_value(n.attribute[0]) > 1 for n in convs)
    for b, seed in ((1, 3), (2, 4)):
        feed = make_feed(tiny_model, b, 700, seed=seed)
        a = _session(plain).run(None, feed)
        f = _session(fused).run(None, feed)
        np.testing.assert_allclose(f[0], a[0], rtol=1e-5, atol=1e-5)  # boxes
        np.testing.assert_allclose(f[1], a[1], rtol=1e-5, atol=1e-6)  # scores
        np.testing.assert_array_equal(f[2], a[2])  # labels
