"""The promotion's INT8 evidence on real artifacts of a trained detector: the KPI deltas (mAP, class AP@2m,
range buckets: the KPI library against the frames' ground truth, as the evaluate stage computes them) and
the confident-detection agreement pass for the sensitivity-built INT8 model at 1 and 2 threads and fail
for a genuinely worse one (calibrated on blank frames, or on frames with un-normalized images)."""

from __future__ import annotations

import pytest
import torch

from pfactory.detectors.inference import frames_from_batch
from pfactory.evaluate.report import kpi_delta
from pfactory.metrics import evaluate_detections
from pfactory.optimize.params import ParityParams
from pfactory.optimize.parity import compare_outputs, parity_report
from pfactory.optimize.runtime import OrtRunner
from pfactory.promote.evidence import Evidence, agreement_summary, delta_summary, kpi_summary
from pfactory.promote.gates import apply_gates
from pfactory.promote.params import PromoteParams

CLASSES = ["Car", "Pedestrian", "Cyclist"]


@pytest.fixture
def bench(int8_bench):
    return int8_bench


def _kpis(batches, outputs) -> dict:
    gts, preds = [], []
    for b, out in zip(batches, outputs):
        g, p = frames_from_batch(
            b, *(torch.from_numpy(out[k]) for k in ("boxes", "scores", "labels")), CLASSES, 0.05
        )
        gts += g
        preds += p
    return evaluate_detections(gts, preds).metrics


def _evidence(batches, reference, candidate) -> Evidence:
    ref, cand = _kpis(batches, reference), _kpis(batches, candidate)
    doc = {**cand, "delta": kpi_delta(cand, ref)}
    params = ParityParams()
    metrics = compare_outputs(reference, candidate, params, params.int8)
    report = parity_report(
        {"onnxruntime/int8": {"precision": "int8", "metrics": metrics}}, params,
        [f"f{i}" for i in range(len(reference))], reference="pytorch eager (cpu)",
    )  # fmt: skip
    return Evidence(
        kpis=kpi_summary(doc, "test"), data={"prepared_hash": "x", "split": "val"}, delta_map=doc["delta"]["mAP"],
        parity={"passed": report["passed"], "failures": [], "worst": {}, "artifacts": ["onnxruntime/int8"]},
        latency={"artifact": "onnxruntime/int8", "batch": 1, "p50_ms": 1.0, "p99_ms": 1.0},
        backend={"primary": "onnxruntime/int8", "manifest_sha256": "x"},
        delta=delta_summary(doc["delta"], "test"), agreement=agreement_summary(report, "onnxruntime/int8", "test"),
    )  # fmt: skip


def _parity_gates(bench, name: str, threads: int) -> dict:
    arts, tiny, reference = bench
    runner = OrtRunner(arts[name], "int8", intra_op_threads=threads)
    ev = _evidence(tiny["held_out_batches"], reference, [runner.run(f) for f in tiny["held_out"]])
    return {g.name: g for g in apply_gates(PromoteParams(), ev, None) if g.name.startswith("parity_")}


@pytest.mark.parametrize("threads", [1, 2])
def test_good_int8_passes_every_parity_gate(bench, threads) -> None:
    gates = _parity_gates(bench, "good", threads)
    assert {"parity_map_delta", "parity_agreement", "parity_scores_p99"} <= set(gates)
    assert {f"parity_class_ap_delta/{c}" for c in CLASSES} <= set(gates)
    assert any(n.startswith("parity_range_map_delta/") for n in gates)
    assert all(g.passed for g in gates.values()), [g.detail for g in gates.values() if not g.passed]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bad", ["wrong_calibration", "raw_images"])
def test_worse_int8_fails_the_kpi_delta_and_agreement_gates(bench, bad, threads) -> None:
    gates = _parity_gates(bench, bad, threads)
    failed = {n for n, g in gates.items() if not g.passed}
    kpi = {
        n
        for n in failed
        if n.startswith(("parity_map_delta", "parity_class_ap_delta/", "parity_range_map_delta/"))
    }
    assert kpi, {n: g.detail for n, g in gates.items()}
    assert failed & {"parity_agreement", "parity_scores_p99"}, failed
