"""The loss: it trains (overfits one batch), and its DDP normalization equals the global-batch loss."""

from __future__ import annotations

import torch

from pfactory.archs.painted_pillars.detector import build_model
from pfactory.archs.painted_pillars.loss import detection_loss
from pfactory.archs.painted_pillars.targets import build_targets

from .helpers import IMAGE_SIZE, random_batch, tiny_params


def _forward(model, b):
    return model(b["points"], b["num_points"], b["images"], b["proj"], b["cam_valid"])


def test_loss_decreases_when_overfitting_one_batch() -> None:
    p = tiny_params()
    torch.manual_seed(0)
    model = build_model(p, IMAGE_SIZE)
    b = random_batch(p, batch=2, points=1500)
    t = build_targets(b["boxes"], b["labels"], p, b["num_boxes"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        terms = detection_loss(_forward(model, b), t)
        opt.zero_grad()
        terms["loss"].backward()
        opt.step()
        losses.append(float(terms["loss"].detach()))
    assert losses[-1] < 0.3 * losses[0], losses
    assert terms["heatmap"] > 0 and terms["reg"] > 0


def test_split_batch_with_global_counts_equals_whole_batch() -> None:
    """mean over 2 'ranks' of the rescaled slice losses == loss of the whole batch (values and grads)."""
    p = tiny_params()
    torch.manual_seed(0)
    model = build_model(p, IMAGE_SIZE)
    b = random_batch(p, batch=4, boxes=9, seed=5)
    b["labels"][1, :] = -1  # one slice gets fewer objects than the other: plain averaging would differ
    whole = detection_loss(_forward(model, b), build_targets(b["boxes"], b["labels"], p, b["num_boxes"]))
    g_whole = torch.autograd.grad(whole["loss"], model.head.heatmap.weight)[0]

    slices = [{k: v[:2] for k, v in b.items()}, {k: v[2:] for k, v in b.items()}]
    targets = [build_targets(s["boxes"], s["labels"], p, s["num_boxes"]) for s in slices]
    peaks = sum(t.num_peaks for t in targets)
    objects = sum(t.num_objects for t in targets)
    parts = [
        detection_loss(_forward(model, s), t, num_peaks=peaks, num_objects=objects, world_size=2)
        for s, t in zip(slices, targets)
    ]
    mean = (parts[0]["loss"] + parts[1]["loss"]) / 2
    torch.testing.assert_close(mean, whole["loss"], rtol=1e-5, atol=1e-6)
    g_mean = torch.autograd.grad(mean, model.head.heatmap.weight)[0]
    torch.testing.assert_close(g_mean, g_whole, rtol=1e-4, atol=1e-6)
