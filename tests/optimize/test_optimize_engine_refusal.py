"""The optimize stage acts on a TensorRT engine's self-check: a failed engine is refused before parity, its
plan file deleted, recorded like a parity refusal (parity.json "refused", the fallback record, backend.json
"selection"), and the next artifact that passed (ONNX Runtime FP32) becomes the primary.

TensorRT cannot be installed here: the verdicts are real ones of `tensorrt_backend.verify_engine` on the
stand-in engines of tests/optimize/test_tensorrt_selfcheck.py (an ONNX Runtime session of the tiny
detector's graph, and of the same graph with the heatmap weights shifted), recorded in the manifest entry
the way `build_engine` records them (`selfcheck_record`). The parity report is a real one of the ONNX
Runtime FP32 artifact vs PyTorch on the same frames.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels import selfcheck
from pfactory.optimize.params import ParityParams
from pfactory.optimize.parity import compare_outputs, parity_report
from pfactory.optimize.runtime import OrtRunner, TorchRunner
from pfactory.optimize.stage import _fallback, _fallback_primary, _flat_metrics, refuse_failed_engine
from pfactory.optimize.tensorrt_backend import selfcheck_failure, selfcheck_record, verify_engine

from .test_tensorrt_selfcheck import STAND_IN, _feeds, _optimized_dir


def _engine_entry(tmp_path: Path, exported, fp32_model, tiny_model, wrong: bool) -> tuple[Path, dict]:
    """An optimized directory with a stand-in engine and the engine's manifest entry as `build_engine` and
    `optimize._build_tensorrt` write it, holding the real verdict of its self-check."""
    root = tmp_path / ("wrong" if wrong else "right")
    plan = _optimized_dir(root, exported, fp32_model, wrong=wrong)
    verdict = verify_engine(
        plan, root / "model.onnx", "fp32", "cpu", _feeds(tiny_model),
        engine=lambda: OrtRunner(plan, "fp32", "cpu"), version=STAND_IN, device_types=("cpu",),
    )  # fmt: skip
    entry = {"file": "tensorrt/model.fp32.plan", "backend": "tensorrt", "precision": "fp32",
             "selfcheck": selfcheck_record(verdict)}  # fmt: skip
    return root, entry


def _parity_of_ort_fp32(root: Path, tiny_model) -> dict:
    """parity.json of the directory's ONNX Runtime FP32 artifact vs PyTorch eager (default gates)."""
    params = ParityParams()
    feeds = _feeds(tiny_model)
    reference = [TorchRunner(tiny_model).run(f) for f in feeds]
    runner = OrtRunner(root / "onnxruntime" / "model.fp32.onnx", "fp32", "cpu")
    first = [runner.run(f) for f in feeds]
    second = [runner.run(f) for f in feeds]
    metrics = compare_outputs(reference, first, params, params.fp32, repeat=second)
    return parity_report(
        {"onnxruntime/fp32": {"precision": "fp32", "metrics": metrics}},
        params,
        ["a", "b"],
        "pytorch eager (cpu)",
    )


@pytest.mark.usefixtures("selfcheck_store")
def test_an_engine_that_failed_its_selfcheck_is_refused_and_fp32_ships(
    tmp_path, exported, fp32_model, tiny_model
) -> None:
    root, entry = _engine_entry(tmp_path, exported, fp32_model, tiny_model, wrong=True)
    assert entry["selfcheck"]["status"] == selfcheck.FAILED
    refused = refuse_failed_engine(entry, root)
    assert not (root / entry["file"]).exists()  # the untrusted engine is not shipped
    assert list(refused) == ["tensorrt/fp32"] and refused["tensorrt/fp32"]["passed"] is False
    why = refused["tensorrt/fp32"]["failures"][0]
    assert why.startswith("self-check vs ONNX Runtime FP32 failed: fp32 scores: max|err| ")
    assert refused["tensorrt/fp32"]["selfcheck"] == entry["selfcheck"]

    report = _parity_of_ort_fp32(root, tiny_model)
    assert report["passed"], report["artifacts"]["onnxruntime/fp32"]["failures"]
    fallback = _fallback(report, "tensorrt/fp32", refused)
    assert fallback is not None and fallback["refused"] == {"tensorrt/fp32": [why]}
    assert fallback["shipped"] == ["onnxruntime/fp32"] and fallback["asked"] == "tensorrt/fp32"
    assert fallback["why"].startswith("tensorrt/fp32 refused before parity (tensorrt/fp32: self-check vs ")
    assert fallback["why"].endswith("; shipping what passed: onnxruntime/fp32")
    assert report["passed"] and set(report["refused"]) == {"tensorrt/fp32"}
    assert set(report["artifacts"]) == {"onnxruntime/fp32"}
    primary, selection = _fallback_primary(
        {"backend": "tensorrt", "precision": "fp32"}, {"rule": "asked: tensorrt/fp32"}, fallback, False
    )
    assert primary == {"backend": "onnxruntime", "precision": "fp32"}
    assert selection["rule"] == "asked: tensorrt/fp32, refused by its self-check: onnxruntime/fp32"
    assert selection["why"].startswith("primary onnxruntime/fp32 because tensorrt/fp32 refused before parity")
    assert fallback["primary"] == "onnxruntime/fp32"
    metrics = _flat_metrics(report, None, {})  # MLflow scalars: the refused engine has no parity metrics
    assert metrics["parity/tensorrt_fp32/passed"] == 0.0 and metrics["parity/onnxruntime_fp32/passed"] == 1.0


@pytest.mark.usefixtures("selfcheck_store")
def test_a_verified_engine_stays_and_no_fallback_is_made(tmp_path, exported, fp32_model, tiny_model) -> None:
    root, entry = _engine_entry(tmp_path, exported, fp32_model, tiny_model, wrong=False)
    assert entry["selfcheck"]["status"] == selfcheck.VERIFIED and selfcheck_failure(entry) is None
    assert refuse_failed_engine(entry, root) == {}
    assert (root / entry["file"]).is_file()
    report = _parity_of_ort_fp32(root, tiny_model)
    assert _fallback(report, "tensorrt/fp32", {}) is None and "refused" not in report


def test_a_skipped_check_keeps_the_engine(tmp_path) -> None:
    """No CUDA check could run (skipped): the engine stays; the parity gate still judges it."""
    root = tmp_path / "opt"
    (root / "tensorrt").mkdir(parents=True)
    (root / "tensorrt" / "model.fp16.plan").write_bytes(b"plan")
    check = {"path": "tensorrt.engine", "status": selfcheck.SKIPPED, "reason": "no CUDA device here"}
    entry = {
        "file": "tensorrt/model.fp16.plan",
        "backend": "tensorrt",
        "precision": "fp16",
        "selfcheck": check,
    }
    assert refuse_failed_engine(entry, root) == {} and (root / entry["file"]).is_file()


@pytest.mark.usefixtures("selfcheck_store")
def test_a_refused_engine_with_a_failing_export_ships_nothing(
    tmp_path, exported, fp32_model, tiny_model
) -> None:
    """The engine refused and the ONNX Runtime FP32 artifact (the export's own evidence) outside its gate:
    no fallback (the stage raises ParityError)."""
    root, entry = _engine_entry(tmp_path, exported, fp32_model, tiny_model, wrong=True)
    refused = refuse_failed_engine(entry, root)
    report = _parity_of_ort_fp32(root, tiny_model)
    fp32 = report["artifacts"]["onnxruntime/fp32"]
    fp32["passed"], fp32["failures"] = False, ["scores: planted failure"]
    report["passed"] = False
    assert _fallback(report, "tensorrt/fp32", refused) is None and "refused" not in report
