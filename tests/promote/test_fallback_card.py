"""When optimize shipped FP32 because INT8 failed parity (backend.json "selection"."fallback", written by the
stage: tests/tasks/test_optimize_fallback.py), the promotion says so: the `optimize_parity` gate's detail, the
result's reason (the caption of the gate table in `factory run`'s summary) and the model card."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import helpers as H

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WHY = (
    "onnxruntime/int8 failed parity (onnxruntime/int8: agreement.match_rate (score >= 0.3) = 40/60 = 0.6667: "
    "Wilson 95% upper bound 0.7727 < 0.95 (n=60)); shipping what passed: onnxruntime/fp32"
)


def test_the_model_card_and_the_reason_say_fp32_was_shipped_because_int8_failed(
    bench, tmp_path, registry
) -> None:
    import tasks.promote

    cand = H.candidate(tmp_path, bench, "fallback", 0.3)
    manifest_path = cand["optimized"] / "backend.json"
    manifest = json.loads(manifest_path.read_text())
    fallback = {"asked": "onnxruntime/int8", "refused": {"onnxruntime/int8": ["..."]},
                "shipped": ["onnxruntime/fp32"], "primary": "onnxruntime/fp32", "why": WHY}  # fmt: skip
    manifest["selection"] = {"rule": "asked: onnxruntime/int8, refused by parity: onnxruntime/fp32",
                             "fallback": fallback, "why": "primary onnxruntime/fp32 because " + WHY}  # fmt: skip
    manifest_path.write_text(json.dumps(manifest))
    result = tasks.promote.run(
        H.promote_params(), cand["optimized"], cand["eval"], bench["prepared_a"], tmp_path / "release"
    )
    assert result["decision"] == "promoted", result["reason"]
    assert result["reason"].endswith(f"; optimize shipped onnxruntime/fp32: {WHY}")
    gate = next(g for g in result["gates"] if g["name"] == "optimize_parity")
    assert gate["passed"] and WHY in gate["detail"]
    card = (tmp_path / "release" / "MODEL_CARD.md").read_text()
    assert f"**Shipped `onnxruntime/fp32` instead of the asked `onnxruntime/int8`**: {WHY}." in card
