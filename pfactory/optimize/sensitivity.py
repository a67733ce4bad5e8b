"""Sensitivity-guided INT8: which layers stay float, chosen by measurement on the calibration frames.

In:  the exported float model, calibration feeds (dicts of numpy inputs, the train split), `Int8Params`,
     the agreement definition (score threshold, match distance), a thread count.
Out: `build_int8(...) -> (QuantizeResult, report)`: the INT8 QDQ model (ONNX Runtime) and the report
     written to `onnxruntime/sensitivity.json`:
    calibration  every compared method with its measured error (all layers quantized) and the chosen one
    layers       per quantizable layer (graph order): module, op type, MACs, and its sensitivity = the
                 error it causes when quantized *alone* (every other layer float)
    greedy       every step: layers kept float so far, the whole model's error, whether the target holds
    kept_float   the chosen set (plus the forced exclusions); the TensorRT INT8 build reuses it

Error of a candidate (`error_of`): on the calibration frames, against the same float model in ONNX
Runtime FP32, the confident-detection agreement (`parity.detection_agreement`): (1 - match rate) + 99th
percentile of |score diff| over matched detections. Two numbers a user of the detections sees, on the
scale the parity gate uses, summed so a layer that drops detections and one that shifts scores rank on
one axis. Each trial also records the heading agreement (matched detections whose heading stayed within
0.5 rad): reported, not selected on. Layers whose inputs are too fine for 8 bits are the architecture's to
name (`int8_float_modules` of the detector contract, joined to `exclude_nodes`), and the held-out parity
gate (`min_heading_agreement`) and promote's AOE-delta gate refuse an artifact that turns headings. A dense output error (logit RMSE) was tried first and missed what matters: quantizing the
heatmap conv alone moved the logits least of all layers (RMSE 0.013) yet cost Car AP@2m 0.9 points, by
coarsening the logits into ties that the max-pool peak extraction turns into duplicate detections --
which the match rate counts (docs/OPTIMIZE.md, "Sensitivity").

Greedy selection (the recipe of NVIDIA's CUDA-BEVFusion/CenterPoint PTQ, made cost-aware): layers are kept
float one at a time, re-measuring the whole model after each, until it meets `sensitivity.target_agreement`
and `sensitivity.target_scores_p99`, or `max_excluded` is reached (then `met` is false and the stage says
so; the parity gate on held-out frames still decides). The order is `sensitivity.order`: by default
sensitivity per MAC (the error a layer causes per unit of integer compute it would give up), so a cheap
sensitive layer (the point MLP, the heatmap conv) goes float before an expensive one (`head.shared`,
26 % of the convs' MACs), which plain sensitivity order kept float at a 19-25 % latency cost for no
measured accuracy gain.

Fewer trials, the same choice: the all-layers trial of the chosen calibration method is the greedy's
first step (not run twice); when it already meets the target the per-layer profile (one trial per layer,
needed only for the greedy's order) is skipped (`profiled: false`); and a previous optimized directory's
report measured on the same float model, frames and recipe (`selection_key`: the calibration key plus the
INT8 params, agreement definition and threads) is reused whole with its calibration caches (`reused_from`,
no trial). `timings_s` splits the build's time (preprocess, reference, calibration, calibration_trials,
sensitivity_search, quantize).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.detectors.contract import OUTPUT_NAMES
from pfactory.optimize.feed import Feed
from pfactory.optimize.ort_backend import (
    Layer,
    QuantizeResult,
    calibrate,
    int8_format,
    make_session,
    preprocess,
    quantizable_layers,
    quantize_layers,
)
from pfactory.optimize.params import Int8Params, SensitivityParams
from pfactory.optimize.parity import detection_agreement

Outputs = dict[str, np.ndarray]
REPORT = "sensitivity.json"


def error_of(agreement: dict[str, Any]) -> float:
    """(1 - match rate) + p99 |score diff| of a `detection_agreement` (0 = identical detections)."""
    p99 = agreement["scores_abs_diff"]["p99"]
    return (1.0 - float(agreement["match_rate"])) + (float(p99) if p99 is not None else 0.0)


def _summary(agreement: dict[str, Any]) -> dict[str, Any]:
    return {
        "error": round(error_of(agreement), 6),
        "match_rate": round(float(agreement["match_rate"]), 6),
        "scores_p99": agreement["scores_abs_diff"]["p99"],
        "scores_max": agreement["scores_abs_diff"]["max"],
        "heading_agreement": round(float(agreement.get("heading_agreement", 1.0)), 6),
        "matched": agreement["matched"],
        "reference_detections": agreement["reference_detections"],
        "candidate_detections": agreement["candidate_detections"],
    }


def meets(summary: dict[str, Any], sp: SensitivityParams) -> bool:
    """True when a trial's summary meets the sensitivity targets of `sp`."""
    p99 = summary["scores_p99"] if summary["scores_p99"] is not None else 0.0
    return summary["match_rate"] >= sp.target_agreement and p99 <= sp.target_scores_p99


def greedy_select(
    layers: Sequence[Layer],
    trial: Callable[[list[str]], dict[str, Any]],
    params: Int8Params,
    all_quantized: dict[str, Any] | None = None,
    profile_trial: Callable[[list[str]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The sensitivity profile and the greedy choice; `trial(quantized node names) -> _summary(...)`.

    Pure logic over `trial` (unit-tested with a synthetic trial): returns {"layers": [...], "greedy":
    [...], "kept_float": [...], "met": bool, "profiled": bool}. `all_quantized`: the summary of the trial
    with every layer quantized when already measured (the calibration comparison measures it): it is the
    greedy's first step, not run again, and when it meets the target no layer can be kept float, so the
    per-layer profile (one trial per layer, only the greedy's order) is skipped: the same choice, fewer trials.
    `profile_trial`: the trial of the per-layer profile when it differs (fewer frames,
    `sensitivity.profile_frames`); the greedy's steps, which decide whether the target holds, use `trial`.
    """
    sp = params.sensitivity
    names = [layer.name for layer in layers]
    if all_quantized is not None and meets(all_quantized, sp):
        return {
            "layers": [layer.to_json() for layer in layers],
            "greedy": [{"kept_float": [], **all_quantized, "met": True}],
            "kept_float": [],
            "met": True,
            "profiled": False,
        }
    profile = []
    for layer in layers:
        s = (profile_trial or trial)([layer.name])
        profile.append({**layer.to_json(), "sensitivity": s["error"], "alone": s})
    known = sorted(r["macs"] for r in profile if r.get("macs"))
    typical = known[len(known) // 2] if known else 1  # a layer of unknown cost counts as the median one
    for r in profile:
        per_mmac = r["sensitivity"] / (r.get("macs") or typical) * 1e6
        r["priority"] = r["sensitivity"] if sp.order == "sensitivity" else per_mmac
    order = sorted(range(len(profile)), key=lambda i: (-profile[i]["priority"], i))
    for rank, i in enumerate(order, 1):
        profile[i]["rank"] = rank  # the greedy order (`priority`: sensitivity, or sensitivity per MMAC)
    cap = len(layers) if sp.max_excluded is None else min(sp.max_excluded, len(layers))
    kept: list[str] = []
    steps = []
    while True:
        quantized = [n for n in names if n not in kept]
        s = all_quantized if (not kept and all_quantized is not None) else trial(quantized)
        ok = meets(s, sp)
        steps.append({"kept_float": list(kept), **s, "met": ok})
        if ok or len(kept) >= cap:
            break
        kept.append(names[order[len(kept)]])
    return {"layers": profile, "greedy": steps, "kept_float": kept, "met": steps[-1]["met"], "profiled": True}


class _Trials:
    """Builds a QDQ model with a given set of layers quantized and measures it against the float model."""

    def __init__(
        self,
        base: Path,
        feeds: Sequence[Feed],
        reference: Sequence[Outputs],
        params: Int8Params,
        score_threshold: float,
        match_distance_m: float,
        threads: int,
        work: Path,
    ) -> None:
        self.base, self.feeds, self.reference, self.params = base, feeds, reference, params
        self.score_threshold, self.match_distance_m, self.threads = score_threshold, match_distance_m, threads
        self.work = work
        self.path = work / ".trial.int8.onnx"
        self.count = 0
        self.cache: Path | None = None
        self.method = ""

    def __call__(self, quantized: list[str], frames: int | None = None) -> dict[str, Any]:
        """The error of the model with `quantized` layers quantized, on the first `frames` frames (all: None)."""
        assert self.cache is not None
        quantize_layers(self.base, self.path, self.cache, self.method, self.params, quantized)
        n = len(self.feeds) if frames is None else min(frames, len(self.feeds))
        outs = run_feeds(self.path, self.feeds[:n], self.threads)
        self.count += 1
        return _summary(
            detection_agreement(self.reference[:n], outs, self.score_threshold, self.match_distance_m)
        )


def run_feeds(path: Path, feeds: Sequence[Feed], threads: int) -> list[Outputs]:
    """Outputs of the ONNX model at `path` on every feed (CPU, sequential, `threads` intra-op threads)."""
    session = make_session(path, "cpu", threads, spin=False)
    names = [o.name for o in session.get_outputs()][: len(OUTPUT_NAMES)]
    inputs = [i.name for i in session.get_inputs()]
    return [dict(zip(OUTPUT_NAMES, session.run(names, {k: f[k] for k in inputs}))) for f in feeds]


class _Clock:
    """Seconds per step of `build_int8` since `start` (the report's `timings_s`), accumulated per step name."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.split: dict[str, float] = {}

    def lap(self, step: str, t0: float) -> float:
        """Add the time since `t0` to `step`; now (the next step's `t0`)."""
        now = time.perf_counter()
        self.split[step] = round(self.split.get(step, 0.0) + now - t0, 3)
        return now

    def total(self) -> float:
        """Seconds since `start`, rounded to ms."""
        return round(time.perf_counter() - self.start, 3)


def build_int8(
    src: str | Path,
    dst: str | Path,
    feeds: Sequence[Feed],
    params: Int8Params,
    *,
    score_threshold: float,
    match_distance_m: float,
    threads: int,
    cache_dir: str | Path,
    work_dir: str | Path,
    previous_cache_dir: str | Path | None = None,
) -> tuple[QuantizeResult, dict[str, Any]]:
    """Calibrate (method chosen by measurement when `ort_method` is auto), profile, select, quantize.

    `src`: the float model (exactly-rewritten export); `dst`: the INT8 QDQ model; `cache_dir` receives
    one calibration cache per method (`calibration.<method>.json`). `previous_cache_dir`: an earlier
    optimized directory's cache folder, reused per method when it was computed from the same float
    model on the same frames (the `key` recorded in the report). Module docstring for the rest.
    """
    import onnx

    clock = _Clock()
    src, dst, cache_dir, work = Path(src), Path(dst), Path(cache_dir), Path(work_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    base, how = preprocess(src, work / ".int8.preprocessed.onnx")
    points = int(np.mean([int(n) for f in feeds for n in f["num_points"]])) if feeds else None
    layers, forced, unmatched = quantizable_layers(onnx.load(str(src)), onnx.load(str(base)), params, points)
    t = clock.lap("preprocess", clock.start)
    key, selection_key = _keys(base, feeds, params, score_threshold, match_distance_m, threads)
    names = [layer.name for layer in layers]
    previous = _previous_selection(previous_cache_dir, selection_key, cache_dir, names)
    trials = _Trials(base, feeds, [], params, score_threshold, match_distance_m, threads, work)
    if previous is not None:  # same float model, frames and recipe: the same measurements, not re-run
        compared, best, selection = _reuse_selection(previous, previous_cache_dir, trials, cache_dir)
        t = clock.lap("reused", t)
    else:
        compared, best, selection, t = _measure(trials, layers, key, cache_dir, previous_cache_dir, clock, t)
    method = compared[best]["method"]
    kept = selection["kept_float"]
    quantized = [n for n in names if n not in kept]
    counts = quantize_layers(base, dst, trials.cache, method, params, quantized)
    clock.lap("quantize", t)
    report = {
        **_report_head(trials, points, compared, method, key, selection_key),
        **selection,
        **_report_tail(layers, kept, forced, unmatched, quantized, trials, clock),
    }
    for p in (base if base != src else None, trials.path):
        if p is not None and Path(p).exists():
            Path(p).unlink()
    excluded = {**forced, **{n: "kept float (sensitivity)" for n in kept}}
    result = _quantize_result(
        params, dst, len(feeds), compared[best], quantized, excluded, unmatched, how, counts, clock.total()
    )
    return result, report


def _quantize_result(
    params: Int8Params,
    dst: Path,
    frames: int,
    calibration: dict[str, Any],
    quantized: list[str],
    excluded: dict[str, str],
    unmatched: list[str],
    how: str,
    counts: dict[str, int],
    quantize_s: float,
) -> QuantizeResult:
    """What `build_int8` built (the stage's backend.json "quantization"): the INT8 model `dst` with the chosen
    `calibration`, its layers `quantized` and `excluded`, in `quantize_s` seconds."""
    return QuantizeResult(
        path=dst.name,
        method=calibration["method"],
        activation_type=params.activation_type,
        weight_type="int8",
        symmetric_activations=params.activation_type == "int8",
        per_channel=params.per_channel,
        op_types=list(params.op_types),
        calibration_frames=frames,
        quantized_nodes=len(quantized),
        excluded_nodes=excluded,
        unmatched_patterns=unmatched,
        preprocess=how,
        calibration_cache=f"calibration.{calibration['method']}.json",
        quantize_s=quantize_s,
        node_op_types=counts,
        format=int8_format(params),
        calibration=calibration,
    )


def _keys(
    base: Path,
    feeds: Sequence[Feed],
    params: Int8Params,
    score_threshold: float,
    match_distance_m: float,
    threads: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(key, selection_key): what a calibration cache depends on (the float model `base`, the frames, the
    quantized op types, the percentile), and what the whole selection depends on besides (the INT8 params,
    the agreement definition, the thread count): a previous report with the same selection key is reused."""
    from pfactory.storage.fsutil import sha256_file

    key = {
        "float_model_sha256": sha256_file(base),
        "frames": len(feeds),
        "feeds_sha256": _feeds_digest(feeds),
        "op_types": list(params.op_types),
        "percentile": params.percentile,
    }
    selection_key = {
        **key,
        "int8": params.model_dump(mode="json"),
        "score_threshold": score_threshold,
        "match_distance_m": match_distance_m,
        "threads": threads,
    }
    return key, selection_key


def _reuse_selection(
    previous: dict[str, Any], previous_cache_dir: str | Path | None, trials: _Trials, cache_dir: Path
) -> tuple[list[dict[str, Any]], int, dict[str, Any]]:
    """(compared, index of the chosen method, selection) of a `previous` report measured on the same float
    model, frames and recipe; `trials` set to its chosen method's calibration cache (copied to `cache_dir`)."""
    compared = [{**c, "reused": True} for c in previous["calibration"]["compared"]]
    method = previous["calibration"]["chosen"]
    best = [c["method"] for c in compared].index(method)
    selection = {k: previous[k] for k in ("layers", "greedy", "kept_float", "met")}
    selection["profiled"] = previous.get("profiled", True)
    selection["reused_from"] = str(Path(previous_cache_dir or "") / REPORT)
    trials.cache, trials.method = cache_dir / f"calibration.{method}.json", method
    return compared, best, selection


def _measure(
    trials: _Trials,
    layers: Sequence[Layer],
    key: dict[str, Any],
    cache_dir: Path,
    previous_cache_dir: str | Path | None,
    clock: _Clock,
    t: float,
) -> tuple[list[dict[str, Any]], int, dict[str, Any], float]:
    """(compared, index of the chosen method, selection, the clock's now) measured anew: the FP32 reference
    outputs, every calibration method's all-layers trial (`_compare_methods`), the lowest error chosen (ties:
    listed first), `trials` set to it, then the layers kept float (`_select`)."""
    trials.reference = run_feeds(trials.base, trials.feeds, trials.threads)
    t = clock.lap("reference", t)
    names = [layer.name for layer in layers]
    compared, t = _compare_methods(trials, names, key, cache_dir, previous_cache_dir, clock, t)
    best = min(range(len(compared)), key=lambda i: (compared[i]["all_layers"]["error"], i))
    method = compared[best]["method"]
    trials.cache, trials.method = cache_dir / f"calibration.{method}.json", method
    selection = _select(layers, trials, compared[best]["all_layers"])
    t = clock.lap("sensitivity_search", t)
    return compared, best, selection, t


def _compare_methods(
    trials: _Trials,
    names: list[str],
    key: dict[str, Any],
    cache_dir: Path,
    previous_cache_dir: str | Path | None,
    clock: _Clock,
    t: float,
) -> tuple[list[dict[str, Any]], float]:
    """Each calibration method (`ort_method`, or every one of `calibration_methods` when auto): its cache
    (reused from `previous_cache_dir` when its key matches, else calibrated) and the error with every layer
    in `names` quantized. (the compared entries, the clock's now)."""
    params = trials.params
    methods = list(params.calibration_methods) if params.ort_method == "auto" else [params.ort_method]
    compared = []
    for method in dict.fromkeys(methods):
        cache = cache_dir / f"calibration.{method}.json"
        reused = _reuse_cache(previous_cache_dir, cache, key, method)
        calib = {"method": method, "reused": True, "cache": cache.name} if reused else None
        if calib is None:
            calib = calibrate(trials.base, trials.feeds, method, cache, params, trials.work)
        t = clock.lap("calibration", t)
        trials.cache, trials.method = cache, method
        compared.append({**calib, "all_layers": trials(names)})
        t = clock.lap("calibration_trials", t)
    return compared, t


def _select(layers: Sequence[Layer], trials: _Trials, all_quantized: dict[str, Any]) -> dict[str, Any]:
    """The layers kept float: the greedy search (`greedy_select`, its per-layer profile on the first
    `sensitivity.profile_frames` frames when fewer than all) when `sensitivity.enabled`, else none, with
    whether every layer quantized (`all_quantized`, the chosen method's trial) meets the target."""
    params = trials.params
    sp = params.sensitivity
    if sp.enabled and layers:
        profile_trial = None
        if sp.profile_frames is not None and sp.profile_frames < len(trials.feeds):

            def profile_trial(quantized: list[str]) -> dict[str, Any]:
                return trials(quantized, sp.profile_frames)

        return greedy_select(layers, trials, params, all_quantized=all_quantized, profile_trial=profile_trial)
    ok = meets(all_quantized, sp)
    return {
        "layers": [layer.to_json() for layer in layers],
        "greedy": [{"kept_float": [], **all_quantized, "met": ok}],
        "kept_float": [],
        "met": ok,
        "profiled": False,
    }


def _report_head(
    trials: _Trials,
    points: int | None,
    compared: list[dict[str, Any]],
    method: str,
    key: dict[str, Any],
    selection_key: dict[str, Any],
) -> dict[str, Any]:
    """The report's fields before the selection: format, reference, agreement definition, target, the
    calibration comparison and the keys."""
    params = trials.params
    sp = params.sensitivity
    return {
        "format": int8_format(params),
        "reference": "ONNX Runtime FP32 of the same float model",
        "frames": len(trials.feeds),
        "agreement_score_threshold": trials.score_threshold,
        "match_distance_m": trials.match_distance_m,
        "error": "(1 - match rate) + p99 |score diff|, confident detections, vs FP32",
        "order": sp.order,
        "points_per_frame": points,
        "target": {
            "agreement": sp.target_agreement,
            "scores_p99": sp.target_scores_p99,
            "max_excluded": sp.max_excluded,
        },
        "calibration": {"mode": params.ort_method, "compared": compared, "chosen": method},
        "key": key,
        "selection_key": selection_key,
    }


def _report_tail(
    layers: Sequence[Layer],
    kept: list[str],
    forced: dict[str, str],
    unmatched: list[str],
    quantized: list[str],
    trials: _Trials,
    clock: _Clock,
) -> dict[str, Any]:
    """The report's fields after the selection: what was kept float and quantized, the trial count, times."""
    by_name = {layer.name: layer for layer in layers}
    return {
        "kept_float_modules": [by_name[n].module or n for n in kept],
        "forced_float": forced,
        "unmatched_patterns": unmatched,
        "quantized": quantized,
        "trials": trials.count,
        "seconds": clock.total(),
        "timings_s": clock.split,
    }


def _feeds_digest(feeds: Sequence[Feed]) -> str:
    import hashlib

    h = hashlib.sha256()
    for f in feeds:
        for k in sorted(f):
            h.update(k.encode())
            h.update(np.ascontiguousarray(f[k]).tobytes())
    return h.hexdigest()


def _reuse_cache(previous: str | Path | None, cache: Path, key: dict[str, Any], method: str) -> bool:
    """Copy `previous/<cache name>` to `cache` when the previous report's key equals `key`."""
    import json

    if previous is None:
        return False
    prev = Path(previous)
    report, old = prev / REPORT, prev / cache.name
    if not (report.is_file() and old.is_file()):
        return False
    try:
        if json.loads(report.read_text()).get("key") != key:
            return False
    except (json.JSONDecodeError, OSError):
        return False
    shutil.copyfile(old, cache)
    return True


def _previous_selection(
    previous: str | Path | None, selection_key: dict[str, Any], cache_dir: Path, names: list[str]
) -> dict[str, Any] | None:
    """A previous optimized directory's sensitivity report when it was measured on the same float model,
    frames and recipe (`selection_key`) over the same layers, with every calibration cache it compared
    copied into `cache_dir`; else None (measure anew)."""
    import json

    if previous is None:
        return None
    prev = Path(previous)
    try:
        report = json.loads((prev / REPORT).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if (
        report.get("selection_key") != selection_key
        or [r.get("name") for r in report.get("layers", [])] != names
    ):
        return None
    caches = [prev / str(c.get("cache", "")) for c in report["calibration"]["compared"]]
    if not all(c.is_file() and c.name.startswith("calibration.") for c in caches):
        return None
    for c in caches:
        shutil.copyfile(c, cache_dir / c.name)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The sensitivity report as a plain-text table (what the stage prints)."""
    lines = [
        f"INT8 sensitivity ({report['frames']} calibration frames, vs FP32; error = {report['error']}):",
        "  calibration: "
        + ", ".join(
            f"{c['method']} {c['all_layers']['error']:.4f}{' (reused)' if c.get('reused') else ''}"
            for c in report["calibration"]["compared"]
        )
        + f" -> {report['calibration']['chosen']}",
        f"  {'rank':>4} {'layer (module)':<30} {'op':<6} {'MMAC':>6} {'alone: error':>12} {'match':>6} "
        f"{'p99':>6} {'/MMAC':>7}",
    ]
    kept = set(report["kept_float"])
    for layer in sorted(report["layers"], key=lambda r: r.get("rank", 0)):
        a = layer.get("alone") or {}
        macs = f"{layer['macs'] / 1e6:6.1f}" if layer.get("macs") else "     -"
        per = (
            layer["sensitivity"] / layer["macs"] * 1e6
            if layer.get("macs") and "sensitivity" in layer
            else None
        )
        lines.append(
            f"  {layer.get('rank', '-'):>4} {(layer['module'] or layer['name'])[:30]:<30} {layer['op_type']:<6} "
            f"{macs} {layer.get('sensitivity', float('nan')):12.4f} {a.get('match_rate', float('nan')):6.3f} "
            f"{a.get('scores_p99') or 0:6.3f} {per if per is not None else float('nan'):7.5f}"
            f"{'  float' if layer['name'] in kept else ''}"
        )
    for step in report["greedy"]:
        lines.append(
            f"  greedy: {len(step['kept_float'])} float -> error {step['error']:.4f} match {step['match_rate']:.3f} "
            f"p99 {step['scores_p99'] or 0:.3f}{'  target met' if step['met'] else ''}"
        )
    if report.get("reused_from"):
        lines.append(f"  reused: {report['reused_from']} (same float model, frames and recipe; no trial run)")
    elif not report.get("profiled", True):
        lines.append("  per-layer profile skipped: every layer quantized already meets the target")
    if report.get("timings_s"):
        lines.append("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in report["timings_s"].items()))
    if report["forced_float"]:
        lines.append(f"  forced float: {', '.join(sorted(set(report['forced_float'].values())))}")
    if not report["met"]:
        lines.append(
            "  target NOT met on the calibration frames (the parity gate on held-out frames decides)"
        )
    return "\n".join(lines)
