"""The training step under torch.compile: one graph (no breaks) for forward + targets + loss, and point
counts that vary batch to batch do not recompile it more than once (dynamic shapes)."""

from __future__ import annotations

import torch
import torch._dynamo

from pfactory.model.detector import build_model
from pfactory.model.loss import detection_loss
from pfactory.model.targets import build_targets
from tests.model.helpers import IMAGE_SIZE, random_batch, tiny_params


def _loss_fn(model: torch.nn.Module, p):
    def loss(points, num_points, images, proj, cam_valid, boxes, labels, num_boxes):
        out = model(points, num_points, images, proj, cam_valid)
        targets = build_targets(boxes, labels, p, num_boxes)
        return detection_loss(out, targets)["loss"]

    return loss


def _args(b: dict) -> tuple:
    keys = ("points", "num_points", "images", "proj", "cam_valid", "boxes", "labels", "num_boxes")
    return tuple(b[k] for k in keys)


def test_training_forward_and_loss_have_no_graph_break() -> None:
    p = tiny_params()
    torch.manual_seed(0)
    fn = _loss_fn(build_model(p, IMAGE_SIZE), p)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*_args(random_batch(p, batch=2, points=300)))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_varying_point_counts_compile_at_most_twice() -> None:
    from torch._dynamo.utils import counters

    p = tiny_params()
    torch.manual_seed(0)
    model = build_model(p, IMAGE_SIZE)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(_loss_fn(model, p), backend="eager", fullgraph=True)  # automatic dynamic shapes
    for i, n in enumerate((300, 517, 411, 640, 333)):  # an epoch's worth of different padded sizes
        loss = step(*_args(random_batch(p, batch=2, points=n, seed=i)))
        loss.backward()
        assert torch.isfinite(loss)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
