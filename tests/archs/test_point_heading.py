"""The `centerpoint_lidar` point heading (pfactory/archs/centerpoint_lidar/point_heading.py): the gather
against brute force, rotation equivariance, the circular-mean decode, the training views' round trip, that it
learns a heading from a cue smaller than a pillar, and that it exports to ONNX Runtime."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pfactory.archs.centerpoint_lidar.params import CenterPointLidarParams
from pfactory.archs.centerpoint_lidar.point_heading import (
    PointHeading,
    heading_from_logits,
    near_square,
    point_heading_loss,
    training_views,
    turn_by,
)
from tests.archs.test_refine import _mirrored, _scene


def _wrap(a: torch.Tensor) -> torch.Tensor:
    return torch.atan2(torch.sin(a), torch.cos(a))


def test_gather_keeps_the_nearest_points_within_the_radius() -> None:
    """The gathered rows are the frame's points within max(l, w) / 2 + margin of the box's BEV centre (all
    of them when fewer than K), never a padding row; a frame with fewer points than K works."""
    p = CenterPointLidarParams(refine_points=32, refine_margin_m=0.25)
    head = PointHeading(p)
    rng = np.random.default_rng(0)
    pts = torch.tensor(rng.uniform([-1, -1, -2, 0], [1, 1, 0, 1], (1, 60, 4)), dtype=torch.float32)
    pts[0, 50:, :2] = 0.0  # padding rows at the box centre: nearest of all, and never gathered
    num = torch.tensor([50])
    boxes = torch.tensor([[[0.1, -0.2, -1.0, 0.6, 0.5, 1.7, 0.3], [0.0, 0.0, -1.0, 4.0, 1.8, 1.5, 0.0]]])
    got, inside = head.gather(pts, num, boxes)
    assert got.shape == (1, 2, 32, 4)
    for d, radius in ((0, 0.55), (1, 2.25)):
        dist = torch.linalg.norm(pts[0, :50, :2] - boxes[0, d, :2], dim=-1)
        want = sorted(map(tuple, pts[0, :50][dist < radius].tolist()))[:32]
        found = sorted(map(tuple, got[0, d][inside[0, d]].tolist()))
        if (dist < radius).sum() <= 32:
            assert found == want
        else:  # more than K inside: the K nearest
            assert len(found) == 32 and all(
                torch.linalg.norm(torch.tensor(f[:2]) - boxes[0, d, :2]) < radius for f in found
            )
    few, inside_few = head.gather(pts[:, :5], torch.tensor([5]), boxes)
    assert int(inside_few[0, 1].sum()) == 5 and few.shape == (1, 2, 32, 4)


def test_logits_turn_with_the_scene() -> None:
    """The whole scene turned about the sensor (points, box centre and yaw) gives the same candidate logits:
    the moments turn exactly and the sensor direction with them, so what is learned for one heading holds
    for every heading."""
    torch.manual_seed(0)
    head = PointHeading(CenterPointLidarParams())
    pts, num, boxes = _scene(np.random.default_rng(3), 4)
    with torch.no_grad():
        ref = head(pts, num, boxes)
        for alpha in (0.4, 2.0, -2.9):
            c, s = math.cos(alpha), math.sin(alpha)
            rot = torch.tensor([[c, -s], [s, c]])
            p2, b2 = pts.clone(), boxes.clone()
            p2[..., :2] = pts[..., :2] @ rot.T
            b2[..., :2] = boxes[..., :2] @ rot.T
            b2[..., 6] = boxes[..., 6] + alpha
            torch.testing.assert_close(head(p2, num, b2), ref, atol=2e-4, rtol=1e-4)


def test_heading_from_logits_is_the_candidates_circular_mean() -> None:
    """A confident candidate j gives yaw + j * 2 pi / N; two equal neighbours give their midpoint; a small
    change of the logits moves the heading a little (no arg-max jump)."""
    n = 16
    yaw = torch.tensor([[0.3, -3.0]])
    logits = torch.full((1, 2, n), -30.0)
    logits[0, 0, 5] = 30.0
    logits[0, 1, 3] = logits[0, 1, 4] = 30.0
    out = heading_from_logits(yaw, logits)
    step = 2 * math.pi / n
    assert abs(float(_wrap(out[0, 0] - (0.3 + 5 * step)))) < 1e-5
    assert abs(float(_wrap(out[0, 1] - (-3.0 + 3.5 * step)))) < 1e-5
    soft = torch.randn(1, 2, n)
    nudged = soft.clone()
    nudged[0, :, 7] += 1e-3
    assert float(_wrap(heading_from_logits(yaw, nudged) - heading_from_logits(yaw, soft)).abs().max()) < 1e-2


def test_turn_by_swaps_length_and_width_near_a_quarter_turn() -> None:
    boxes = torch.tensor([[[0.0, 0.0, 0.0, 0.8, 0.6, 1.7, 0.1]] * 3])
    out = turn_by(boxes, torch.tensor([[0.2, 0.1 + math.pi / 2, 0.1 + math.pi]]))
    assert out[0, :, 3].tolist() == pytest.approx([0.8, 0.6, 0.8])
    assert out[0, :, 6].tolist() == pytest.approx([0.2, 0.1 + math.pi / 2, 0.1 + math.pi])
    person, bike = [0, 0, 0, 0.7, 0.6, 1.7, 0], [0, 0, 0, 1.8, 0.6, 1.7, 0]
    assert near_square(torch.tensor([person, bike]), 1.5).tolist() == [True, False]


def test_training_views_round_trip() -> None:
    """Each view's yaw plus its target candidate is the true yaw to half a candidate; the views' headings
    spread over the circle."""
    p = CenterPointLidarParams(refine_jitter_m=0.0)
    boxes = torch.tensor([[[3.0 + i, 1.0 - 0.3 * i, -1.0, 0.7, 0.6, 1.7, 0.5 * i - 2] for i in range(8)]])
    views, target = training_views(boxes, p)
    n = p.refine_point_bins
    back = views[..., 6] + target * (2 * math.pi / n)
    want = boxes[..., 6].repeat(1, p.refine_point_views)
    assert float(_wrap(back - want).abs().max()) <= math.pi / n + 1e-5
    assert len(set(target.flatten().tolist())) >= n // 2


def _train(head: PointHeading, p: CenterPointLidarParams, steps: int) -> None:
    pts, num, boxes = _scene(np.random.default_rng(0), 64)
    mask = torch.ones(64, 1, dtype=torch.bool)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        ce, n = point_heading_loss(head, pts, num, boxes, mask, p)
        (ce / n).backward()
        opt.step()


def test_it_learns_the_heading_from_a_cue_below_a_pillar() -> None:
    """Trained on 64 frames (a person whose face, 12 cm ahead of the axis, is the only front/back cue),
    the heading of 32 held-out people from a random first-stage yaw is within 0.35 rad on average; with
    the points mirrored front to back it cannot be (>= 1.0 rad: a guess is pi / 2 on average)."""
    torch.manual_seed(0)
    p = CenterPointLidarParams(refine_jitter_m=0.05)
    head = PointHeading(p)
    _train(head, p, 150)
    vp, vn, vb = _scene(np.random.default_rng(1), 32)
    start = vb.clone()
    start[..., 6] = torch.tensor(
        np.random.default_rng(2).uniform(-math.pi, math.pi, (32, 1)), dtype=torch.float32
    )

    def error(points: torch.Tensor, num: torch.Tensor) -> float:
        with torch.no_grad():
            yaw = heading_from_logits(start[..., 6], head(points, num, start))
        return float(_wrap(yaw - vb[..., 6]).abs().mean())

    assert error(vp, vn) <= 0.35
    mirrored, num = _mirrored(vp, vb)
    assert error(mirrored, num) >= 1.0


def test_exports_to_onnx_runtime_and_matches(tmp_path) -> None:
    """The head's logits through torch.onnx and ONNX Runtime equal PyTorch's, for a frame with fewer points
    than K and one with more."""
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    head = PointHeading(CenterPointLidarParams()).eval()
    pts, num, boxes = _scene(np.random.default_rng(5), 2)
    path = tmp_path / "head.onnx"
    torch.onnx.export(
        head, (pts, num, boxes), str(path), input_names=["points", "num_points", "boxes"], output_names=["logits"],
        dynamic_axes={"points": {1: "P"}}, opset_version=18, dynamo=False,
    )  # fmt: skip
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n_pts in (100, pts.shape[1]):
        p = pts[:, :n_pts].contiguous()
        n = torch.clamp(num, max=n_pts)
        with torch.no_grad():
            want = head(p, n, boxes).numpy()
        got = session.run(None, {"points": p.numpy(), "num_points": n.numpy(), "boxes": boxes.numpy()})[0]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
