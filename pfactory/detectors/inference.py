"""Batched inference over a loader -> per-frame detections, and the KPIs of the evaluate stage.

In:  a detector (any architecture: only the contract, `pfactory.detectors.contract`), batches in the loader's format (`points`, `num_points`, `images`, `proj`, `cam_valid`,
     `boxes`, `labels`, `num_boxes`, `frame_ids`), the class names.
Out: `(gt_frames, pred_frames)` as `pfactory.metrics.FrameDetections` (lidar frame, float64), and
     `evaluate_kpis(...)` -> the `DetectionKpis` of `pfactory.metrics.evaluate_detections` (nuScenes AP at
     0.5/1/2/4 m, TP errors, per class and per range), the same function the evaluate stage scores with.
GT keeps only boxes of the training classes (label >= 0): the KPIs ignore every other class anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from pfactory.detectors.contract import batch_inputs
from pfactory.metrics import DetectionKpis, FrameDetections, KpiParams, evaluate_detections


def frames_from_batch(
    batch: dict[str, Any],
    boxes: torch.Tensor,  # [B, D, 7]
    scores: torch.Tensor,  # [B, D]
    labels: torch.Tensor,  # [B, D]
    classes: Sequence[str],
    score_threshold: float,
) -> tuple[list[FrameDetections], list[FrameDetections]]:
    """GT and predicted `FrameDetections` of one batch (predictions below `score_threshold` dropped)."""
    names = np.asarray(classes)
    gts, preds = [], []
    gt_boxes = batch["boxes"].detach().cpu().double().numpy()  # [B, M, 7]
    gt_labels = batch["labels"].detach().cpu().numpy()  # [B, M]
    n_boxes = batch["num_boxes"].detach().cpu().numpy() if "num_boxes" in batch else None  # [B]
    boxes_np = boxes.detach().cpu().double().numpy()  # [B, D, 7]
    scores_np = scores.detach().cpu().double().numpy()  # [B, D]
    labels_np = labels.detach().cpu().numpy()  # [B, D]
    for i, fid in enumerate(batch["frame_ids"]):
        m = gt_labels.shape[1] if n_boxes is None else int(n_boxes[i])
        lab = gt_labels[i, :m]
        keep = (lab >= 0) & (lab < len(names))
        gts.append(FrameDetections(str(fid), gt_boxes[i, :m][keep], names[lab[keep]]))
        keep = scores_np[i] >= score_threshold
        pb = boxes_np[i][keep]
        pb[:, 3:6] = np.maximum(pb[:, 3:6], 1e-3)  # the KPI code refuses sizes <= 0
        preds.append(FrameDetections(str(fid), pb, names[labels_np[i][keep]], scores_np[i][keep]))
    return gts, preds


@torch.no_grad()
def predict(
    model: nn.Module,
    batches: Iterable[dict[str, Any]],
    classes: Sequence[str],
    score_threshold: float = 0.05,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
) -> tuple[list[FrameDetections], list[FrameDetections]]:
    """Run `model` (a detector, not DDP-wrapped: its `forward` then `decode`) over `batches`; returns (gt, pred)
    frames."""
    was_training = model.training
    model.eval()
    device = torch.device(device)
    gts: list[FrameDetections] = []
    preds: list[FrameDetections] = []
    try:
        for batch in batches:
            if not isinstance(batch, dict):  # pfactory.prepare.loader.Batch
                batch = dict(vars(batch))
            t = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
            with torch.autocast(
                device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None
            ):
                out = model(*batch_inputs(model, t))
            boxes, scores, labels = model.decode(out)  # [B, D, 7], [B, D], [B, D]
            g, p = frames_from_batch(batch, boxes, scores, labels, classes, score_threshold)
            gts += g
            preds += p
    finally:
        model.train(was_training)
    return gts, preds


def evaluate_kpis(
    gts: Sequence[FrameDetections], preds: Sequence[FrameDetections], classes: Sequence[str]
) -> DetectionKpis:
    """nuScenes-style KPIs (pfactory.metrics) of the predictions for `classes`."""
    return evaluate_detections(gts, preds, KpiParams(classes=tuple(classes)))


