"""Second stage: the heading of each detection refined from a fine, box-aligned raster of its points.

Why: front and back of people and riders show at 5-20 cm (feet forward, torso wider than deep, face versus
hair, a backpack behind; a rider's hips over the rear wheel, chest and head over the front), below the
0.4 m pillars and 0.8 m head cells the first stage reads them through (docs/models/centerpoint_lidar.md).
The first stage gives the box; this stage looks at the points around it at 0.1 m and picks which of the
four quarter turns {0, +pi/2, pi, -pi/2} of the first stage's yaw points forward.

In (lidar frame: x forward, y left, z up, metres):
    points     [B, P, 4] (x, y, z, intensity in [0, 1]); rows >= num_points[b] are padding
    num_points [B] int64
    boxes      [B, D, 7] (x, y, z, l, w, h, yaw), labels [B, D] int64 (a class index; -1 allowed: padding)
Steps:
    `fine_canvas`: points -> [B, 2S, Hf, Wf]: per `cell_m` BEV cell and each of S height slices of
        `z_range`, the point count and the intensity sum (intensity rounded to 1/255: integer sums, exact in
        float32 in any order, so PyTorch and ONNX Runtime agree bit for bit);
    `HeadingRefiner.patches`: the canvas sampled bilinearly (grid_sample) on a G x G grid over a square of
        side max(l, w) + 2 * margin centred on each box, axes along its yaw (u forward, v left) ->
        [B, D, 2S, G, G] (counts as a share of the patch's points, intensity as the cell mean);
    `HeadingRefiner.forward`: two convs and an MLP (with log point count, class and log size) -> logits of the
        four turns [B, D, 4];
    `turn`: yaw + k * pi/2 for the arg-max k of the refiner's logits plus the first stage's own log-probability
        of each turn (`first_stage_turn_logp`, from its heading bins: two views of the same heading, weighed
        together), l and w swapped for odd k (the BEV footprint is unchanged).
Training (`refine_loss`): every ground-truth box presented at each of the four turns, with a deterministic
jitter (centre, yaw, size) drawn from the box's own values (the same on every process and after a resume);
cross-entropy against the turn that brings it back.
Plain ops with static shapes (scatter_add, grid_sample, conv, gather): it exports inside the ONNX graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pfactory.archs.centerpoint_lidar.params import CenterPointLidarParams

TURNS = 4
_INTENSITY_STEPS = 255.0


def fine_canvas(
    points: Tensor, num_points: Tensor, pc_range: tuple[float, ...], p: CenterPointLidarParams
) -> Tensor:
    """Padded points -> [B, 2S, Hf, Wf] float32: counts (channels 0..S-1) and intensity sums in 1/255 units
    (S..2S-1) per `refine_cell_m` cell (row along y, column along x) and height slice (module docstring)."""
    b, n = points.shape[:2]
    s = p.refine_slices
    f = p.refine_cell_m
    x0, y0 = pc_range[0], pc_range[1]
    wf = round((pc_range[3] - x0) / f)
    hf = round((pc_range[4] - y0) / f)
    z_lo, z_hi = p.refine_z_range
    pts = points.float()
    col = torch.floor((pts[..., 0] - x0) / f)  # [B, P]
    row = torch.floor((pts[..., 1] - y0) / f)
    sl = torch.floor((pts[..., 2] - z_lo) * (s / (z_hi - z_lo)))
    valid = torch.arange(n, device=points.device)[None, :] < num_points[:, None]  # [B, P]
    valid = valid & (col >= 0) & (col < wf) & (row >= 0) & (row < hf) & (sl >= 0) & (sl < s)
    bi = torch.arange(b, device=points.device)[:, None]  # [B, 1]
    base = ((bi * (2 * s) + sl.clamp(0, s - 1).long()) * hf + row.clamp(0, hf - 1).long()) * wf
    index = (base + col.clamp(0, wf - 1).long()).where(valid, 0)  # [B, P] count channel
    index = torch.cat([index, index + s * hf * wf], dim=1).reshape(-1)  # [2 * B * P]
    ones = valid.to(torch.float32)
    intensity = torch.round(pts[..., 3].clamp(0, 1) * _INTENSITY_STEPS) * ones
    values = torch.cat([ones, intensity], dim=1).reshape(-1)  # [2 * B * P]
    canvas = torch.zeros(b * 2 * s * hf * wf, dtype=torch.float32, device=points.device)
    return canvas.scatter_add(0, index, values).reshape(b, 2 * s, hf, wf)


class HeadingRefiner(nn.Module):
    """Patches of the fine canvas around boxes -> logits of the four quarter turns (module docstring)."""

    def __init__(self, p: CenterPointLidarParams, num_classes: int, pc_range: tuple[float, ...]) -> None:
        super().__init__()
        s, g, c = p.refine_slices, p.refine_grid, p.refine_channels
        self.slices, self.grid, self.margin = s, g, float(p.refine_margin_m)
        z_lo, z_hi = p.refine_z_range  # the centroid's slices: from 0.5 m above the lowest height on
        self.recentre_from = min(s - 1, max(0, math.ceil((0.5) * s / (z_hi - z_lo))))
        self.num_classes = num_classes
        self.origin = (float(pc_range[0]), float(pc_range[1]))
        self.extent = (float(pc_range[3] - pc_range[0]), float(pc_range[4] - pc_range[1]))
        self.conv1 = nn.Conv2d(4 * s, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        side = (g + 1) // 2
        self.fc1 = nn.Linear(2 * c * side * side + 1 + num_classes + 3, 64)
        self.fc2 = nn.Linear(64, TURNS)
        nn.init.zeros_(self.fc2.weight)  # all turns equally likely before training: the first stage decides
        nn.init.zeros_(self.fc2.bias)

    def _sample(
        self, canvas: Tensor, cx: Tensor, cy: Tensor, yaw: Tensor, half: Tensor
    ) -> tuple[Tensor, ...]:
        """The canvas on each box's G x G patch grid: ([B*D, 2S, G, G], the grid's u and v offsets from the
        centre [B, D, 1, G] and [B, D, G, 1], metres)."""
        b, d = cx.shape
        g, s = self.grid, self.slices
        t = (torch.arange(g, dtype=torch.float32, device=cx.device) + 0.5) / g * 2.0 - 1.0  # [G]
        tu = t[None, None, None, :] * half[..., None, None]  # [B, D, 1, G] along u (columns)
        tv = t[None, None, :, None] * half[..., None, None]  # [B, D, G, 1] along v (rows)
        c, sn = torch.cos(yaw)[..., None, None], torch.sin(yaw)[..., None, None]
        x = cx[..., None, None] + c * tu - sn * tv  # [B, D, G, G]
        y = cy[..., None, None] + sn * tu + c * tv
        gx = (x - self.origin[0]) / self.extent[0] * 2.0 - 1.0  # align_corners=False: -1 is the left edge
        gy = (y - self.origin[1]) / self.extent[1] * 2.0 - 1.0
        grid = torch.stack([gx, gy], dim=-1).reshape(b, d * g, g, 2)  # [B, D*G, G, 2]
        sampled = F.grid_sample(canvas, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        return sampled.reshape(b, 2 * s, d, g, g).transpose(1, 2).reshape(b * d, 2 * s, g, g), tu, tv

    def patches(self, canvas: Tensor, boxes: Tensor) -> tuple[Tensor, Tensor]:
        """canvas [B, 2S, Hf, Wf], boxes [B, D, 7] -> (patch features [B*D, 2S, G, G], log(1 + points in
        the patch) [B*D, 1]). Row i of a patch runs along the box's v (left), column j along u (forward).

        The patch is centred on the points, not on the box: the first stage's centre is ~0.1 m off, as
        large as the cues. A first sampling gives the centroid of the points above the knees (slices from
        `recentre_from`; lower ones hold the ground), and the patch is sampled again around it."""
        b, d = boxes.shape[:2]
        s = self.slices
        half = 0.5 * torch.maximum(boxes[..., 3], boxes[..., 4]) + self.margin  # [B, D]
        cx, cy, yaw = boxes[..., 0], boxes[..., 1], boxes[..., 6]
        first, tu, tv = self._sample(canvas, cx, cy, yaw, half)
        w = first[:, self.recentre_from : s].sum(1).reshape(b, d, *first.shape[-2:])  # [B, D, G, G]
        total = w.sum(dim=(-2, -1))  # [B, D]
        du = (w * tu).sum(dim=(-2, -1)) / (total + 1.0)  # [B, D] shrunk towards 0 when there are few points
        dv = (w * tv).sum(dim=(-2, -1)) / (total + 1.0)
        c, sn = torch.cos(yaw), torch.sin(yaw)
        again, _, _ = self._sample(canvas, cx + c * du - sn * dv, cy + sn * du + c * dv, yaw, half)
        feats = []
        for sampled in (first, again):
            counts, inten = sampled[:, :s], sampled[:, s:]
            total = counts.sum(dim=(1, 2, 3))[:, None]  # [B*D, 1]
            share = counts / (total[..., None, None] + 1.0)
            feats += [share * 10.0, inten / (_INTENSITY_STEPS * (counts + 1e-3))]
        return torch.cat(feats, dim=1), torch.log1p(total)

    def forward(self, canvas: Tensor, boxes: Tensor, labels: Tensor) -> Tensor:
        """canvas [B, 2S, Hf, Wf], boxes [B, D, 7], labels [B, D] -> turn logits [B, D, 4] float32."""
        b, d = boxes.shape[:2]
        boxes = boxes.float()
        feats, log_total = self.patches(canvas, boxes)
        h = F.relu(self.conv2(F.relu(self.conv1(feats))))  # [B*D, 2C, G/2, G/2]
        onehot = F.one_hot(labels.clamp(0, self.num_classes - 1), self.num_classes).to(h.dtype)
        size = boxes[..., 3:6].clamp(min=1e-2).log().reshape(b * d, 3)
        z = torch.cat([h.flatten(1), log_total, onehot.reshape(b * d, -1), size], dim=1)
        return self.fc2(F.relu(self.fc1(z))).reshape(b, d, TURNS)


def first_stage_turn_logp(boxes: Tensor, bin_logits: Tensor) -> Tensor:
    """boxes [B, D, 7] (the first stage's), its heading-bin logits [B, n, D] -> [B, D, 4]: the first stage's
    log-probability of each quarter turn of its own yaw (that of the bin the turned yaw falls in)."""
    n = bin_logits.shape[1]
    logp = F.log_softmax(bin_logits.float(), dim=1)  # [B, n, D]
    turned = boxes[..., 6, None] + torch.arange(TURNS, device=boxes.device) * (math.pi / 2)  # [B, D, 4]
    k = torch.round(turned / (2 * math.pi / n)).long().remainder(n)  # [B, D, 4] the bin of each turn
    return logp.gather(1, k.transpose(1, 2)).transpose(1, 2)  # [B, D, 4]


def turn(boxes: Tensor, logits: Tensor) -> Tensor:
    """boxes [B, D, 7], turn logits [B, D, 4] -> boxes with yaw + k * pi/2 (k the arg-max), wrapped to
    (-pi, pi], and l, w swapped for odd k: the same BEV footprint, the heading turned."""
    k = logits.argmax(dim=-1)  # [B, D]
    odd = (k % 2 == 1)[..., None]  # [B, D, 1]
    yaw = boxes[..., 6] + k.to(boxes.dtype) * (math.pi / 2)
    yaw = torch.atan2(torch.sin(yaw), torch.cos(yaw))
    lw = torch.where(odd, boxes[..., [4, 3]], boxes[..., 3:5])
    return torch.cat([boxes[..., :3], lw, boxes[..., 5:6], yaw[..., None]], dim=-1)


def hash_uniform(v: Tensor, salt: float) -> Tensor:
    """A deterministic pseudo-random number in [0, 1) per row of v [..., 3] (a shader hash of the values)."""
    dot = v[..., 0] * 12.9898 + v[..., 1] * 78.233 + v[..., 2] * 37.719 + salt
    return torch.frac(torch.sin(dot).abs() * 43758.5453)


def hash_normal(v: Tensor, salt: float, step: float) -> Tensor:
    """A deterministic number of mean 0 and variance 1 per row of v [..., 3]: the Irwin-Hall sum of the
    `hash_uniform`s at salts salt, salt + step, salt + 2 step, centred and scaled (~ a normal)."""
    u = sum(hash_uniform(v, salt + step * j) for j in range(3))
    return (u - 1.5) * 2.0


def training_views(boxes: Tensor, p: CenterPointLidarParams) -> tuple[Tensor, Tensor]:
    """Ground-truth boxes [B, M, 7] -> (the four turned and jittered views [B, 4M, 7], the target turn of
    each [B, 4M] int64): view k has yaw - k * pi/2 (l, w swapped for odd k) and target k, the turn that
    brings it back. Jitter: centre N(0, jitter_m) per axis, yaw N(0, jitter_rad), size x N(1, 0.05), from
    `hash_uniform` of the box and the view (Irwin-Hall of 3 uniforms ~ a normal)."""
    b, m = boxes.shape[:2]
    views, targets = [], []
    for k in range(TURNS):

        def noise(salt: float, k: int = k) -> Tensor:
            return hash_normal(boxes[..., :3], 7.0 * k + salt, 0.37)

        yaw = boxes[..., 6] - k * (math.pi / 2) + p.refine_jitter_rad * noise(1.0)
        lw = boxes[..., [4, 3]] if k % 2 else boxes[..., 3:5]
        scale = 1.0 + 0.05 * torch.stack([noise(2.0), noise(3.0)], dim=-1)
        xy = boxes[..., :2] + p.refine_jitter_m * torch.stack([noise(4.0), noise(5.0)], dim=-1)
        views.append(torch.cat([xy, boxes[..., 2:3], lw * scale, boxes[..., 5:6], yaw[..., None]], dim=-1))
        targets.append(torch.full((b, m), k, dtype=torch.long, device=boxes.device))
    return torch.cat(views, dim=1), torch.cat(targets, dim=1)


def refine_loss(
    refiner: HeadingRefiner,
    canvas: Tensor,
    boxes: Tensor,
    labels: Tensor,
    mask: Tensor,
    p: CenterPointLidarParams,
) -> tuple[Tensor, Tensor]:
    """(sum of the cross-entropy over the valid objects' four views [], the number of views whose turn is
    right []) for ground-truth boxes [B, M, 7], labels [B, M], mask [B, M] (the objects trained on)."""
    views, target = training_views(boxes.float(), p)  # [B, 4M, 7], [B, 4M]
    logits = refiner(canvas, views, labels.repeat(1, TURNS))  # [B, 4M, 4]
    weight = mask.repeat(1, TURNS).to(logits.dtype)  # [B, 4M]
    ce = F.cross_entropy(logits.reshape(-1, TURNS), target.reshape(-1), reduction="none")
    correct = (logits.argmax(-1) == target).to(logits.dtype)
    return (ce * weight.reshape(-1)).sum(), (correct * weight).sum().detach()
