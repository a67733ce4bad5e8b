"""The promotion gates: a candidate's evidence (and the champion's KPIs on the same data) -> pass/fail each.

In:  `PromoteParams`, the candidate `Evidence`, the champion's KPI summary on the candidate's evaluation
     data (None when there is no champion: only the absolute gates apply) and the side-by-side latency of
     candidate and champion (`pfactory.optimize.latency.compare_directories`, from `promotion.promote`).
Out: `list[Gate]`, in a fixed order. Each gate has a `value`, a `threshold`, `passed` and a `margin`
     (positive: passed with room; negative: failed by that much; None for a yes/no gate) and a `detail`
     sentence that names what failed and by how much.

Gates (params.promote):
- `min_map`                   candidate mAP >= min_map                              (absolute)
- `p99_latency_ms`            p99 at batch `latency_batch`, primary artifact <= max_p99_latency_ms (absolute
                              ceiling, optimize's latency.json; with no champion the only latency gate)
- `optimize_parity`           optimized/parity.json "passed" (when require_parity)   (absolute)
- `parity_map_delta`          |mAP(optimized) - mAP(PyTorch)| <= parity_map_tolerance (absolute)
- `parity_class_ap_delta/<C>` per class, |AP@parity_class_ap_distance_m(optimized) - AP(PyTorch)|
                              <= parity_class_ap_tolerance (absolute)
- `parity_class_aoe_delta/<C>` per class, AOE(optimized) - AOE(PyTorch) <= parity_class_aoe_tolerance
                              + pi / (the class's ground-truth count): one turned heading (absolute,
                              one-sided: worse headings; a class without a true positive has no AOE, no gate)
- `parity_range_map_delta/<B>` per range bucket, |mAP(optimized) - mAP(PyTorch)| <= parity_range_map_tolerance
- `parity_agreement`          confident-detection match rate k/n of the primary artifact vs PyTorch
                              (parity.json) >= min_parity_agreement (absolute), judged with its support:
                              n < rate_min_support "too few to judge" (passes); else refused only when the
                              Wilson upper bound at rate_confidence < the limit (`judge_rate`)
- `parity_scores_p99`         p99 |score diff| of those matched detections <= max_parity_scores_p99
The parity_* gates are the optimized artifact's accuracy evidence (INT8 above all): the KPI delta the
evaluate stage measured on the same frames plus the robust detection agreement, never a single worst
element. An evaluation without the PyTorch reference cannot verify them: they fail, saying so.
A KPI delta cannot be resolved finer than one object: one detection that crosses the other's rank moves a
class's AP at one distance threshold by up to 1/N (N ground-truth objects of the class), a mean over C
classes by up to 1/(C * N). Each KPI-delta gate's threshold is therefore its tolerance plus the worth of
ONE flipped detection, at most what its class actually moved (`_allowance`; the detail names it when it is
not ~0): a tiny evaluation (a quick-look run: 2 cars in the 0-20 m bucket) cannot refuse an artifact on
one flipped detection, while on a full evaluation (hundreds of objects per class) the allowance is a
fraction of the tolerance, and a loss spread over several objects or classes is never forgiven.
- `kitti/<C>/<metric>/<diff>`  per entry of min_kitti: KITTI's AP (R40, strict; kpis.json `kitti`) >= its value
                              (absolute; fails, saying so, when the candidate has no KITTI metric)
- `map_regression`            champion mAP - candidate mAP <= max_map_regression     (vs champion)
- `class_ap_regression/<C>`   per class, champion AP - candidate AP <= max_class_ap_regression (vs champion)
- `latency_p50_vs_champion`   candidate p50 / champion p50 <= max_latency_ratio    (vs champion, both timed
                              side by side in this process, interleaved; a failure re-measured once, the
                              smaller ratio read)
- `latency_p99_vs_champion`   candidate p99 / champion p99 <= max_p99_latency_ratio (vs champion, same)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pfactory.optimize.parity import judge_rate
from pfactory.promote.evidence import Evidence
from pfactory.promote.params import PromoteParams


@dataclass
class Gate:
    """One gate's outcome (`to_json()` is the `{"name", "value", "threshold", "passed", "margin"}` record)."""

    name: str
    value: Any
    threshold: Any
    passed: bool
    margin: float | None
    detail: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _upper(name: str, value: float, limit: float, what: str, unit: str = "") -> Gate:
    """value must be <= limit."""
    passed = value <= limit
    verdict = "ok" if passed else f"FAILED by {value - limit:.4g}{unit}"
    return Gate(
        name, value, limit, passed, limit - value, f"{what} {value:.4g}{unit} <= {limit:.4g}{unit}: {verdict}"
    )


def _lower(name: str, value: float, limit: float, what: str) -> Gate:
    """value must be >= limit."""
    passed = value >= limit
    verdict = "ok" if passed else f"FAILED by {limit - value:.4g}"
    return Gate(name, value, limit, passed, value - limit, f"{what} {value:.4g} >= {limit:.4g}: {verdict}")


def _allowance(deltas: Mapping[str, float], counts: Mapping[str, int], classes: int) -> tuple[float, str]:
    """(allowance, why): the worth of one flipped detection in a mean AP over `classes` classes:
    max over classes of min(|mean AP delta|, 1/N_gt) / `classes`.

    `deltas` {class: optimized - PyTorch mean AP}, `counts` {class: ground-truth objects}; a class without
    ground truth (or without a delta) adds nothing. `why` names the class, e.g. "one Pedestrian of 2".
    """
    best, why = 0.0, ""
    for name, d in deltas.items():
        n = int(counts.get(name, 0))
        if n > 0 and min(abs(d), 1.0 / n) > best:
            best, why = min(abs(d), 1.0 / n), f"one {name} of {n}"
    return best / max(classes, 1), why


def _delta_gate(name: str, value: float, tolerance: float, allowance: tuple[float, str], what: str) -> Gate:
    """|delta| <= tolerance + one flipped detection's worth (`_allowance`); the detail names it."""
    extra, why = allowance
    g = _upper(name, value, tolerance + extra, what)
    if extra > 0.05 * tolerance:
        g.detail += (
            f" (= tolerance {tolerance:.4g} + one object's worth {extra:.4g}: {why} ground-truth objects)"
        )
    return g


def apply_gates(
    params: PromoteParams,
    candidate: Evidence,
    champion_kpis: Mapping[str, Any] | None,
    champion_latency: Mapping[str, Any] | None = None,
) -> list[Gate]:
    """Every gate of params.promote on `candidate` (module docstring); `champion_kpis` on the same data;
    `champion_latency` the side-by-side timing (`compare_directories`, + "champion_version", "rounds"). With
    a champion but no timing the latency gates fail, saying it was not measured."""
    ceiling = _upper(
        "p99_latency_ms", candidate.latency["p99_ms"], params.max_p99_latency_ms,
        f"p99 latency ({candidate.latency['artifact']}, batch {candidate.latency['batch']})", " ms",
    )  # fmt: skip
    if champion_kpis is None:
        ceiling.detail += " (no champion: this absolute ceiling is the only latency gate)"
    gates = [_lower("min_map", candidate.kpis["mAP"], params.min_map, "mAP"), ceiling]
    if params.require_parity:
        ok = bool(candidate.parity["passed"])
        why = "; ".join(candidate.parity["failures"]) or "no failures listed"
        fallback = (candidate.backend.get("selection") or {}).get("fallback")
        passed = "passed" + (f" ({fallback['why']})" if fallback else "")
        gates.append(
            Gate(
                "optimize_parity", ok, True, ok, None,
                f"optimize parity vs PyTorch: {passed}" if ok else f"optimize parity vs PyTorch FAILED ({why})",
            )
        )  # fmt: skip
    gates += _parity_gates(params, candidate)
    gates += _kitti_gates(params, candidate)
    if champion_kpis is not None:
        gates.append(
            _upper(
                "map_regression", champion_kpis["mAP"] - candidate.kpis["mAP"], params.max_map_regression,
                f"mAP drop vs champion ({champion_kpis['mAP']:.4g} -> {candidate.kpis['mAP']:.4g})",
            )
        )  # fmt: skip
        for name, champ in champion_kpis["classes"].items():
            cand = candidate.kpis["classes"].get(name)
            if cand is None:  # the candidate dropped a class the champion detects: the worst regression
                gates.append(
                    Gate(
                        f"class_ap_regression/{name}", None, params.max_class_ap_regression, False, None,
                        f"{name} AP: the candidate has no KPIs for this class (champion {champ['mean_ap']:.4g}): FAILED",
                    )
                )  # fmt: skip
                continue
            gates.append(
                _upper(
                    f"class_ap_regression/{name}", champ["mean_ap"] - cand["mean_ap"],
                    params.max_class_ap_regression,
                    f"{name} AP drop vs champion ({champ['mean_ap']:.4g} -> {cand['mean_ap']:.4g})",
                )
            )  # fmt: skip
        gates += _latency_gates(params, champion_latency)
    return gates


def _latency_gates(params: PromoteParams, cmp: Mapping[str, Any] | None) -> list[Gate]:
    """Candidate / champion p50 and p99, timed side by side (`pfactory.optimize.latency.compare_directories`)."""
    limits = {"p50": params.max_latency_ratio, "p99": params.max_p99_latency_ratio}
    if cmp is None:
        why = "not measured (promotion.promote times both side by side)"
        return [_unverifiable(f"latency_{q}_vs_champion", lim, f"{q} latency vs champion", why)
                for q, lim in limits.items()]  # fmt: skip
    gates = []
    rounds = cmp.get("rounds") or [cmp]
    for q, limit in limits.items():
        key = f"{q}_ms"
        # the round with the smaller ratio (a failure is re-measured once: it must fail twice)
        r = min(rounds, key=lambda m: m[f"ratio_{q}"])
        cand, champ = r["candidate"], r["champion"]
        what = (
            f"{q} candidate {cand['artifact']} {cand[key]:.3g} ms / champion v{cmp.get('champion_version')} "
            f"{champ['artifact']} {champ[key]:.3g} ms (side by side, interleaved, {r['config']['iterations']} "
            f"calls each, batch {r['config']['batch']}, {len(rounds)} measurement(s))"
        )
        gates.append(_upper(f"latency_{q}_vs_champion", r[f"ratio_{q}"], limit, what))
    return gates


def _kitti_gates(params: PromoteParams, candidate: Evidence) -> list[Gate]:
    """`min_kitti`: each named KITTI AP (R40, strict) of the candidate at least its value."""
    gates: list[Gate] = []
    table = candidate.kpis.get("kitti") or {}
    for name, limit in params.min_kitti.items():
        _, cls, metric, diff = name.split("/")
        value = ((table.get(cls) or {}).get(metric) or {}).get(diff)
        what = f"KITTI {cls} {metric} AP R40 ({diff})"
        if value is None:
            why = "kpis.json has no KITTI metric for it (not KITTI data, or AOS without alphas)"
            gates.append(_unverifiable(name, limit, what, why))
        else:
            gates.append(_lower(name, float(value), limit, what))
    return gates


def _unverifiable(name: str, threshold: float, what: str, why: str) -> Gate:
    return Gate(name, None, threshold, False, None, f"{what}: {why}: FAILED, cannot verify")


def _parity_gates(params: PromoteParams, candidate: Evidence) -> list[Gate]:
    """The accuracy evidence of the optimized artifact vs PyTorch (module docstring)."""
    gates: list[Gate] = []
    no_ref = "kpis.json has no 'delta' (evaluate ran without the PyTorch reference)"
    delta = candidate.delta
    counts = {c: int(v.get("num_gt", 0)) for c, v in candidate.kpis["classes"].items()}
    if candidate.delta_map is None:
        gates.append(
            _unverifiable(
                "parity_map_delta", params.parity_map_tolerance, "|mAP(optimized) - mAP(PyTorch)|",
                "kpis.json has no 'delta.mAP' (evaluate ran without the PyTorch reference)",
            )
        )  # fmt: skip
    else:
        per_class = {
            c: sum(ap.values()) / len(ap) for c, ap in (delta or {}).get("classes", {}).items() if ap
        }
        gates.append(
            _delta_gate(
                "parity_map_delta", abs(candidate.delta_map), params.parity_map_tolerance,
                _allowance(per_class, counts, len(counts)),
                "|mAP(optimized) - mAP(PyTorch)|",
            )
        )  # fmt: skip
    th = params.parity_class_ap_distance_m
    for name in candidate.kpis["classes"]:
        what = f"{name} |AP@{th:g}m(optimized) - AP(PyTorch)|"
        gname = f"parity_class_ap_delta/{name}"
        ap = (delta or {}).get("classes", {}).get(name)
        value = None if ap is None else next((v for k, v in ap.items() if float(k) == th), None)
        if value is None:
            why = no_ref if delta is None else f"kpis.json 'delta.classes.{name}.ap' has no {th:g} m entry"
            gates.append(_unverifiable(gname, params.parity_class_ap_tolerance, what, why))
        else:
            allowance = _allowance({name: value}, counts, 1)
            gates.append(_delta_gate(gname, abs(value), params.parity_class_ap_tolerance, allowance, what))
    for name, value in (delta or {}).get("aoe", {}).items():
        n = counts.get(name, 0)
        worse = max(value, 0.0)
        allowance = (min(math.pi / n, worse), f"one {name} heading of {n}") if n else (0.0, "")
        what = f"{name} AOE(optimized) - AOE(PyTorch) (rad)"
        gates.append(
            _delta_gate(f"parity_class_aoe_delta/{name}", value, params.parity_class_aoe_tolerance, allowance, what)
        )
    support = candidate.kpis.get("by_range_num_gt") or {}
    for bucket, value in (delta or {}).get("by_range", {}).items():
        bucket_counts = support.get(bucket) or {}
        allowance = _allowance(delta["by_range_classes"].get(bucket, {}), bucket_counts, len(bucket_counts))
        gates.append(
            _delta_gate(
                f"parity_range_map_delta/{bucket}", abs(value), params.parity_range_map_tolerance, allowance,
                f"range {bucket} m |mAP(optimized) - mAP(PyTorch)|",
            )
        )  # fmt: skip
    a = candidate.agreement
    if a is None:
        why = "parity.json has no 'agreement' for the primary artifact (an older optimize stage)"
        gates.append(_unverifiable("parity_agreement", params.min_parity_agreement, "agreement", why))
        gates.append(_unverifiable("parity_scores_p99", params.max_parity_scores_p99, "scores p99", why))
        return gates
    where = f"{a['artifact']} vs PyTorch, score >= {a['score_threshold']:g}, {a['frames']} frames"
    gates.append(_rate_gate("parity_agreement", a, params, where))
    p99 = a["scores_p99"] if a["scores_p99"] is not None else 0.0  # nothing matched: the match rate decides
    gates.append(
        _upper(
            "parity_scores_p99", p99, params.max_parity_scores_p99,
            f"p99 |score diff| over {a['matched']} matched ({where})",
        )
    )  # fmt: skip
    return gates


def _rate_gate(name: str, a: Mapping[str, Any], params: PromoteParams, where: str) -> Gate:
    """A match rate judged with its support (`pfactory.optimize.parity.judge_rate`): value the rate, margin the
    Wilson upper bound minus the limit (None when too few to judge), the detail says which."""
    n = int(a.get("support", 0))
    k = round(a["match_rate"] * n)  # parity.json records matched / max(reference, candidate)
    r = judge_rate(
        "match rate", k, n, params.min_parity_agreement, params.rate_min_support, params.rate_confidence
    )
    margin = r["upper"] - r["limit"] if r["judged"] else None
    verdict = "ok" if r["passed"] else f"FAILED by {r['limit'] - r['upper']:.4g}"
    return Gate(name, a["match_rate"], params.min_parity_agreement, r["passed"], margin,
                f"{r['text']} ({where}): {verdict}")  # fmt: skip


def failed(gates: Sequence[Gate]) -> list[Gate]:
    """The gates that did not pass."""
    return [g for g in gates if not g.passed]


def format_gates(gates: Sequence[Gate | Mapping[str, Any]]) -> str:
    """A plain-text table: one line per gate with PASS/FAIL and its detail."""
    lines = []
    for g in gates:
        d = g.to_json() if isinstance(g, Gate) else dict(g)
        lines.append(f"  {'PASS' if d['passed'] else 'FAIL'}  {d['name']:<32} {d.get('detail', '')}")
    return "\n".join(lines)


def refused(result: Mapping[str, Any]) -> bool:
    """A promotion result (`promotion.promote`) the gates said no to: "refused", or a dry run that would be."""
    return result["decision"] == "refused" or (result["decision"] == "dry-run" and not result.get("would_promote"))
