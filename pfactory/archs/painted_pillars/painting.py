"""Camera painting: image features sampled at every lidar point's projection (DESIGN.md §5, step 2).

    paint_points(points, features, proj, cam_valid, image_size, sampler) -> [B, P, C + 1]
    paint_points_export(...)                  the same values, the ONNX export's graph
    paint_points_projected(..., weight, dense) -> (rows [B, P, D], flag [B, P])  the first layer applied first
    Painter / ProjectedPainter / ExportPainter the detector's swappable painting modules

Every point is projected into every camera and bilinearly samples that camera's features, zero where it
falls behind the camera, outside the image or in an invalid camera; the features of the cameras that
see a point are averaged. Differentiable end to end w.r.t. the features. Which formulation a model runs
is its painter module, chosen when it is built (`model.paint_sampler`) or converted
(`pfactory.archs.painted_pillars.variants`: export, compile), never inside a `forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kernels


def _project(proj: Tensor, xyz1: Tensor) -> Tensor:
    """proj [B, N, 3, 4] @ xyz1 [B, P, 4] -> [B, N, P, 3], in fp32 also under bf16 autocast (bf16's 8-bit
    mantissa would move a pixel at u ~ 400 by ~2 px)."""
    dev = xyz1.device.type
    if torch.is_autocast_enabled(dev):
        with torch.autocast(dev, enabled=False):
            return torch.einsum("bnij,bpj->bnpi", proj.float(), xyz1.float())
    return torch.einsum("bnij,bpj->bnpi", proj, xyz1)


def _sample_coords(
    uvw: Tensor, cam_valid: Tensor, image_size: tuple[int, int], min_depth_m: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Homogeneous pixels uvw [B, N, P, 3] -> (gx, gy, seen), each [B, N, P]: `grid_sample`'s normalized
    coordinates (pixel u -> (u + 0.5) / Wi * 2 - 1) and whether the camera sees the point (in front of it
    by more than `min_depth_m`, inside the image, a valid camera). Unseen points are parked at the image
    centre: finite coordinates keep the bilinear weights (and grid_sample's gradient) finite; callers zero
    their samples by `seen`."""
    wi, hi = image_size
    depth = uvw[..., 2]  # [B, N, P]
    uv = uvw[..., :2] / depth.clamp(min=min_depth_m).unsqueeze(-1)  # [B, N, P, 2] pixels
    gx = (uv[..., 0] + 0.5) * (2.0 / wi) - 1.0  # [B, N, P] in [-1, 1] inside the image
    gy = (uv[..., 1] + 0.5) * (2.0 / hi) - 1.0  # [B, N, P]
    seen = (depth > min_depth_m) & (gx.abs() <= 1.0) & (gy.abs() <= 1.0) & cam_valid[:, :, None]  # [B, N, P]
    return gx.where(seen, 0.0), gy.where(seen, 0.0), seen


def paint_points(
    points: Tensor,  # [B, P, >=3] lidar frame
    features: Tensor,  # [B, N, C, h, w] image features covering the model-input images exactly
    proj: Tensor,  # [B, N, 3, 4] lidar -> model-input image pixels
    cam_valid: Tensor,  # [B, N] bool
    image_size: tuple[int, int],  # (Wi, Hi) of the model-input images, pixels
    min_depth_m: float = 0.1,
    sampler: str = "grid_sample",
) -> Tensor:
    """Image features at every point's projection, averaged over the cameras that see it.

    Returns [B, P, C + 1]: the mean feature, then a 0/1 flag "seen by at least one camera" (so the
    MLP can tell a dark pixel from no camera at all).
    Pixel convention: integer pixel coordinates are pixel centres (OpenCV/KITTI `P`), so pixel u maps
    to the normalized `grid_sample` coordinate (u + 0.5) / Wi * 2 - 1 with align_corners=False.
    `sampler` (`model.paint_sampler`): "grid_sample" (`F.grid_sample`) or "gather" (`sample_bilinear`, the
    same values to float rounding with a cheaper CPU backward). The ONNX export takes `paint_points_export`.
    """
    b, n, c, h, w = features.shape
    p = points.shape[1]
    xyz1 = torch.cat([points[..., :3], torch.ones_like(points[..., :1])], dim=-1)  # [B, P, 4]
    uvw = _project(proj, xyz1)  # [B, N, P, 3] homogeneous pixels
    gx, gy, seen = _sample_coords(uvw, cam_valid, image_size, min_depth_m)  # [B, N, P] each
    if sampler == "gather":
        sampled = sample_bilinear(features, gx, gy, seen)  # [B, N, P, C]
    else:
        sampled = F.grid_sample(
            features.reshape(b * n, c, h, w),
            torch.stack([gx, gy], dim=-1).reshape(b * n, 1, p, 2),
            mode="bilinear",
            align_corners=False,
            padding_mode="zeros",
        ).reshape(b, n, c, p)  # [B, N, C, P]
        sampled = sampled.transpose(2, 3) * seen.unsqueeze(-1).to(sampled.dtype)  # [B, N, P, C]
    count = seen.sum(dim=1).to(sampled.dtype)  # [B, P] cameras seeing each point
    mean = sampled[:, 0] if n == 1 else sampled.sum(dim=1)  # [B, P, C]; 0 where no camera sees it
    if n > 1:
        mean = mean / count.clamp(min=1.0).unsqueeze(-1)  # [B, P, C]
    flag = (count > 0).to(sampled.dtype).unsqueeze(-1)  # [B, P, 1]
    return torch.cat([mean, flag], dim=-1)  # [B, P, C + 1]


def paint_points_export(
    points: Tensor,  # [B, P, >=3] lidar frame
    features: Tensor,  # [B, N, C, h, w]
    proj: Tensor,  # [B, N, 3, 4]
    cam_valid: Tensor,  # [B, N] bool
    image_size: tuple[int, int],  # (Wi, Hi)
    min_depth_m: float = 0.1,
) -> Tensor:
    """`paint_points` (grid_sample), the same values, as the ONNX export's graph: [B, P, C + 1].

    Per-coordinate [B, N, P] ops instead of [B, N, P, 2] ones with a broadcast last dim of 2 (ONNX
    Runtime's CPU broadcasting pays per row of 2: 0.15-0.45 ms each at 20k points, docs/OPTIMIZE.md),
    and unseen points parked far outside the image, where grid_sample's zero padding returns exactly 0,
    so the `* seen` mask over [B, N, C, P] is not needed.
    """
    b, n, c, h, w = features.shape
    p = points.shape[1]
    wi, hi = image_size
    xyz1 = torch.cat([points[..., :3], torch.ones_like(points[..., :1])], dim=-1)  # [B, P, 4]
    uvw = _project(proj, xyz1)  # [B, N, P, 3] homogeneous pixels
    depth = uvw[..., 2]  # [B, N, P]
    d = depth.clamp(min=min_depth_m)  # [B, N, P]
    gx = (uvw[..., 0] / d + 0.5) * (2.0 / wi) - 1.0  # [B, N, P]
    gy = (uvw[..., 1] / d + 0.5) * (2.0 / hi) - 1.0  # [B, N, P]
    seen = (depth > min_depth_m) & (gx.abs() <= 1.0) & (gy.abs() <= 1.0) & cam_valid[:, :, None]
    far = 4.0  # > 1 + 2 texels in normalized units for any image >= 2 px: all 4 bilinear taps outside
    grid = torch.stack([gx.where(seen, -far), gy.where(seen, -far)], dim=-1)  # [B, N, P, 2]
    sampled = F.grid_sample(
        features.reshape(b * n, c, h, w),
        grid.reshape(b * n, 1, p, 2),
        mode="bilinear",
        align_corners=False,
        padding_mode="zeros",
    ).reshape(b, n, c, p)  # [B, N, C, P], 0 where unseen
    count = seen.sum(dim=1).to(sampled.dtype)  # [B, P] cameras seeing each point
    mean = sampled.sum(dim=1) / count.clamp(min=1.0).unsqueeze(1)  # [B, C, P]
    flag = (count > 0).to(sampled.dtype).unsqueeze(1)  # [B, 1, P]
    return torch.cat([mean, flag], dim=1).transpose(1, 2)  # [B, P, C + 1]


def paint_points_projected(
    points: Tensor,  # [B, P, >=3] lidar frame
    features: Tensor,  # [B, N, C, h, w] image features (channels-last per camera)
    proj: Tensor,  # [B, N, 3, 4] lidar -> model-input image pixels
    cam_valid: Tensor,  # [B, N] bool
    image_size: tuple[int, int],  # (Wi, Hi) of the model-input images, pixels
    weight: Tensor,  # [D, C]: a linear layer's columns for paint_points' C features
    min_depth_m: float = 0.1,
    dense: bool = False,
) -> tuple[Tensor, Tensor]:
    """`paint_points`, with its C features multiplied by `weight`, computed by projecting before sampling.

    Returns (rows [B, P, D] float32 = paint_points(...)[..., :C] @ weight.T, flag [B, P] float32 =
    paint_points(...)[..., C], 1 where a camera sees the point).
    Bilinear sampling, the zero for unseen points and the mean over cameras are all linear in the
    features, so the pillar MLP's first layer can be applied to the [B*N*h*w, C] feature-map rows (a
    13k-row GEMM at the default size) and the projected rows sampled (`kernels.bilinear_rows`: four row
    gathers) instead of sampling C channels per point, concatenating them behind the point decoration
    and multiplying there. Only the samples a camera sees are gathered (about 37% of the default data's
    points); with `dense` every sample goes to the op with zero weights where unseen (no data-dependent
    shapes, for torch.compile) and the op skips those. The same
    function to float rounding (tested against `paint_points`, forward and backward); no [B, P, C + 1]
    tensor, no concatenation, and the rows are [P, D], the layout the pillar encoder adds them to
    (docs/MODEL.md, "Speed"). Runs in float32 under bf16 autocast (as `_project` does).
    Differentiable w.r.t. `features` and `weight`.
    """
    b, n, c, h, w = features.shape
    p = points.shape[1]
    if weight.shape[-1] != c:
        raise ValueError(f"paint_points_projected: weight has {weight.shape[-1]} columns, expected {c}")
    dev = points.device.type
    with torch.autocast(dev, enabled=False):
        xyz1 = torch.cat([points[..., :3], torch.ones_like(points[..., :1])], dim=-1).float()  # [B, P, 4]
        uvw = _project(proj.float(), xyz1)  # [B, N, P, 3]
        gx, gy, seen = _sample_coords(uvw, cam_valid, image_size, min_depth_m)  # [B, N, P] each
        rows = features.float().permute(0, 1, 3, 4, 2).reshape(b * n * h * w, c)  # [B*N*h*w, C]
        table = F.linear(rows, weight.float())  # [B*N*h*w, D]
        if dense:
            index, wts = bilinear_taps(gx, gy, seen, h, w)  # [B, N, P, 4] each, 0 weights where unseen
            sampled = kernels.bilinear_rows(table, index.reshape(-1, 4), wts.reshape(-1, 4))  # [B*N*P, D]
        else:
            dest = seen.reshape(-1).nonzero().squeeze(1)  # [S] the seen samples of the [B*N*P] rows
            fx, fy = gx.reshape(-1)[dest], gy.reshape(-1)[dest]  # [S]
            index, wts = bilinear_taps(fx.view(1, 1, -1), fy.view(1, 1, -1), None, h, w)  # [1, 1, S, 4]
            index = index.view(-1, 4) + (dest // p).unsqueeze(1) * (h * w)  # [S, 4] rows of camera b*N+n
            sampled = kernels.bilinear_rows(table, index, wts.view(-1, 4), dest, b * n * p)  # [B*N*P, D]
        count = seen.sum(dim=1).to(torch.float32)  # [B, P] cameras seeing each point
        if n == 1:
            mean = sampled.view(b, p, -1)  # [B, P, D]; 0 where unseen
        else:
            mean = sampled.view(b, n, p, -1).sum(dim=1) / count.clamp(min=1.0).unsqueeze(-1)  # [B, P, D]
        return mean, (count > 0).to(torch.float32)


def bilinear_taps(gx: Tensor, gy: Tensor, mask: Tensor | None, h: int, w: int) -> tuple[Tensor, Tensor]:
    """grid_sample's four bilinear taps (align_corners=False, zero padding) of normalized coordinates.

    gx, gy [B, N, P] in [-1, 1] inside a [h, w] feature map, mask [B, N, P] bool or None (no mask) ->
    (index [B, N, P, 4] int64 row of the [B*N*h*w] row table, weight [B, N, P, 4]). Corner order and
    weight formulas are ATen's CPU kernel's (north-west, north-east, south-west, south-east); a corner
    outside the map or a masked sample gets weight 0 (and a clamped, valid row).
    """
    b, n, _ = gx.shape
    ix = ((gx + 1) * w - 1) / 2  # [B, N, P] feature-map pixel coordinates (grid_sample's unnormalize)
    iy = ((gy + 1) * h - 1) / 2
    x0, y0 = torch.floor(ix), torch.floor(iy)  # [B, N, P] north-west corner
    x1, y1 = x0 + 1, y0 + 1
    base = torch.arange(b * n, device=gx.device).view(b, n, 1) * (h * w)  # [B, N, 1] first row
    index, weight = [], []
    for xc, yc, wt in (
        (x0, y0, (x1 - ix) * (y1 - iy)),
        (x1, y0, (ix - x0) * (y1 - iy)),
        (x0, y1, (x1 - ix) * (iy - y0)),
        (x1, y1, (ix - x0) * (iy - y0)),
    ):
        inside = (xc >= 0) & (xc <= w - 1) & (yc >= 0) & (yc <= h - 1)  # [B, N, P]
        if mask is not None:
            inside = inside & mask
        index.append(base + (yc.clamp(0, h - 1) * w + xc.clamp(0, w - 1)).long())  # [B, N, P]
        weight.append(wt * inside)  # [B, N, P]; 0 outside the map (zero padding)
    return torch.stack(index, dim=-1), torch.stack(weight, dim=-1)  # [B, N, P, 4] each


def sample_bilinear(features: Tensor, gx: Tensor, gy: Tensor, mask: Tensor) -> Tensor:
    """`F.grid_sample(bilinear, zeros padding, align_corners=False)` as four row gathers, times `mask`.

    features [B, N, C, h, w] (channels-last memory per camera: the image branch's output, so the
    [B*N*h*w, C] row table below is a view), gx, gy [B, N, P] normalized coordinates, mask [B, N, P]
    bool -> [B, N, P, C] float32. The same weights and corner order as ATen's CPU kernel, so the values
    agree to float rounding (tested); each sample's rows are computed alone, so a batch gives bitwise the
    forward and feature gradient of its samples run one by one (tested). Why: grid_sample's CPU
    backward scatters one float at a time and also computes the coordinates' gradient; here forward
    and backward are one op (`kernels.bilinear_rows`): four row gathers, four row `index_add_`s
    (docs/MODEL.md, "Speed"), and the output is [P, C] rows, the layout the pillar MLP reads.
    Differentiable w.r.t. `features` only; coordinates that require grad are refused.
    """
    if gx.requires_grad or gy.requires_grad:
        raise ValueError("sample_bilinear: gx and gy must not require grad (no gradient flows to them)")
    b, n, c, h, w = features.shape
    p = gx.shape[-1]
    table = features.permute(0, 1, 3, 4, 2).reshape(b * n * h * w, c)  # [B*N*h*w, C]
    index, weight = bilinear_taps(gx, gy, mask, h, w)  # [B, N, P, 4] each
    out = kernels.bilinear_rows(table, index.reshape(-1, 4), weight.reshape(-1, 4).float())  # [B*N*P, C]
    return out.view(b, n, p, c)


class Painter(nn.Module):
    """`paint_points` with a fixed sampler: (points, features, proj, cam_valid, weight) -> [B, P, C + 1]
    (`weight`, the first layer's image columns, is not used: the encoder multiplies the painted features)."""

    def __init__(self, image_size: tuple[int, int], sampler: str = "grid_sample") -> None:
        super().__init__()
        self.image_size, self.sampler = image_size, sampler

    def forward(
        self, points: Tensor, features: Tensor, proj: Tensor, cam_valid: Tensor, weight: Tensor
    ) -> Tensor:
        return paint_points(points, features, proj, cam_valid, self.image_size, sampler=self.sampler)


class ProjectedPainter(nn.Module):
    """`paint_points_projected`: -> (rows [B, P, D], flag [B, P]), the first layer's image columns
    `weight` [D, C] applied before sampling. `dense` (torch.compile): every sample gathered, no
    data-dependent shapes."""

    def __init__(self, image_size: tuple[int, int], dense: bool = False) -> None:
        super().__init__()
        self.image_size, self.dense = image_size, dense

    def forward(
        self, points: Tensor, features: Tensor, proj: Tensor, cam_valid: Tensor, weight: Tensor
    ) -> tuple[Tensor, Tensor]:
        return paint_points_projected(
            points, features, proj, cam_valid, self.image_size, weight, dense=self.dense
        )


class ExportPainter(Painter):
    """`paint_points_export`: the grid_sample painting as the ONNX export's graph -> [B, P, C + 1]."""

    def forward(
        self, points: Tensor, features: Tensor, proj: Tensor, cam_valid: Tensor, weight: Tensor
    ) -> Tensor:
        return paint_points_export(points, features, proj, cam_valid, self.image_size)
