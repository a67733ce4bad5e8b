"""Parity gates that no other test made fail (docs/OPTIMIZE.md, "Every gate can fail"): the cosines."""

from __future__ import annotations

import numpy as np

from pfactory.optimize.params import ParityParams, ParityTolerance
from pfactory.optimize.parity import compare_outputs, gate


def test_a_rescaled_output_fails_the_cosine_gates() -> None:
    """Scores and boxes with their ranking and matching intact but their shape changed (one channel of the
    head scaled): the element checks are off (null), the cosines catch it."""
    rng = np.random.default_rng(0)
    k = 20
    boxes = np.zeros((1, k, 7), dtype=np.float32)
    boxes[0, :, 0] = np.arange(k) * 3.0 + 1.0
    boxes[0, :, 3:6] = rng.uniform(1.0, 4.0, (k, 3))
    scores = np.linspace(0.95, 0.1, k, dtype=np.float32)[None]
    ref = {"boxes": boxes, "scores": scores, "labels": np.zeros((1, k), dtype=np.int64)}
    cand = {key: v.copy() for key, v in ref.items()}
    cand["scores"][0, 10:] *= 0.6  # the low half shrinks: same order, another distribution
    cand["boxes"][0, :, 3] *= 3.0  # every length tripled
    tol = ParityTolerance(min_cosine=0.999)
    failures = gate(compare_outputs([ref], [cand], ParityParams(), tol), tol)
    assert [f.split(" = ")[0] for f in failures] == ["scores.cosine", "boxes.cosine"], failures
    assert gate(compare_outputs([ref], [ref], ParityParams(), tol), tol) == []
