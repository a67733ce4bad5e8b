"""Optimizer and learning-rate schedule: AdamW (no decay on norms and biases), warm-up then
cosine (`onecycle`, as torch's OneCycleLR) or `constant`."""

from __future__ import annotations

import math

import torch
from torch import nn

from pfactory.train.params import TrainParams


def make_optimizer(model: nn.Module, tp: TrainParams) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms and biases (1-d parameters), as is standard."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": tp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tp.lr, betas=tuple(tp.betas), foreach=True)


def lr_factor(step: int, total: int, tp: TrainParams) -> float:
    """Learning-rate multiplier at optimizer step `step` (0-based) of `total`."""
    lo = tp.min_lr_ratio
    warm = round(tp.warmup_fraction * total)
    if step < warm:
        t = (step + 1) / warm
        if tp.schedule == "onecycle":  # cosine ramp up, as torch's OneCycleLR
            return lo + (1 - lo) * (1 - math.cos(math.pi * t)) / 2
        return lo + (1 - lo) * t
    if tp.schedule == "constant":
        return 1.0
    t = (step - warm) / max(1, total - warm)
    return lo + (1 - lo) * (1 + math.cos(math.pi * min(1.0, t))) / 2
