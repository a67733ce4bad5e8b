"""Targets and decoding invert each other; the Gaussian radius follows CenterPoint."""

from __future__ import annotations

import math

import pytest
import torch

from pfactory.archs.painted_pillars.decode import decode, decode_yaw
from pfactory.archs.painted_pillars.targets import build_targets, gaussian_radius

from .helpers import random_batch, tiny_params


def _centerpoint_radius(det_size: tuple[float, float], min_overlap: float) -> float:
    """CenterPoint's `gaussian_radius` (det3d/core/utils/center_utils.py), scalar, verbatim maths."""
    height, width = det_size
    a1, b1, c1 = 1, height + width, width * height * (1 - min_overlap) / (1 + min_overlap)
    r1 = (b1 + math.sqrt(b1**2 - 4 * a1 * c1)) / 2
    a2, b2, c2 = 4, 2 * (height + width), (1 - min_overlap) * width * height
    r2 = (b2 + math.sqrt(b2**2 - 4 * a2 * c2)) / 2
    a3, b3, c3 = 4 * min_overlap, -2 * min_overlap * (height + width), (min_overlap - 1) * width * height
    r3 = (b3 + math.sqrt(b3**2 - 4 * a3 * c3)) / 2
    return min(r1, r2, r3)


@pytest.mark.parametrize(("l", "w"), [(5.6, 2.4), (1.0, 0.9), (2.2, 0.75), (30.0, 3.0)])
@pytest.mark.parametrize("overlap", [0.1, 0.5])
def test_gaussian_radius_matches_centerpoint(l: float, w: float, overlap: float) -> None:
    got = gaussian_radius(
        torch.tensor([l], dtype=torch.float64), torch.tensor([w], dtype=torch.float64), overlap
    )
    assert got.item() == pytest.approx(_centerpoint_radius((l, w), overlap), rel=1e-12)


@pytest.mark.parametrize("heading", ["axis_sign", "sincos"])
def test_targets_decode_round_trip(heading: str) -> None:
    """Encode GT boxes, decode the targets as if they were predictions: the boxes come back."""
    p = tiny_params(max_detections=64, heading=heading)
    r = len(p.reg_channels)
    b = random_batch(p, batch=3, boxes=12, seed=3)
    boxes, labels = b["boxes"], b["labels"]
    t = build_targets(boxes, labels, p, b["num_boxes"])
    bsz, k = boxes.shape[0], len(p.classes)
    h, w = p.head_grid
    assert t.heatmap.shape == (bsz, k, h, w) and t.reg.shape == (bsz, 12, r)
    # Perfect predictions: logit +20 at peaks (target 1), -20 elsewhere; regressions painted at peaks.
    logits = torch.where(t.heatmap == 1, 20.0, -20.0)  # [B, K, Ho, Wo]
    reg = torch.zeros(bsz, r, h * w)  # [B, R, Ho*Wo]
    for i in range(bsz):
        m = t.mask[i]
        reg[i][:, t.index[i][m]] = t.reg[i][m].T
    out_boxes, scores, out_labels = decode(logits, reg.view(bsz, r, h, w), p)
    for i in range(bsz):
        m = t.mask[i]
        keep = scores[i] > 0.5
        assert int(keep.sum()) == int(m.sum())  # one peak per object (objects fall in distinct cells here)
        gt = boxes[i][m]
        pred = out_boxes[i][keep]
        order_gt = torch.argsort(gt[:, 0] * 1000 + gt[:, 1])
        order_pred = torch.argsort(pred[:, 0] * 1000 + pred[:, 1])
        gt, pred = gt[order_gt], pred[order_pred]
        torch.testing.assert_close(pred[:, :6], gt[:, :6], rtol=1e-5, atol=1e-4)
        d_yaw = torch.remainder(pred[:, 6] - gt[:, 6] + math.pi, 2 * math.pi) - math.pi
        assert d_yaw.abs().max() < 1e-5
        torch.testing.assert_close(out_labels[i][keep].sort().values, labels[i][m].sort().values)


def test_masked_objects_draw_nothing() -> None:
    p = tiny_params()
    boxes = torch.tensor([[[5.0, 0.0, 0.0, 4.0, 2.0, 1.5, 0.0], [50.0, 0.0, 0.0, 4.0, 2.0, 1.5, 0.0],
                           [5.0, 3.0, 0.0, 4.0, 2.0, 1.5, 0.0]]])  # fmt: skip
    labels = torch.tensor([[0, 1, -1]])  # in range; outside the grid; not a training class
    t = build_targets(boxes, labels, p)
    assert t.mask.tolist() == [[True, False, False]]
    assert t.heatmap[0, 1].sum() == 0 and t.heatmap[0, 2].sum() == 0
    assert int(t.num_peaks) == 1
    # The peak is at floor(centre / cell): x = 5 m -> column 6 (0.8 m cells), y = 0 -> row 10.
    assert t.heatmap[0, 0, 10, 6] == 1.0
    torch.testing.assert_close(t.reg[0, 0, :2], torch.tensor([5.0 / 0.8 - 6, 0.0]))


def test_axis_sign_yaw_decodes_axis_and_direction() -> None:
    """The axis comes from the 2-yaw pair; the (sin, cos) pair only picks front or back, so a weak or
    wrong-signed direction pair flips the box by pi but never tilts its axis."""
    yaw = torch.linspace(-math.pi + 1e-3, math.pi, 37)  # [D]
    axis = torch.stack([torch.sin(2 * yaw), torch.cos(2 * yaw)])  # [2, D]
    weak = 0.2 * torch.stack([torch.sin(yaw), torch.cos(yaw)]) + 0.05  # [2, D] small, slightly off
    got = decode_yaw(torch.cat([weak, axis])[None], "axis_sign")[0]  # [D]
    d = torch.remainder(got - yaw + math.pi, 2 * math.pi) - math.pi
    assert d.abs().max() < 1e-4
    flipped = decode_yaw(torch.cat([-weak, axis])[None], "axis_sign")[0]
    d = torch.remainder(flipped - yaw, 2 * math.pi) - math.pi  # off by exactly pi
    assert d.abs().max() < 1e-4
    assert (got > -math.pi).all() and (got <= math.pi).all()
