"""Gates that no other test made fail (docs/PROMOTE.md, "Every gate can fail"): a range bucket's KPI delta."""

from __future__ import annotations

import json
import shutil

from pfactory.promote.evidence import read_evidence
from pfactory.promote.gates import apply_gates, failed

from .helpers import promote_params, write_eval


def test_a_range_bucket_that_lost_accuracy_fails_its_gate(bench, tmp_path) -> None:
    """The optimized artifact is 5 mAP points worse than PyTorch in one range bucket only; its classes there
    moved by nothing (no flipped detection to forgive): the bucket's gate fails, the others pass."""
    optimized = tmp_path / "optimized"
    shutil.copytree(bench["optimized"], optimized)
    doc = write_eval(tmp_path / "eval", bench["prepared_a"], 0.3)  # delta 0 everywhere: the same predictions
    bucket = sorted(doc["delta"]["by_range"])[0]
    entry = doc["delta"]["by_range"][bucket]
    entry["mAP"] = -0.05
    for c in entry.get("classes", {}).values():
        c["mean_ap"] = 0.0
    (tmp_path / "eval" / "kpis.json").write_text(json.dumps(doc))
    gates = apply_gates(promote_params(), read_evidence(optimized, tmp_path / "eval" / "kpis.json"), None)
    (bad,) = failed(gates)
    assert bad.name == f"parity_range_map_delta/{bucket}" and bad.value == 0.05 and bad.threshold == 0.015
    assert f"range {bucket} m |mAP(optimized) - mAP(PyTorch)| 0.05 <= 0.015: FAILED by 0.035" == bad.detail
