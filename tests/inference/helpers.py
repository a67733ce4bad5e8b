"""Helpers of the inference tests: the real detector at a tiny size and inputs of the export's signature."""

from __future__ import annotations

import numpy as np
import torch

from tests.model.helpers import IMAGE_SIZE, tiny_params  # one tiny detector for both suites


def make_model(seed: int = 0):
    """The tiny detector with its output convs re-initialized to look trained.

    At init the heatmap sits at the 0.1 prior everywhere and the regressions are ~1e-3, so neighbouring
    cells nearly tie and float noise between runtimes can flip which one is a peak (a flaky parity
    test, not an export bug). Spread-out logits and O(1) regressions make peaks distinct, as after
    training.
    """
    from pfactory.model.detector import build_model

    torch.manual_seed(seed)
    model = build_model(tiny_params(), IMAGE_SIZE).eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.head.heatmap.weight, std=0.3)
        torch.nn.init.normal_(model.head.reg.weight, std=0.3)
    return model


def make_feed(model, batch: int, points: int, cameras: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Numpy inputs of the export's signature (points inside the model's range, a forward camera)."""
    from pfactory.inference.export import INPUT_NAMES, example_inputs

    return dict(zip(INPUT_NAMES, (t.numpy() for t in example_inputs(model, batch, points, cameras, seed))))
