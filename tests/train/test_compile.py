"""The training step under torch.compile: one graph (no breaks) for forward + targets + loss, and point
counts that vary batch to batch do not recompile it more than once (dynamic shapes)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from pfactory.archs.painted_pillars.detector import build_model as _build_model
from pfactory.archs.painted_pillars.loss import detection_loss
from pfactory.archs.painted_pillars.targets import build_targets
from pfactory.archs.painted_pillars.variants import for_compile
from tests.archs.painted_pillars.helpers import IMAGE_SIZE, random_batch, tiny_params


def build_model(p, image_size):
    """The model the trainer compiles: `for_compile`'s static-shape painting, the C kernels as ops."""
    return for_compile(_build_model(p, image_size))


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


@pytest.mark.full  # ~110 s of Inductor codegen (fwd + bwd, twice); compiled training is opt-in (train.compile)
def test_inductor_training_step_over_varying_point_counts_matches_eager() -> None:
    """The real backend (Inductor), forward and backward, over three point counts: one dynamic recompile
    at most, and the same loss and gradients as eager (the grid_sample backward once baked the first
    point count into a stride: `assert_size_stride` failed on the second batch)."""
    from torch._dynamo.utils import counters

    p = tiny_params()
    torch.manual_seed(0)
    model = build_model(p, IMAGE_SIZE)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(_loss_fn(model, p), fullgraph=True)
    eager = _loss_fn(model, p)
    for i, n in enumerate((300, 517, 411)):
        args = _args(random_batch(p, batch=2, points=n, seed=i))
        model.zero_grad(set_to_none=True)
        loss = step(*args)
        loss.backward()
        grads = [q.grad.clone() for q in model.parameters() if q.grad is not None]
        model.zero_grad(set_to_none=True)
        ref = eager(*args)
        ref.backward()
        refs = [q.grad for q in model.parameters() if q.grad is not None]
        torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
        assert len(grads) == len(refs)
        for g, r in zip(grads, refs):  # float rounding apart (fused kernels, the gather sampler), per tensor
            assert (g - r).norm() <= 1e-3 * r.norm() + 1e-6, ((g - r).norm(), r.norm())
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
