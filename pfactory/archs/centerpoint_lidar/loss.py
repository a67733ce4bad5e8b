"""The loss of the class-group heads: focal heatmap loss, L1 on the box channels, cross-entropy on the
direction bin and L1 on the target bin's (sin, cos) residual.

In:  `forward`'s outputs `{"heatmap": [B, K, Ho, Wo] logits (head order), "reg": [B, G, R, Ho, Wo]}` (R =
     `CenterPointLidarParams.reg_channels`: 6 box, n bin logits, 2n residuals), `Targets`, the params.
Out: `{"loss", "heatmap", "box", "dir_cls", "dir_res", "box/<channel>"}`, each [] float32.

Normalization as the default head's (`pfactory.archs.painted_pillars.loss`): under DDP the caller passes the global peak
and object counts and the world size, so that averaging the processes' gradients gives the gradient of
the single-process loss on the whole batch: loss_r = S_r / max(1, N_global) * world_size.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

import kernels
from pfactory.archs.centerpoint_lidar.params import BOX_CHANNELS, CenterPointLidarParams
from pfactory.archs.centerpoint_lidar.targets import Targets


def gather_objects(reg: Tensor, index: Tensor, group: Tensor) -> Tensor:
    """reg [B, G, R, Ho, Wo], index [B, M] (cell), group [B, M] (head) -> [B, M, R]: each object's head
    channels at its cell."""
    b, g, r = reg.shape[:3]
    m = index.shape[1]
    flat = reg.reshape(b, g * r, -1)  # [B, G*R, Ho*Wo]
    at_cell = flat.gather(2, index[:, None, :].expand(b, g * r, m)).reshape(b, g, r, m)  # [B, G, R, M]
    own = at_cell.gather(1, group[:, None, None, :].expand(b, 1, r, m))[:, 0]  # [B, R, M]
    return own.transpose(1, 2)  # [B, M, R]


def detection_loss(
    out: dict[str, Tensor],
    t: Targets,
    p: CenterPointLidarParams,
    num_peaks: Tensor | None = None,
    num_objects: Tensor | None = None,
    world_size: int = 1,
) -> dict[str, Tensor]:
    """Loss terms (module docstring); `num_peaks` / `num_objects`: global counts under DDP, else None."""
    logits = out["heatmap"].float()  # [B, K, Ho, Wo]
    reg = out["reg"].float()  # [B, G, R, Ho, Wo]
    focal = kernels.focal_loss(logits, t.heatmap)  # [] = S / max(1, local peaks)
    if num_peaks is not None:
        local = t.num_peaks.clamp(min=1).to(focal.dtype)
        focal = focal * local / num_peaks.clamp(min=1).to(focal.dtype) * world_size

    n = p.heading_bins
    pred = gather_objects(reg, t.index, t.group)  # [B, M, R]
    mask = t.mask.to(pred.dtype)  # [B, M]
    scale = world_size if num_objects is not None else 1
    n_obj = (num_objects if num_objects is not None else t.num_objects).clamp(min=1).to(pred.dtype)

    box_err = (pred[..., :6] - t.box).abs() * mask[..., None]  # [B, M, 6]
    per_channel = box_err.sum(dim=(0, 1)) / n_obj * scale  # [6]
    box = per_channel.sum()

    bin_logits = pred[..., 6 : 6 + n]  # [B, M, n]
    ce = F.cross_entropy(bin_logits.reshape(-1, n), t.bin.reshape(-1), reduction="none").reshape(t.bin.shape)
    dir_cls = (ce * mask).sum() / n_obj * scale

    res = pred[..., 6 + n :].reshape(*pred.shape[:2], n, 2)  # [B, M, n, 2]
    own = res.gather(2, t.bin[..., None, None].expand(*t.bin.shape, 1, 2))[:, :, 0]  # [B, M, 2]
    dir_res = ((own - t.res).abs().sum(-1) * mask).sum() / n_obj * scale

    total = (
        p.heatmap_weight * focal
        + p.box_weight * box
        + p.dir_cls_weight * dir_cls
        + p.dir_res_weight * dir_res
    )
    terms = {"loss": total, "heatmap": focal, "box": box, "dir_cls": dir_cls, "dir_res": dir_res}
    terms.update({f"box/{name}": per_channel[i] for i, name in enumerate(BOX_CHANNELS)})
    return terms
