"""Sensitivity-guided INT8: the greedy choice on a controlled trial, and the real build on the tiny detector
(calibration methods compared, every layer profiled, 7-bit weights, the format in the model's metadata)."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest

from pfactory.optimize.ort_backend import (
    X86_EXACT_KEY,
    Layer,
    calibrate,
    int8_format,
    preprocess,
    quantizable_layers,
)
from pfactory.optimize.params import Int8Params
from pfactory.optimize.sensitivity import REPORT, build_int8, error_of, format_report, greedy_select

from .helpers import make_feed

LAYERS = [Layer(f"n{i}", "Conv", f"block.{i}", f"w{i}") for i in range(5)]


def _additive_trial(costs: dict[str, float], calls: list[list[str]]):
    """A trial whose error is the sum of the quantized layers' costs (match rate 1 - sum/2, p99 sum/2)."""

    def trial(quantized: list[str]) -> dict:
        calls.append(list(quantized))
        e = sum(costs[n] for n in quantized)
        return {"error": e, "match_rate": 1 - e / 2, "scores_p99": e / 2, "scores_max": e}

    return trial


def test_greedy_keeps_the_most_sensitive_layers_float_until_the_target_holds() -> None:
    costs = {"n0": 0.001, "n1": 0.05, "n2": 0.002, "n3": 0.03, "n4": 0.004}
    calls: list[list[str]] = []
    params = Int8Params(sensitivity={"target_agreement": 0.99, "target_scores_p99": 0.01})
    sel = greedy_select(LAYERS, _additive_trial(costs, calls), params)
    # Profile: every layer alone, ranked by its error.
    assert calls[:5] == [[f"n{i}"] for i in range(5)]
    ranks = {row["name"]: row["rank"] for row in sel["layers"]}
    assert ranks == {"n1": 1, "n3": 2, "n4": 3, "n2": 4, "n0": 5}
    assert sel["layers"][1]["sensitivity"] == pytest.approx(0.05)
    # Greedy: all (0.087) -> without n1 (0.037) -> without n1, n3 (0.007: match 0.9965, p99 0.0035: met).
    assert sel["kept_float"] == ["n1", "n3"] and sel["met"]
    assert [len(s["kept_float"]) for s in sel["greedy"]] == [0, 1, 2]
    assert [s["met"] for s in sel["greedy"]] == [False, False, True]


def test_greedy_skips_the_profile_when_every_layer_quantized_meets_the_target() -> None:
    costs = {f"n{i}": 0.001 for i in range(5)}
    calls: list[list[str]] = []
    params = Int8Params(sensitivity={"target_agreement": 0.99, "target_scores_p99": 0.01})
    first = _additive_trial(costs, [])([f"n{i}" for i in range(5)])
    sel = greedy_select(LAYERS, _additive_trial(costs, calls), params, all_quantized=first)
    assert calls == [] and sel["kept_float"] == [] and sel["met"] and not sel["profiled"]
    # The same choice as the full search, which profiles every layer first.
    full = greedy_select(LAYERS, _additive_trial(costs, calls), params)
    assert full["kept_float"] == [] and full["profiled"] and len(calls) == 6
    # A first step that misses the target: the profile runs, the first greedy step is not re-run.
    costs["n1"] = 0.05
    calls.clear()
    first = _additive_trial(costs, [])([f"n{i}" for i in range(5)])
    sel = greedy_select(LAYERS, _additive_trial(costs, calls), params, all_quantized=first)
    assert sel["kept_float"] == ["n1"] and len(calls) == 5 + 1


def test_the_profile_may_use_its_own_trial_the_greedy_steps_never_do() -> None:
    costs = {"n0": 0.001, "n1": 0.05, "n2": 0.002, "n3": 0.03, "n4": 0.004}
    full: list[list[str]] = []
    small: list[list[str]] = []
    params = Int8Params(sensitivity={"target_agreement": 0.99, "target_scores_p99": 0.01})
    sel = greedy_select(
        LAYERS, _additive_trial(costs, full), params, profile_trial=_additive_trial(costs, small)
    )
    assert small == [[f"n{i}"] for i in range(5)]  # the profile: one trial per layer, on the small trial
    assert all(len(q) > 1 for q in full) and len(full) == len(
        sel["greedy"]
    )  # every greedy step: the full one
    assert sel["kept_float"] == ["n1", "n3"] and sel["met"]


def test_greedy_stops_at_max_excluded_and_says_the_target_is_not_met() -> None:
    costs = {f"n{i}": 0.05 for i in range(5)}
    params = Int8Params(sensitivity={"target_scores_p99": 0.0, "max_excluded": 2})
    sel = greedy_select(LAYERS, _additive_trial(costs, []), params)
    assert len(sel["kept_float"]) == 2 and not sel["met"] and not sel["greedy"][-1]["met"]
    # Ties keep graph order.
    assert sel["kept_float"] == ["n0", "n1"]


def test_per_mac_order_keeps_a_cheap_sensitive_layer_float_before_an_expensive_one() -> None:
    layers = [
        Layer("big", "Conv", "head.shared", "wb", 240_000_000),
        Layer("small", "Gemm", "mlp", "ws", 28_000_000),
    ]
    costs = {"big": 0.03, "small": 0.02}
    target = {"target_agreement": 0.0, "target_scores_p99": 0.016}
    by_mac = greedy_select(layers, _additive_trial(costs, []), Int8Params(sensitivity=target))
    assert [r["rank"] for r in by_mac["layers"]] == [2, 1] and by_mac["kept_float"] == ["small"]
    plain = greedy_select(
        layers, _additive_trial(costs, []), Int8Params(sensitivity={**target, "order": "sensitivity"})
    )
    assert plain["kept_float"] == ["big"]


def test_error_is_missed_detections_plus_the_p99_score_shift() -> None:
    agreement = {"match_rate": 0.97, "scores_abs_diff": {"p99": 0.02}}
    assert error_of(agreement) == pytest.approx(0.05)
    assert error_of({"match_rate": 1.0, "scores_abs_diff": {"p99": None}}) == 0.0


def test_int8_format_is_saturation_free_only_with_seven_bit_weights() -> None:
    f = int8_format(Int8Params())
    assert f["weight_bits"] == 7 and f["x86_saturation_free"] and f["max_pair_sum"] == 32640 < f["int16_max"]
    g = int8_format(Int8Params(reduce_range=False))
    assert g["weight_bits"] == 8 and not g["x86_saturation_free"] and g["max_pair_sum"] == 64770
    t = int8_format(Int8Params(), for_tensorrt=True)
    assert t["weight_bits"] == 8 and t["activations"].startswith("int8 symmetric")


@pytest.fixture(scope="module")
def calib_feeds(tiny_model):
    return [make_feed(tiny_model, 1, 600, seed=300 + i) for i in range(5)]


@pytest.fixture(scope="module")
def built(exported, calib_feeds, tmp_path_factory):
    out = tmp_path_factory.mktemp("sens")
    params = Int8Params(sensitivity={"target_agreement": 0.95, "target_scores_p99": 0.05})
    result, report = build_int8(
        exported.path, out / "model.int8.onnx", calib_feeds, params, score_threshold=0.3,
        match_distance_m=0.5, threads=1, cache_dir=out, work_dir=out,
    )  # fmt: skip
    return out, result, report


def test_build_compares_methods_profiles_every_layer_and_records_the_choice(built, exported) -> None:
    out, result, report = built
    compared = report["calibration"]["compared"]
    assert [c["method"] for c in compared] == ["percentile", "minmax"]
    assert report["calibration"]["chosen"] == min(compared, key=lambda c: c["all_layers"]["error"])["method"]
    for c in compared:
        assert (out / f"calibration.{c['method']}.json").is_file() and c["frames"] == 5
    layers = {row["name"]: row for row in report["layers"]}
    assert report["profiled"], "this fixture's target needs the profile (the skip is tested below)"
    assert len(layers) >= 10 and all("sensitivity" in r and r["module"] for r in layers.values())
    assert {r["rank"] for r in layers.values()} == set(range(1, len(layers) + 1))
    # The all-layers trial of the chosen method is the greedy's first step (not run twice); the profile runs
    # only when that step misses the target.
    profiled = len(layers) if report["profiled"] else 0
    assert report["trials"] == len(compared) + profiled + len(report["greedy"]) - 1
    assert report["greedy"][0]["error"] == min(c["all_layers"]["error"] for c in compared)
    assert set(report["timings_s"]) >= {"preprocess", "reference", "calibration", "quantize"}
    kept = set(report["kept_float"])
    assert kept <= set(layers) and set(report["quantized"]) == set(layers) - kept
    assert result.quantized_nodes == len(report["quantized"])
    assert all(result.excluded_nodes[n] == "kept float (sensitivity)" for n in kept)
    # ConvTranspose is a forced exclusion (no int8 kernel in ORT's CPU EP), never profiled.
    assert report["forced_float"] and all(
        w == "op type ConvTranspose" for w in report["forced_float"].values()
    )
    text = format_report(report)
    assert "calibration:" in text and "greedy:" in text and text.count("\n") >= len(layers) + 3
    json.dumps(report)  # the report is what sensitivity.json holds


def test_a_previous_report_of_the_same_model_frames_and_recipe_is_reused_without_trials(
    built, exported, calib_feeds, tmp_path
) -> None:
    out, _result, report = built
    (out / REPORT).write_text(json.dumps(report))  # what the stage writes beside the caches
    params = Int8Params(sensitivity={"target_agreement": 0.95, "target_scores_p99": 0.05})
    kw = {"score_threshold": 0.3, "match_distance_m": 0.5, "threads": 1}
    again, rep = build_int8(exported.path, tmp_path / "a.onnx", calib_feeds, params, cache_dir=tmp_path / "a",
                            work_dir=tmp_path, previous_cache_dir=out, **kw)  # fmt: skip
    assert rep["trials"] == 0 and rep["reused_from"] == str(out / REPORT) and "reused" in rep["timings_s"]
    assert rep["kept_float"] == report["kept_float"] and again.quantized_nodes == len(report["quantized"])
    assert (tmp_path / "a.onnx").read_bytes() == (out / "model.int8.onnx").read_bytes()
    # Another recipe (a different target) is measured anew.
    other = Int8Params(sensitivity={"target_agreement": 0.5, "target_scores_p99": 0.5})
    _, rep2 = build_int8(exported.path, tmp_path / "b.onnx", calib_feeds, other, cache_dir=tmp_path / "b",
                         work_dir=tmp_path, previous_cache_dir=out, **kw)  # fmt: skip
    assert rep2["trials"] > 0 and "reused_from" not in rep2


def test_int8_model_has_seven_bit_weights_and_declares_its_format(built) -> None:
    out, _result, report = built
    model = onnx.load(str(out / "model.int8.onnx"))
    props = {p.key: p.value for p in model.metadata_props}
    assert props[X86_EXACT_KEY] == "true"
    fmt = json.loads(props["pfactory.int8.format"])
    assert fmt["weight_bits"] == 7 and fmt["calibration"] == report["calibration"]["chosen"]
    weights = [
        onnx.numpy_helper.to_array(i) for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8
    ]
    assert weights and max(int(np.abs(w.astype(np.int32)).max()) for w in weights) <= 64


def test_kept_float_layers_read_float_weights(built) -> None:
    out, _, report = built
    model = onnx.load(str(out / "model.int8.onnx"))
    floats = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    by_name = {n.name: n for n in model.graph.node}
    for name in report["kept_float"]:
        assert by_name[name].input[1] in floats, name
    for name in report["quantized"]:
        assert by_name[name].input[1] not in floats, name


def test_entropy_is_not_minmax(exported, calib_feeds, tmp_path) -> None:
    """ORT's quantize_static Entropy default (128 bins = 128 quantized bins) returns the MinMax ranges;
    `calibrate` uses 2048 bins, so the KL threshold clips somewhere."""
    from onnxruntime.quantization.calibrate import load_tensors_data

    base, _ = preprocess(exported.path, tmp_path / "pre.onnx")
    params = Int8Params()
    for method in ("minmax", "entropy"):
        info = calibrate(base, calib_feeds, method, tmp_path / f"{method}.json", params, tmp_path)
        assert info["frames"] == len(calib_feeds) and info["tensors"] > 0
    mm = load_tensors_data(tmp_path / "minmax.json").data
    en = load_tensors_data(tmp_path / "entropy.json").data
    high = {k: float(np.max(v.range_value[1])) for k, v in mm.items()}  # a 0-d or a 1-element array
    clipped = [k for k in mm if float(np.max(en[k].range_value[1])) < 0.99 * high[k]]
    assert clipped, "entropy calibration returned the min/max ranges"


def test_the_calibration_cache_is_the_same_bytes_in_every_process(exported, calib_feeds, tmp_path) -> None:
    """Two processes with different string hash seeds write byte-identical caches: ORT gathers the tensors
    in a set (its order follows the seed), `calibrate` writes them by name."""
    import pickle
    import subprocess
    import sys

    base, _ = preprocess(exported.path, tmp_path / "pre.onnx")
    (tmp_path / "feeds.pkl").write_bytes(pickle.dumps(calib_feeds[:2]))
    code = (
        "import pickle, sys; from pathlib import Path; "
        "from pfactory.optimize.ort_backend import calibrate; from pfactory.optimize.params import Int8Params; "
        "feeds = pickle.loads(Path(sys.argv[2]).read_bytes()); "
        "calibrate(sys.argv[1], feeds, 'minmax', sys.argv[3], Int8Params(), Path(sys.argv[3]).parent)"
    )
    outs = []
    for seed in ("1", "2", "3"):
        out = tmp_path / f"cache-{seed}" / "minmax.json"
        out.parent.mkdir()
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", code, str(base), str(tmp_path / "feeds.pkl"), str(out)],
                              env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(out.read_bytes())
    names = list(json.loads(outs[0])["data"])
    assert names == sorted(names) and len(names) > 5
    assert outs[0] == outs[1] == outs[2]


def test_layers_are_matched_to_modules_through_their_weights(exported, tmp_path) -> None:
    base, _how = preprocess(exported.path, tmp_path / "pre.onnx")
    layers, forced, unmatched = quantizable_layers(
        onnx.load(str(exported.path)), onnx.load(str(base)), Int8Params(exclude_nodes=["head.reg", "nope"])
    )
    modules = {layer.module for layer in layers}
    assert "head.heatmap" in modules and "head.reg" not in modules
    assert any("head.reg" in why for why in forced.values()) and unmatched == ["nope"]
    assert all(layer.macs is None or layer.macs > 0 for layer in layers)
    assert any(layer.op_type == "Gemm" for layer in layers)  # the point MLP, renamed by pre-processing
