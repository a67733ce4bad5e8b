"""Rate gates judge with their support: a match rate k/n is refused only when the upper bound of its Wilson
score interval is below the limit, and not judged below `rate_min_support` detections ("too few to judge");
a broken INT8 artifact (a wrong quantization scale) of a trained detector is still refused."""

from __future__ import annotations

import numpy as np
import pytest

from pfactory.optimize.params import ParityParams
from pfactory.optimize.parity import compare_outputs, gate, parity_report, wilson_interval
from pfactory.optimize.runtime import OrtRunner


def test_wilson_interval_matches_the_textbook_values() -> None:
    # Wilson (1927) / Newcombe (1998) table: 0/10 -> [0, 0.2775], 5/10 -> [0.2366, 0.7634] at 95 %
    assert wilson_interval(0, 10, 0.95) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(5, 10, 0.95) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 0, 0.95) == (0.0, 1.0)


def test_turned_headings_are_refused_with_their_support() -> None:
    """Every box and score the same, but the heading of 20 of 60 confident detections turned by pi (what a
    quantized heading head did): the INT8 gate refuses it, naming the heading agreement; 1 of 60 turned
    passes, and 2 of 3 is too few to judge."""
    params, tol = ParityParams(), ParityParams().int8
    ref = _frames(60, 60)
    for turned, refused in ((20, True), (1, False)):
        cand = [{k: v.copy() for k, v in o.items()} for o in ref]
        for o in cand[:turned]:
            o["boxes"][0, 0, 6] += np.pi
        failures = gate(compare_outputs(ref, cand, params, tol), tol)
        if refused:
            assert failures == [
                "agreement.heading (|yaw diff| <= 0.5 rad, score >= 0.3) = 40/60 = 0.6667: Wilson 95% upper "
                "bound 0.7727 < 0.95 (n=60)"
            ]
        else:
            assert failures == []
    few = _frames(3, 3)
    cand = [{k: v.copy() for k, v in o.items()} for o in few]
    cand[0]["boxes"][0, 0, 6] += 1.0
    assert gate(compare_outputs(few, cand, params, tol), tol) == []


def _frames(confident: int, frames: int) -> list[dict[str, np.ndarray]]:
    """`frames` frames of one confident detection each up to `confident`, spread 5 m apart; clutter below 0.3."""
    out = []
    for f in range(frames):
        k = 4
        boxes = np.zeros((1, k, 7), dtype=np.float32)
        boxes[0, :, 0] = 5.0 * np.arange(k) + 2.0
        boxes[0, :, 3:6] = 2.0
        scores = np.array([[0.9 if f < confident else 0.2, 0.2, 0.1, 0.0]], dtype=np.float32)
        out.append({"boxes": boxes, "scores": scores, "labels": np.zeros((1, k), dtype=np.int64)})
    return out


def _lose(ref: list[dict[str, np.ndarray]], lost: int) -> list[dict[str, np.ndarray]]:
    cand = [{k: v.copy() for k, v in o.items()} for o in ref]
    for o in cand[:lost]:
        o["boxes"][0, 0, 0] += 10.0  # the confident detection moved away: one missed, one extra
    return cand


def test_two_of_three_confident_detections_are_too_few_to_judge_forty_of_sixty_fail() -> None:
    """The quick look with train.seed=22 stopped at 'agreement.match_rate = 0.667 < 0.95': two of three."""
    params, tol = ParityParams(), ParityParams().int8
    ref = _frames(3, 16)
    cand = _lose(ref, 1)
    m = compare_outputs(ref, cand, params, tol, repeat=cand)
    a = m["agreement"]
    assert (a["matched"], max(a["reference_detections"], a["candidate_detections"])) == (2, 3)
    assert gate(m, tol) == []
    report = parity_report({"onnxruntime/int8": {"precision": "int8", "metrics": m}}, params, ["f"] * 16, "t")
    rate, heading = report["artifacts"]["onnxruntime/int8"]["rates"]
    assert heading["text"].startswith("agreement.heading") and heading["passed"]  # 2 of 2 matched kept
    assert rate["text"] == "agreement.match_rate (score >= 0.3) = 2/3 = 0.6667, n=3 < 10: too few to judge"
    assert not rate["judged"] and rate["passed"] and report["passed"]
    assert "Wilson score interval" in report["rate_rule"] and "n >= 10" in report["rate_rule"]

    ref = _frames(60, 60)  # the same proportion with support: refused, both figures named
    m = compare_outputs(ref, _lose(ref, 20), params, tol)
    assert gate(m, tol) == [
        "agreement.match_rate (score >= 0.3) = 40/60 = 0.6667: Wilson 95% upper bound 0.7727 < 0.95 (n=60)"
    ]
    assert gate(m, tol, min_support=61) == []  # the minimum count is what lets two of three through


def _wrong_scale(good, dst):
    """The good INT8 model with ONE quantized weight's scale multiplied by 4 (its DequantizeLinear): the
    classic export slip of a scale applied twice. Returns (path, the weight's name)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(good))
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        x = inits.get(node.input[0])
        if node.op_type == "DequantizeLinear" and x is not None and x.data_type == onnx.TensorProto.INT8:
            scale = inits[node.input[1]]
            scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 4.0, scale.name))
            onnx.save(model, str(dst))
            return dst, x.name
    raise AssertionError("no quantized weight in the INT8 model")


def test_a_wrong_scale_int8_artifact_is_still_refused(int8_bench, tmp_path) -> None:
    arts, tiny, reference = int8_bench
    path, weight = _wrong_scale(arts["good"], tmp_path / "wrong_scale.onnx")
    params, tol = ParityParams(), ParityParams().int8
    runner = OrtRunner(path, "int8", intra_op_threads=1)
    out = [runner.run(f) for f in tiny["held_out"]]
    m = compare_outputs(reference, out, params, tol, repeat=[runner.run(f) for f in tiny["held_out"]])
    failures = gate(m, tol)
    report = parity_report({"onnxruntime/int8": {"precision": "int8", "metrics": m}}, params, ["f"], "t")
    rate = report["artifacts"]["onnxruntime/int8"]["rates"][0]
    assert rate["judged"] and rate["n"] >= 30, rate  # enough support: judged, not waved through
    assert failures and any(f.startswith("agreement.") for f in failures), (weight, failures, m["agreement"])


def test_the_architectures_float_modules_join_the_int8_exclusions() -> None:
    """The optimize stage reads a detector's `int8_float_modules` (centerpoint_lidar: its point heading)
    into `int8.exclude_nodes` before any INT8 build (`_load`), after the user's own patterns."""
    from pfactory.archs.centerpoint_lidar.params import CenterPointLidarParams
    from pfactory.detectors.contract import DataSpec
    from pfactory.detectors.registry import build
    from pfactory.optimize.params import OptimizeParams
    from pfactory.optimize.stage import with_float_modules

    spec = DataSpec(("Car", "Pedestrian"), (0.0, -8.0, -3.0, 16.0, 8.0, 1.0))
    model = build("centerpoint_lidar", CenterPointLidarParams(), spec)
    opt = OptimizeParams(int8={"exclude_nodes": ["heads.0.*"]})
    assert with_float_modules(opt, model).int8.exclude_nodes == ["heads.0.*", "point_heading"]
    assert opt.int8.exclude_nodes == ["heads.0.*"]  # the params object itself is untouched
    off = build("centerpoint_lidar", CenterPointLidarParams(refine_point_heading=False), spec)
    assert with_float_modules(OptimizeParams(), object()) == OptimizeParams()
    assert with_float_modules(opt, off).int8.exclude_nodes == ["heads.0.*", "point_heading"]  # declared by the class: an unmatched pattern then (sensitivity.json records it)
