"""ONNX export of the whole detector: checks pass, scatter + decode inside, dynamic points, parity with torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from pfactory.optimize.export import (
    INPUT_NAMES,
    OUTPUT_NAMES,
    ExportCheckError,
    check_onnx,
    node_module_paths,
)
from pfactory.optimize.params import ParityParams
from pfactory.optimize.parity import compare_outputs, gate
from pfactory.optimize.runtime import OrtRunner, TorchRunner

from .helpers import make_feed


def test_checker_and_strict_shape_inference_pass_without_custom_ops(exported) -> None:
    checks = check_onnx(exported.path)  # raises on any failure
    assert checks["checker"] == checks["shape_inference"] == "passed"
    model = onnx.load(str(exported.path))
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    assert not model.functions
    assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}
    assert exported.opset >= 18


def test_scatter_and_decode_are_inside_the_graph(exported) -> None:
    model = onnx.load(str(exported.path))
    ops = {n.op_type for n in model.graph.node}
    scatters = [n for n in model.graph.node if n.op_type == "ScatterElements"]
    reductions = {a.s.decode() for n in scatters for a in n.attribute if a.name == "reduction"}
    assert "max" in reductions, "pillar scatter-max must be ScatterElements(reduction=max)"
    assert {"TopK", "MaxPool", "Sigmoid", "Atan", "GatherElements"} <= ops  # decode: peaks, top-K, boxes
    assert [i.name for i in exported.inputs] == list(INPUT_NAMES)
    assert [o.name for o in exported.outputs] == list(OUTPUT_NAMES)
    points = next(i for i in exported.inputs if i.name == "points")
    assert points.shape[1] == "points" and points.shape[2] == 4  # padded point count is dynamic
    assert exported.outputs[0].shape[1:] == [20, 7]  # K = max_detections, fixed


def test_dynamic_point_count_matches_torch(exported, tiny_model) -> None:
    """Two different P through the same session, each within the FP32 gate (1e-4 rel) of PyTorch."""
    ort_runner = OrtRunner(exported.path, "fp32", intra_op_threads=2)
    torch_runner = TorchRunner(tiny_model)
    params = ParityParams()
    for p, seed in ((300, 1), (2111, 2)):
        feed = make_feed(tiny_model, 1, p, seed=seed)
        ref, out = torch_runner.run(feed), ort_runner.run(feed)
        assert out["boxes"].shape == ref["boxes"].shape == (1, 20, 7)
        metrics = compare_outputs([ref], [out], params, params.fp32)
        assert gate(metrics, params.fp32) == [], metrics
        # Same computation: rank-aligned scores agree elementwise too.
        np.testing.assert_allclose(np.sort(out["scores"]), np.sort(ref["scores"]), rtol=1e-4, atol=1e-6)


def test_batches_work_dynamic_or_split(exported, tiny_model) -> None:
    """Batch 3 (ragged num_points): a dynamic-batch graph runs it at once, a fixed-batch one in chunks."""
    runner = OrtRunner(exported.path, "fp32", intra_op_threads=2)
    if exported.dynamic_batch:
        assert runner.fixed_batch is None
    else:
        assert exported.fallback_reason, "a fixed-batch export must say why"
        assert runner.fixed_batch == 1
    feed = make_feed(tiny_model, 3, 700, seed=4)
    ref, out = TorchRunner(tiny_model).run(feed), runner.run(feed)
    assert out["scores"].shape == (3, 20) and out["labels"].dtype == np.int64
    params = ParityParams()
    assert gate(compare_outputs([ref], [out], params, params.fp32), params.fp32) == []


def test_padding_rows_are_ignored(exported, tiny_model) -> None:
    """Rows >= num_points change nothing: the same frame padded with garbage gives the same boxes."""
    runner = OrtRunner(exported.path, "fp32", intra_op_threads=2)
    feed = make_feed(tiny_model, 1, 400, seed=5)
    feed["num_points"][:] = 400
    padded = dict(feed)
    garbage = np.random.default_rng(0).uniform(0, 10, size=(1, 150, 4)).astype(np.float32)
    padded["points"] = np.concatenate([feed["points"], garbage], axis=1)
    a, b = runner.run(feed), runner.run(padded)
    np.testing.assert_allclose(a["scores"], b["scores"], rtol=1e-5, atol=1e-7)


def test_node_module_paths_name_the_head(exported) -> None:
    paths = node_module_paths(onnx.load(str(exported.path)))
    mods = set(paths.values())
    assert {"head.heatmap", "head.reg"} <= mods
    assert any(m.startswith("backbone.stages.0") for m in mods)
    convs = [n for n, m in paths.items() if m == "head.heatmap"]
    assert convs, "the heatmap conv must be addressable by its module path"


def test_check_onnx_refuses_custom_domains(tmp_path) -> None:
    """A graph with a custom-domain node (what a plugin op would export as) fails the check, naming it."""
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in INPUT_NAMES]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in OUTPUT_NAMES]
    nodes = [
        helper.make_node("Identity", ["points"], ["boxes"]),
        helper.make_node("Identity", ["images"], ["labels"]),
    ]
    nodes.append(helper.make_node("PillarScatter", ["num_points"], ["scores"], domain="pfk"))
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("pfk", 1)]
    )
    path = tmp_path / "custom.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ExportCheckError, match=r"pfk::PillarScatter"):
        check_onnx(path)


def test_torch_runner_loads_a_model_dir(tmp_path, tiny_model) -> None:
    from tests.archs.painted_pillars.helpers import save_trained

    save_trained(tmp_path / "model", tiny_model, ["image_2"])
    feed = make_feed(tiny_model, 1, 256, seed=6)
    a = TorchRunner(tmp_path / "model").run(feed)
    with torch.inference_mode():
        b = tiny_model.forward_export(*(torch.from_numpy(feed[k]) for k in INPUT_NAMES))
    np.testing.assert_array_equal(a["scores"], b[1].numpy())


def test_default_detector_exports_a_dynamic_batch(exported) -> None:
    """The export path has no Python-int arithmetic on the batch: `batch` is a symbolic dim everywhere."""
    assert exported.dynamic_batch and exported.fallback_reason is None
    for spec in exported.inputs + exported.outputs:
        assert spec.shape[0] == "batch", spec


@pytest.mark.parametrize("n, c, num_cells", [(37, 5, 11), (1, 3, 1), (200, 16, 7)])
def test_export_scatter_equals_the_kernel_on_nonnegative_features(n: int, c: int, num_cells: int) -> None:
    """detector.scatter_max_nonnegative (the export's scatter) == kernels.pillar_scatter_max, bit for bit,
    with duplicate cells, dropped points (-1) and empty cells, for features >= 0 (a ReLU output)."""
    import kernels
    from pfactory.archs.painted_pillars.detector import scatter_max_nonnegative

    g = torch.Generator().manual_seed(n)
    feats = torch.relu(torch.randn(n, c, generator=g))  # [N, C] >= 0, with exact zeros
    cell = torch.randint(-1, num_cells, (n,), generator=g)  # [N], -1 = dropped
    row = torch.where(cell >= 0, cell, num_cells)  # the detector's trash row
    want = kernels.pillar_scatter_max(feats, cell, num_cells)
    got = scatter_max_nonnegative(feats, row, num_cells)
    assert got.shape == (num_cells, c)
    assert torch.equal(got, want)


def test_the_graph_names_no_file_of_this_machine(exported) -> None:
    """The exporter's per-node Python stack traces carry the absolute path of the source file (a run's
    workspace): model.onnx differed between two identical runs (tests/faults/test_crashes.py) and published
    the path. They are dropped; the module scopes stay."""
    from pfactory.optimize.export import _SCOPE_KEY

    model = onnx.load(str(exported.path))
    keys = {p.key for n in model.graph.node for p in n.metadata_props}
    values = [p.value for n in model.graph.node for p in n.metadata_props]
    root = str(Path(__file__).resolve().parents[2])
    assert "pkg.torch.onnx.stack_trace" not in keys and _SCOPE_KEY in keys
    assert not [v for v in values if root in v or 'File "/' in v], "a path of this machine in the graph"


def test_the_graph_names_no_python_module(exported) -> None:
    """model.onnx does not change when the code moves: no node names the Python package of the module that
    produced it (the exporter's `namespace` and `class_hierarchy`); the attribute scopes stay."""
    model = onnx.load(str(exported.path))
    values = [p.value for n in model.graph.node for p in n.metadata_props]
    assert values, "the scopes are gone too"
    assert not [v for v in values if "pfactory." in v or "kernels." in v], "a Python module path in the graph"
