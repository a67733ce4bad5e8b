"""Center-head loss: penalty-reduced focal loss on the heatmap + weighted L1 on the regressions.

In:  head outputs `{"heatmap": [B, K, Ho, Wo] logits, "reg": [B, R, Ho, Wo]}`, `Targets`, the weights.
Out: `{"loss": [] total, "heatmap": [] focal term, "reg": [] L1 term, "reg/<name>": [] per channel}`
(channel names: `ModelParams.reg_channels`, or `off_x, ..., cos` [+ `sin2, cos2`] by count).

Normalization. `kernels.focal_loss` divides by this batch's peak count and the L1 divides by this
batch's object count. Under DDP every process sees a slice of the global batch, and averaging
slice-normalized losses is not the global-batch loss. Passing the global counts (`num_peaks`,
`num_objects`, all-reduced by the caller) and `world_size` rescales each slice so that the DDP
gradient average equals the gradient of the single-process loss on the whole batch:
    loss_r = S_r / max(1, N_global) * world_size,   mean_r(loss_r) = sum_r S_r / max(1, N_global).
"""

from __future__ import annotations

from torch import Tensor

import kernels
from pfactory.archs.painted_pillars.targets import Targets

REG_NAMES = ("off_x", "off_y", "z", "log_l", "log_w", "log_h", "sin", "cos", "sin2", "cos2")


def detection_loss(
    out: dict[str, Tensor],
    targets: Targets,
    heatmap_weight: float = 1.0,
    reg_weight: float = 0.25,
    code_weights: list[float] | None = None,
    num_peaks: Tensor | None = None,
    num_objects: Tensor | None = None,
    world_size: int = 1,
) -> dict[str, Tensor]:
    """Loss terms (module docstring). `num_peaks`/`num_objects`: global counts under DDP, else None."""
    logits = out["heatmap"].float()  # [B, K, Ho, Wo]; fp32 loss also under bf16 autocast
    reg = out["reg"].float()  # [B, R, Ho, Wo]
    # kernels.focal_loss = S / max(1, local peaks); rescale to S / max(1, global peaks) * world_size.
    focal = kernels.focal_loss(logits, targets.heatmap)  # []
    if num_peaks is not None:
        local = targets.num_peaks.clamp(min=1).to(focal.dtype)  # []
        focal = focal * local / num_peaks.clamp(min=1).to(focal.dtype) * world_size  # []

    b, c = reg.shape[:2]
    m = targets.index.shape[1]
    if code_weights is not None and len(code_weights) != c:
        raise ValueError(
            f"train.reg_code_weights has {len(code_weights)} entries but the head regresses {c} channels "
            f"({', '.join(REG_NAMES[:c])}): give one weight per channel, or null for 1.0 each"
        )
    # Gather through the [B, H*W, R] view: the head's convs write channels-last memory, where that view
    # is free and its gradient flows back channels-last too (a flatten(2) copy made the backward of every
    # conv behind it convert layouts).
    rows = reg.permute(0, 2, 3, 1).reshape(b, -1, c)  # [B, Ho*Wo, R]
    pred = rows.gather(1, targets.index[:, :, None].expand(b, m, c))  # [B, M, R]
    err = (pred - targets.reg).abs() * targets.mask[..., None].to(pred.dtype)  # [B, M, R]
    per_channel = err.sum(dim=(0, 1))  # [R] summed over objects
    n_obj = (
        (num_objects if num_objects is not None else targets.num_objects).clamp(min=1).to(pred.dtype)
    )  # []
    per_channel = per_channel / n_obj * (world_size if num_objects is not None else 1)  # [R]
    w = per_channel.new_tensor(code_weights if code_weights is not None else [1.0] * c)  # [R]
    l1 = (per_channel * w).sum()  # []

    total = heatmap_weight * focal + reg_weight * l1  # []
    terms = {"loss": total, "heatmap": focal, "reg": l1}
    terms.update({f"reg/{name}": per_channel[i] for i, name in enumerate(REG_NAMES[:c])})
    return terms
