"""The INT8 parity gate on real artifacts of a trained detector: the sensitivity-built INT8 model passes
at 1 and 2 threads; a genuinely worse one (calibrated on blank frames, or on frames with un-normalized images) fails,
naming the agreement metric. The promotion's KPI-delta gates on the
same artifacts: tests/promote/test_int8_promotion.py."""

from __future__ import annotations

import pytest

from pfactory.optimize.params import ParityParams
from pfactory.optimize.parity import compare_outputs, gate
from pfactory.optimize.runtime import OrtRunner


@pytest.fixture
def bench(int8_bench):
    arts, tiny, reference = int8_bench
    return arts, tiny["held_out"], reference


def _metrics(path, feeds, reference, threads):
    runner = OrtRunner(path, "int8", intra_op_threads=threads)
    first = [runner.run(f) for f in feeds]
    tol = ParityParams().int8
    return compare_outputs(reference, first, ParityParams(), tol, repeat=[runner.run(f) for f in feeds]), tol


def test_the_profile_quantizes_most_of_the_trained_model(bench) -> None:
    arts = bench[0]
    report = arts["report"]
    assert report["met"] and len(report["quantized"]) > len(report["kept_float"]), report[
        "kept_float_modules"
    ]


@pytest.mark.parametrize("threads", [1, 2])
def test_the_sensitivity_built_int8_model_passes_the_int8_gate(bench, threads) -> None:
    arts, feeds, reference = bench
    m, tol = _metrics(arts["good"], feeds, reference, threads)
    assert m["agreement"]["reference_detections"] >= 30, "too few confident detections to test anything"
    assert gate(m, tol) == [], m["agreement"]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bad", ["wrong_calibration", "raw_images"])
def test_a_genuinely_worse_int8_model_fails_it(bench, bad, threads) -> None:
    arts, feeds, reference = bench
    m, tol = _metrics(arts[bad], feeds, reference, threads)
    failures = gate(m, tol)
    assert failures and all(f.startswith("agreement.") for f in failures), (failures, m["agreement"])
