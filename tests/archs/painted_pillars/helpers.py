"""Small synthetic inputs for the model tests (a tiny grid so every test runs in well under a second)."""

from __future__ import annotations

import torch

from pfactory.archs.painted_pillars.params import ModelParams

IMAGE_SIZE = (64, 32)  # (Wi, Hi) of the model-input images in these tests


def tiny_params(**over) -> ModelParams:
    """A 16 m x 16 m grid of 0.4 m pillars (40 x 40), narrow channels."""
    base = dict(
        pc_range=[0.0, -8.0, -3.0, 16.0, 8.0, 1.0],
        pillar_size_m=0.4,
        image_channels=8,
        point_channels=16,
        bev_channels=[16, 16, 32],
        up_channels=16,
        head_channels=16,
        max_detections=20,
    )
    base.update(over)
    return ModelParams(**base)


def camera_proj(
    batch: int, cams: int, image_size: tuple[int, int] = IMAGE_SIZE, f: float = 30.0
) -> torch.Tensor:
    """[B, N, 3, 4] forward-looking pinhole cameras at the lidar origin (cam z = lidar x)."""
    wi, hi = image_size
    K = torch.tensor([[f, 0.0, wi / 2 - 0.5], [0.0, f, hi / 2 - 0.5], [0.0, 0.0, 1.0]])
    T = torch.tensor([[0.0, -1.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # cam <- lidar
    return (K @ T).expand(batch, cams, 3, 4).contiguous()


def random_batch(
    p: ModelParams, batch: int = 2, points: int = 500, cams: int = 1, boxes: int = 6, seed: int = 0
):
    """A padded batch like the loader's: points, num_points, images, proj, cam_valid, boxes, labels."""
    g = torch.Generator().manual_seed(seed)
    x0, y0, z0, x1, y1, z1 = p.pc_range
    pts = torch.rand(batch, points, 4, generator=g)  # [B, P, 4]
    pts[..., 0] = x0 + pts[..., 0] * (x1 - x0)
    pts[..., 1] = y0 + pts[..., 1] * (y1 - y0)
    pts[..., 2] = z0 + pts[..., 2] * (z1 - z0)
    num = torch.tensor([points - 37 * i for i in range(batch)])  # [B] ragged
    wi, hi = IMAGE_SIZE
    images = torch.randn(batch, cams, 3, hi, wi, generator=g)  # [B, N, 3, Hi, Wi]
    bx = torch.zeros(batch, boxes, 7)  # [B, M, 7]
    bx[..., 0] = x0 + 1 + torch.rand(batch, boxes, generator=g) * (x1 - x0 - 2)
    bx[..., 1] = y0 + 1 + torch.rand(batch, boxes, generator=g) * (y1 - y0 - 2)
    bx[..., 2] = -1.0 + torch.rand(batch, boxes, generator=g)
    bx[..., 3:6] = torch.tensor([4.0, 1.8, 1.5]) * (0.5 + torch.rand(batch, boxes, 3, generator=g))
    bx[..., 6] = (torch.rand(batch, boxes, generator=g) * 2 - 1) * torch.pi
    labels = torch.randint(0, len(p.classes), (batch, boxes), generator=g)  # [B, M]
    labels[:, -1] = -1  # padding row
    return {
        "points": pts,
        "num_points": num,
        "images": images,
        "proj": camera_proj(batch, cams),
        "cam_valid": torch.ones(batch, cams, dtype=torch.bool),
        "boxes": bx,
        "labels": labels,
        "num_boxes": torch.full((batch,), boxes - 1),
    }


def save_trained(out, model, cameras) -> dict:
    """`pfactory.detectors.io.save_model` of a default-architecture test model, as trained on data with
    `cameras` (the prepared data's camera names: a trained model's `spec.cameras`)."""
    from dataclasses import replace

    from pfactory.detectors.io import save_model

    model.spec = replace(model.spec, cameras=tuple(cameras))
    return save_model(out, model, "painted_pillars", None)
