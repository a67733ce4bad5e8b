"""MODEL_CARD.md (`release.model_card`): the exact text for a release that uses every section (NDS, the
PyTorch delta, mAP by range, a fallback, a plugin architecture, gates, lineage, files, audit) and for a
minimal one (no gates, no previous champion, a built-in architecture, no audit). The expected texts are the
card as it was written before `model_card` was split into its sections: the card is a DVC out, so its bytes
for the same release must not move."""

from __future__ import annotations

import copy

from pfactory.promote.release import model_card

FULL = {
    "model": "pf-detector", "version": 7, "alias": "champion", "action": "promote",
    "reason": "all 9 gates passed vs champion v6", "at": "2025-01-02T03:04:05Z", "by": "alice@host",
    "from": 6, "audit_id": 4,
    "gates": [
        {"name": "min_map", "value": 0.51234, "threshold": 0.3, "margin": 0.21234, "passed": True,
         "detail": "x"},
        {"name": "latency_ratio", "value": 1.3, "threshold": 1.25, "margin": -0.05, "passed": False,
         "detail": "y"},
        {"name": "parity", "value": True, "threshold": None, "margin": None, "passed": True, "detail": "z"},
    ],
    "intended_use": "Research only; BEV 3D detection on synthetic lidar.",
    "kpis": {"mAP": 0.512345, "NDS": 0.6, "classes": {
        "Car": {"mean_ap": 0.7, "ap": {"0.5": 0.6, "1.0": 0.7, "2.0": 0.75, "4.0": 0.8},
                "ate": 0.2, "ase": 0.1, "aoe": 0.3},
        "Pedestrian": {"mean_ap": 0.4, "ap": {"0.5": 0.3, "1.0": 0.4, "2.0": 0.45}, "ate": None},
    }},
    "evidence": {
        "data": {"prepared_hash": "abc123def456", "split": "val", "frames": 40},
        "delta_map": -0.00123,
        "parity": {"passed": True, "artifacts": ["onnx/fp32", "trt/fp16"],
                   "worst": {"max_abs": 0.001, "cos": 0.9999}},
        "latency": {"artifact": "trt/fp16", "batch": 1, "p50_ms": 3.21, "p99_ms": 4.56},
        "backend": {"arch": "painted_pillars", "plugin": {"source": "pf-plugin 1.0", "files_sha256": "ffee"},
                    "weights_sha256": "w123", "manifest_sha256": "m456",
                    "selection": {"fallback": {"asked": "trt/int8", "primary": "trt/fp16",
                                               "why": "parity failed"}}},
        "by_range_mAP": {"0-20": 0.6, "20-40": 0.5},
    },
    "lineage": {"run_id": "r1", "git_commit": "deadbeef", "git_dirty": "False",
                "prepared": {"md5": "p1", "frames": "40"}},
    "files": {"kpis.json": "h1", "optimized/backend.json": "h2"},
}  # fmt: skip
AUDIT = [
    {"id": 1, "at": "t1", "by": "a", "action": "promote", "from": None, "to": 1, "reason": "first"},
    {"id": 2, "at": "t2", "by": "b", "action": "rollback", "from": 2, "to": 1, "reason": "undo"},
]


def _minimal() -> dict:
    """FULL without gates, previous champion, intended use, NDS, delta, by-range, fallback, plugin or
    lineage."""
    r = copy.deepcopy(FULL)
    r.update({"from": None, "gates": []})
    del r["intended_use"]
    r["kpis"] = {"mAP": 0.3, "classes": {"Car": {"mean_ap": 0.3, "ap": {"1.0": 0.3}}}}
    r["evidence"] = {
        "data": {"prepared_hash": "abc", "split": "test"},
        "delta_map": None,
        "parity": {"passed": False, "artifacts": ["onnx/fp32"], "worst": {}},
        "latency": {"artifact": "onnx/fp32", "batch": 1, "p50_ms": 10, "p99_ms": 12},
        "backend": {"manifest_sha256": "m"},
        "by_range_mAP": {},
    }
    r["lineage"] = {}
    return r


EXPECTED_FULL = (
    "# pf-detector v7 (`champion`)\n"
    "\n"
    "Promoted 2025-01-02T03:04:05Z by alice@host (promote): all 9 gates passed vs champion v6\n"
    "\n"
    "## Intended use\n"
    "\n"
    "Research only; BEV 3D detection on synthetic lidar.\n"
    "\n"
    "## KPIs\n"
    "\n"
    "Evaluation data: prepared hash `abc123def456`, split `val`, 40 frames. nuScenes-style AP over BEV "
    "centre-distance thresholds (docs/KPIS.md).\n"
    "\n"
    "mAP **0.5123**, NDS **0.6**; optimized - PyTorch mAP delta -0.00123\n"
    "\n"
    "| class | AP (mean) | AP@0.5 m | AP@1.0 m | AP@2.0 m | AP@4.0 m | ATE | ASE | AOE |\n"
    "|---|---|---|---|---|---|---|---|---|\n"
    "| Car | 0.7 | 0.6 | 0.7 | 0.75 | 0.8 | 0.2 | 0.1 | 0.3 |\n"
    "| Pedestrian | 0.4 | 0.3 | 0.4 | 0.45 | None | None | None | None |\n"
    "\n"
    "mAP by range: 0-20 m 0.6, 20-40 m 0.5\n"
    "\n"
    "## Optimized artifact\n"
    "\n"
    "Primary artifact `trt/fp16`: latency batch 1 p50 3.21 ms, p99 4.56 ms. Parity vs PyTorch: passed "
    "(onnx/fp32, trt/fp16); worst: cos 0.9999, max_abs 0.001\n"
    "\n"
    "**Shipped `trt/fp16` instead of the asked `trt/int8`**: parity failed.\n"
    "\n"
    "## Gates\n"
    "\n"
    "| gate | value | threshold | margin | result |\n"
    "|---|---|---|---|---|\n"
    "| min_map | 0.5123 | 0.3 | 0.2123 | pass |\n"
    "| latency_ratio | 1.3 | 1.25 | -0.05 | FAIL |\n"
    "| parity | True | None | None | pass |\n"
    "\n"
    "## Lineage\n"
    "\n"
    "- registry: `models:/pf-detector/7` (alias `champion`), previous champion: 6\n"
    "- architecture: `painted_pillars` (plugin pf-plugin 1.0, files sha256 `ffee`)\n"
    "- MLflow run: `r1`\n"
    "- git commit: `deadbeef` (dirty: False)\n"
    "- data: prepared `abc123def456`, frames `40`, md5 `p1`\n"
    "- model weights sha256: `w123`; backend.json sha256 `m456`\n"
    "\n"
    "## Files\n"
    "\n"
    "- `kpis.json` sha256 `h1`\n"
    "- `optimized/backend.json` sha256 `h2`\n"
    "\n"
    "## Audit trail\n"
    "\n"
    "| id | when | by | action | from | to | reason |\n"
    "|---|---|---|---|---|---|---|\n"
    "| 1 | t1 | a | promote | None | 1 | first |\n"
    "| 2 | t2 | b | rollback | 2 | 1 | undo |\n"
    ""
)

EXPECTED_MINIMAL = (
    "# pf-detector v7 (`champion`)\n"
    "\n"
    "Promoted 2025-01-02T03:04:05Z by alice@host (promote): all 9 gates passed vs champion v6\n"
    "\n"
    "## Intended use\n"
    "\n"
    "\n"
    "\n"
    "## KPIs\n"
    "\n"
    "Evaluation data: prepared hash `abc`, split `test`. nuScenes-style AP over BEV centre-distance "
    "thresholds (docs/KPIS.md).\n"
    "\n"
    "mAP **0.3**\n"
    "\n"
    "| class | AP (mean) | AP@1.0 m | ATE | ASE | AOE |\n"
    "|---|---|---|---|---|---|\n"
    "| Car | 0.3 | 0.3 | None | None | None |\n"
    "\n"
    "## Optimized artifact\n"
    "\n"
    "Primary artifact `onnx/fp32`: latency batch 1 p50 10 ms, p99 12 ms. Parity vs PyTorch: FAILED "
    "(onnx/fp32); worst: \n"
    "\n"
    "## Gates\n"
    "\n"
    "| gate | value | threshold | margin | result |\n"
    "|---|---|---|---|---|\n"
    "| (none: this release was not gated, see the reason above) | | | | |\n"
    "\n"
    "## Lineage\n"
    "\n"
    "- registry: `models:/pf-detector/7` (alias `champion`), previous champion: none\n"
    "- architecture: `painted_pillars` (built-in)\n"
    "- MLflow run: `None`\n"
    "- git commit: `None` (dirty: None)\n"
    "- data: prepared `abc`\n"
    "- model weights sha256: `None`; backend.json sha256 `m`\n"
    "\n"
    "## Files\n"
    "\n"
    "- `kpis.json` sha256 `h1`\n"
    "- `optimized/backend.json` sha256 `h2`\n"
    "\n"
    "## Audit trail\n"
    "\n"
    "| id | when | by | action | from | to | reason |\n"
    "|---|---|---|---|---|---|---|\n"
    ""
)


def test_a_card_with_every_section_is_the_same_text() -> None:
    assert model_card(FULL, AUDIT) == EXPECTED_FULL


def test_a_minimal_card_is_the_same_text() -> None:
    assert model_card(_minimal(), []) == EXPECTED_MINIMAL
