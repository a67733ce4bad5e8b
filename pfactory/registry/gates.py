"""The promotion gates: a candidate's evidence (and the champion's KPIs on the same data) -> pass/fail each.

In:  `PromoteParams`, the candidate `Evidence`, the champion's KPI summary on the candidate's evaluation
     data (None when there is no champion: only the absolute gates apply).
Out: `list[Gate]`, in a fixed order. Each gate has a `value`, a `threshold`, `passed` and a `margin`
     (positive: passed with room; negative: failed by that much; None for a yes/no gate) and a `detail`
     sentence that names what failed and by how much.

Gates (params.promote):
- `min_map`                   candidate mAP >= min_map                              (absolute)
- `p99_latency_ms`            p99 at batch `latency_batch`, primary artifact <= max_p99_latency_ms (absolute)
- `optimize_parity`           optimized/parity.json "passed" (when require_parity)   (absolute)
- `parity_map_delta`          |mAP(optimized) - mAP(PyTorch)| <= parity_map_tolerance (absolute)
- `map_regression`            champion mAP - candidate mAP <= max_map_regression     (vs champion)
- `class_ap_regression/<C>`   per class, champion AP - candidate AP <= max_class_ap_regression (vs champion)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pfactory.registry.evidence import Evidence
from pfactory.registry.params import PromoteParams


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


def apply_gates(
    params: PromoteParams, candidate: Evidence, champion_kpis: Mapping[str, Any] | None
) -> list[Gate]:
    """Every gate of params.promote on `candidate` (module docstring); `champion_kpis` on the same data."""
    gates = [
        _lower("min_map", candidate.kpis["mAP"], params.min_map, "mAP"),
        _upper(
            "p99_latency_ms", candidate.latency["p99_ms"], params.max_p99_latency_ms,
            f"p99 latency ({candidate.latency['artifact']}, batch {candidate.latency['batch']})", " ms",
        ),
    ]  # fmt: skip
    if params.require_parity:
        ok = bool(candidate.parity["passed"])
        why = "; ".join(candidate.parity["failures"]) or "no failures listed"
        gates.append(
            Gate(
                "optimize_parity", ok, True, ok, None,
                "optimize parity vs PyTorch: passed" if ok else f"optimize parity vs PyTorch FAILED ({why})",
            )
        )  # fmt: skip
    if candidate.delta_map is None:
        gates.append(
            Gate(
                "parity_map_delta", None, params.parity_map_tolerance, False, None,
                "|mAP(optimized) - mAP(PyTorch)|: kpis.json has no 'delta.mAP' (evaluate ran without the "
                "PyTorch reference): FAILED, cannot verify",
            )
        )  # fmt: skip
    else:
        gates.append(
            _upper(
                "parity_map_delta", abs(candidate.delta_map), params.parity_map_tolerance,
                "|mAP(optimized) - mAP(PyTorch)|",
            )
        )  # fmt: skip
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
    return gates


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
