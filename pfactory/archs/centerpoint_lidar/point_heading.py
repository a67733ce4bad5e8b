"""Second stage for near-square boxes (people): the heading from the moments of each detection's own points.

Why: a pedestrian's first-stage yaw is near random (its box is near square: the BEV shape says nothing),
and its front/back cues (feet forward, a torso wider than deep, a face ahead of the hair, a backpack
behind) are 5-20 cm offsets between height slices, below the 0.1 m raster the quarter-turn refiner
(`refine.py`) samples. Exact point coordinates keep them: this stage reads per-height-slice moments of the
points themselves, in a frame turned to each of N candidate headings, and scores each candidate with one
small MLP shared by all candidates (the same function of the points seen from each heading: what is
learned for one heading holds for all, rotation costs no data).

In (lidar frame: x forward, y left, z up, metres):
    points     [B, P, 4] (x, y, z, intensity); rows >= num_points[b] are padding
    num_points [B] int64
    boxes      [B, D, 7] (x, y, z, l, w, h, yaw): the first stage's (or training views)
Steps:
    `gather`: per box, the `refine_points` (K) points nearest its BEV centre ([B, D, K, 4]; TopK over the
        frame's points padded with K empty rows, so any P works), kept when within max(l, w) / 2 +
        `refine_margin_m` of the centre;
    `moments`: centred on the points above 30 % of the box height (their mean, shrunk towards the box centre
        when they are few: the first stage's centre is ~0.1 m off, as large as the cues), per height slice
        of the box (`refine_point_slices` over [bottom, top]): the share of points, means of x, y, x^2, y^2,
        xy, intensity, intensity * x, intensity * y; and the direction from the object to the sensor (the
        frame's origin) -> [B, D, S, 8], [B, D, S] shares, [B, D, 2];
    `candidate_features`: the moments turned into each candidate's frame (u forward, v left; means and
        second moments rotate exactly, nothing is resampled) -> [B, D, N, 9 S + 3];
    `forward`: MLP -> logits [B, D, N] of the candidate headings yaw + j * 2 pi / N.
`heading_from_logits`: the softmax-weighted circular mean of the candidates (continuous in the logits:
PyTorch and ONNX Runtime agree to float noise, where an arg-max would jump 2 pi / N at a near-tie).
Training (`point_heading_loss`): each ground-truth box of near-square footprint seen from
`refine_point_views` headings drawn uniformly from a hash of the box (the same on every DDP process and
after a resume), its centre and size jittered like `refine.training_views`; cross-entropy against the
candidate nearest the true heading.
Plain ops with static shapes (TopK, Gather, elementwise, ReduceSum, Gemm): it exports inside the ONNX graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pfactory.archs.centerpoint_lidar.params import CenterPointLidarParams
from pfactory.archs.centerpoint_lidar.refine import hash_normal, hash_uniform

MOMENTS = ("x", "y", "xx", "yy", "xy", "i", "ix", "iy")
_FAR = 1.0e9  # squared distance of padding rows: never within any box's radius
_KNEE = 0.3  # the centroid's points: above this fraction of the box height (the ground and the legs below)


def near_square(boxes: Tensor, aspect: float) -> Tensor:
    """boxes [..., 7] -> [...] bool: footprint max(l, w) / min(l, w) <= aspect (a person, not a car or bike)."""
    lw = boxes[..., 3:5].abs().clamp(min=1e-3)
    return lw.amax(-1) <= aspect * lw.amin(-1)


class PointHeading(nn.Module):
    """Points near each box -> logits of N candidate headings [B, D, N] (module docstring)."""

    def __init__(self, p: CenterPointLidarParams) -> None:
        super().__init__()
        self.bins = p.refine_point_bins
        self.k = p.refine_points
        self.slices = p.refine_point_slices
        self.margin = float(p.refine_margin_m)
        h = p.refine_point_hidden
        self.mlp = nn.Sequential(
            nn.Linear(9 * self.slices + 3, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1)
        )

    def gather(self, points: Tensor, num_points: Tensor, boxes: Tensor) -> tuple[Tensor, Tensor]:
        """-> (the K points nearest each box's BEV centre [B, D, K, 4] float32, within its radius [B, D, K])."""
        b, n = points.shape[:2]
        k = self.k
        pts = F.pad(points.float(), (0, 0, 0, k))  # [B, P+K, 4]: TopK needs at least K rows
        valid = torch.arange(n + k, device=points.device)[None, :] < num_points[:, None]  # [B, P+K]
        dx = pts[:, None, :, 0] - boxes[..., 0, None]  # [B, D, P+K]
        dy = pts[:, None, :, 1] - boxes[..., 1, None]
        d2 = torch.where(valid[:, None, :], dx * dx + dy * dy, torch.full_like(dx, _FAR))
        near, idx = torch.topk(d2, k, dim=-1, largest=False, sorted=False)  # [B, D, K]
        flat = idx + (torch.arange(b, device=points.device) * (n + k))[:, None, None]
        got = pts.reshape(-1, 4)[flat.reshape(-1)].reshape(*idx.shape, 4)  # [B, D, K, 4]
        radius = 0.5 * boxes[..., 3:5].abs().amax(-1) + self.margin  # [B, D]
        return got, near < (radius * radius)[..., None]

    def moments(
        self, points: Tensor, num_points: Tensor, boxes: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """-> (per-slice means of `MOMENTS` in the lidar axes about the points' centre [B, D, S, 8], each
        slice's share of the points [B, D, S], log(1 + points) [B, D, 1], the unit direction to the
        sensor [B, D, 2])."""
        s = self.slices
        boxes = boxes.float()
        got, inside = self.gather(points, num_points, boxes)
        m = inside.to(torch.float32)  # [B, D, K]
        x = got[..., 0] - boxes[..., 0, None]  # [B, D, K] about the box centre
        y = got[..., 1] - boxes[..., 1, None]
        h = boxes[..., 5, None].abs().clamp(min=0.1)  # [B, D, 1]
        zb = got[..., 2] - (boxes[..., 2, None] - 0.5 * h)  # height above the box bottom
        upper = m * (zb > _KNEE * h).to(torch.float32)
        cnt = upper.sum(-1) + 1.0  # shrunk towards the box centre when few
        ox = (upper * x).sum(-1) / cnt  # [B, D]
        oy = (upper * y).sum(-1) / cnt
        x = x - ox[..., None]
        y = y - oy[..., None]
        sl = torch.floor(zb * (s / h)).clamp(0, s - 1)  # [B, D, K]
        onehot = (sl[..., None] == torch.arange(s, device=sl.device, dtype=sl.dtype)).to(torch.float32)
        onehot = onehot * m[..., None]  # [B, D, K, S]
        inten = got[..., 3].clamp(0, 1)
        q = torch.stack([x, y, x * x, y * y, x * y, inten, inten * x, inten * y], dim=-1)  # [B, D, K, 8]
        n_s = onehot.sum(2)  # [B, D, S]
        sums = (onehot[..., None] * q[..., None, :]).sum(2)  # [B, D, S, 8]: elementwise, never a MatMul
        means = sums / (n_s[..., None] + 1e-3)
        total = n_s.sum(-1, keepdim=True)  # [B, D, 1]
        share = n_s / (total + 1e-3)
        to_sensor = -torch.stack([boxes[..., 0] + ox, boxes[..., 1] + oy], dim=-1)  # [B, D, 2]
        to_sensor = to_sensor / (to_sensor.norm(dim=-1, keepdim=True) + 1e-6)
        return means, share, torch.log1p(total), to_sensor

    def candidate_features(
        self, means: Tensor, share: Tensor, log_total: Tensor, to_sensor: Tensor, yaw: Tensor
    ) -> Tensor:
        """`moments` and the boxes' yaw [B, D] -> [B, D, N, 9 S + 3]: each candidate heading's features, the
        moments in its frame (u forward, v left)."""
        step = 2.0 * math.pi / self.bins
        th = (
            yaw[..., None] + torch.arange(self.bins, device=yaw.device, dtype=torch.float32) * step
        )  # [B,D,N]
        c, sn = torch.cos(th)[..., None], torch.sin(th)[..., None]  # [B, D, N, 1]
        mo = means[:, :, None]  # [B, D, 1, S, 8]

        def at(i: int) -> Tensor:
            return mo[..., i]  # [B, D, 1, S]

        mx, my, sxx, syy, sxy = at(0), at(1), at(2) - at(0) ** 2, at(3) - at(1) ** 2, at(4) - at(0) * at(1)
        mu, mv = c * mx + sn * my, -sn * mx + c * my  # [B, D, N, S]
        vuu = c * c * sxx + 2 * c * sn * sxy + sn * sn * syy
        vvv = sn * sn * sxx - 2 * c * sn * sxy + c * c * syy
        cuv = c * sn * (syy - sxx) + (c * c - sn * sn) * sxy
        iu, iv = c * at(6) + sn * at(7), -sn * at(6) + c * at(7)
        sx, sy = to_sensor[..., 0, None], to_sensor[..., 1, None]  # [B, D, 1]
        su, sv = c[..., 0] * sx + sn[..., 0] * sy, -sn[..., 0] * sx + c[..., 0] * sy  # [B, D, N]
        full = mu.shape

        def std(v: Tensor) -> Tensor:
            return torch.sqrt(v.clamp(min=0.0) + 1e-6)

        return torch.cat(
            [
                share[:, :, None].expand(full) * 5.0,
                mu * 10.0, mv * 10.0, std(vuu) * 10.0, std(vvv) * 10.0, cuv * 50.0,
                at(5).expand(full), iu * 10.0, iv * 10.0,
                log_total[..., None].expand(*full[:3], 1), su[..., None], sv[..., None],
            ],
            dim=-1,
        )  # fmt: skip

    def forward(self, points: Tensor, num_points: Tensor, boxes: Tensor) -> Tensor:
        """points [B, P, 4], num_points [B], boxes [B, D, 7] -> logits [B, D, N] of the headings
        yaw + j * 2 pi / N, float32 (under autocast too: the moments need float32)."""
        with torch.autocast(points.device.type, enabled=False):
            boxes = boxes.float()
            feats = self.candidate_features(*self.moments(points, num_points, boxes), boxes[..., 6])
            return self.mlp(feats)[..., 0]


def heading_from_logits(yaw: Tensor, logits: Tensor) -> Tensor:
    """yaw [B, D], candidate logits [B, D, N] -> the softmax-weighted circular mean of the candidates
    yaw + j * 2 pi / N [B, D], wrapped to (-pi, pi]."""
    n = logits.shape[-1]
    th = torch.arange(n, device=logits.device, dtype=torch.float32) * (2.0 * math.pi / n)
    w = logits.float().softmax(-1)
    off = torch.atan2((w * torch.sin(th)).sum(-1), (w * torch.cos(th)).sum(-1))
    out = yaw + off
    return torch.atan2(torch.sin(out), torch.cos(out))


def turn_by(boxes: Tensor, yaw: Tensor) -> Tensor:
    """boxes [B, D, 7] with the new yaw [B, D]: l and w swapped when it is nearer a quarter turn away from
    the old one than the same axis (the BEV footprint stays as close as it can)."""
    d = torch.atan2(torch.sin(yaw - boxes[..., 6]), torch.cos(yaw - boxes[..., 6]))
    odd = (torch.round(d / (math.pi / 2)).abs() == 1)[..., None]
    lw = torch.where(odd, boxes[..., [4, 3]], boxes[..., 3:5])
    return torch.cat([boxes[..., :3], lw, boxes[..., 5:6], yaw[..., None]], dim=-1)


def training_views(boxes: Tensor, p: CenterPointLidarParams) -> tuple[Tensor, Tensor]:
    """Ground-truth boxes [B, M, 7] -> (V views each [B, V*M, 7], the target candidate [B, V*M] int64). View
    v: yaw - o with o uniform in [0, 2 pi) from a hash of the box, target round(o N / 2 pi) mod N; centre
    N(0, refine_jitter_m) per axis, size x N(1, 0.05) (Irwin-Hall of 3 uniforms ~ a normal)."""
    n = p.refine_point_bins
    views, targets = [], []
    for v in range(p.refine_point_views):

        def noise(salt: float, v: int = v) -> Tensor:
            return hash_normal(boxes[..., :3], 11.0 * v + salt, 0.41)

        off = 2.0 * math.pi * hash_uniform(boxes[..., :3], 11.0 * v + 0.5)  # [B, M]
        xy = boxes[..., :2] + p.refine_jitter_m * torch.stack([noise(1.0), noise(2.0)], dim=-1)
        scale = 1.0 + 0.05 * torch.stack([noise(3.0), noise(4.0), noise(5.0)], dim=-1)
        yaw = boxes[..., 6] - off
        views.append(torch.cat([xy, boxes[..., 2:3], boxes[..., 3:6] * scale, yaw[..., None]], dim=-1))
        targets.append(torch.round(off * (n / (2.0 * math.pi))).long().remainder(n))
    return torch.cat(views, dim=1), torch.cat(targets, dim=1)


def trained_views(mask: Tensor, boxes: Tensor, p: CenterPointLidarParams) -> Tensor:
    """[B, V*M] bool, in `training_views`' order: the views the loss trains on (objects in `mask` [B, M]
    whose ground-truth box [B, M, 7] is near square). Their global count normalizes the loss."""
    return (mask & near_square(boxes, p.refine_square_aspect)).repeat(1, p.refine_point_views)


def point_heading_loss(
    head: PointHeading,
    points: Tensor,
    num_points: Tensor,
    boxes: Tensor,
    mask: Tensor,
    p: CenterPointLidarParams,
) -> tuple[Tensor, Tensor]:
    """(sum of the cross-entropy over the views of the valid near-square objects [], their count []) for
    ground-truth boxes [B, M, 7] and mask [B, M] (the objects trained on)."""
    views, target = training_views(boxes.float(), p)  # [B, V*M, 7], [B, V*M]
    logits = head(points, num_points, views)  # [B, V*M, N]
    weight = trained_views(mask, boxes, p).to(logits.dtype).reshape(-1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    return (ce * weight).sum(), weight.sum().detach()
