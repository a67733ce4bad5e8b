"""Prepared frames -> runner feeds: calibration frames (train split) and held-out frames (val split).

In:  a prepared directory (`paths.prepared`), a split, a batch size, a frame budget.
Out: `FrameFeeds(feeds, frame_ids)`: `feeds[i]` = {"points" [B, P, 4] float32, "num_points" [B] int64,
     "images" [B, N, 3, H, W] float32, "proj" [B, N, 3, 4] float32} -- the export's inputs, exactly what
     the loader gives the train/evaluate stages (no augmentation, manifest order), P = the batch's
     largest point count.

Uses the loader's PyTorch reference path (`backend="torch"`): same batches as the DALI path (the data
tests hold them equal), no pipeline start-up for the few dozen frames read here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pfactory.optimize.feed import Feed


@dataclass
class FrameFeeds:
    """Feeds and the frame ids of each feed's rows."""

    feeds: list[Feed] = field(default_factory=list)
    frame_ids: list[list[str]] = field(default_factory=list)

    @property
    def num_frames(self) -> int:
        return sum(len(ids) for ids in self.frame_ids)

    def all_frame_ids(self) -> list[str]:
        return [f for ids in self.frame_ids for f in ids]


def batch_to_feed(batch: object, keep: int | None = None) -> Feed:
    """A loader `Batch` -> a numpy feed (first `keep` frames), points cut to the batch's max count."""
    n = batch.points.shape[0] if keep is None else keep  # type: ignore[attr-defined]
    num_points = batch.num_points[:n].cpu().numpy().astype(np.int64)  # type: ignore[attr-defined]  # [B]
    p = max(1, int(num_points.max()) if n else 1)  # P >= 1: the export's point dim starts at 1
    points = batch.points[:n, :p].cpu().numpy().astype(np.float32)  # type: ignore[attr-defined]  # [B, P, 4]
    if points.shape[1] < p:  # a batch of empty frames: one zero row, num_points 0 ignores it
        points = np.zeros((n, p, 4), dtype=np.float32)
    return {
        "points": np.ascontiguousarray(points),
        "num_points": num_points,
        "images": np.ascontiguousarray(batch.images[:n].cpu().numpy().astype(np.float32)),  # type: ignore[attr-defined]
        "proj": np.ascontiguousarray(batch.proj[:n].cpu().numpy().astype(np.float32)),  # type: ignore[attr-defined]
    }


def pad_points(feed: Feed, points: int) -> Feed:
    """`feed` with `points` padded with zero rows / truncated to exactly `points` rows, num_points clipped.

    For consumers that need one input shape for every frame (TensorRT implicit calibration, ORT's
    histogram calibrators). Padding rows are ignored by the model (rows >= num_points); truncation
    drops the highest-indexed points of a large frame.
    """
    pts = feed["points"]  # [B, P, 4]
    b, p, c = pts.shape
    if p < points:
        pts = np.concatenate([pts, np.zeros((b, points - p, c), dtype=pts.dtype)], axis=1)
    else:
        pts = pts[:, :points]
    out = dict(feed)
    out["points"] = np.ascontiguousarray(pts)
    out["num_points"] = np.minimum(feed["num_points"], points).astype(feed["num_points"].dtype)
    return out


def load_feeds(
    prepared_dir: str | Path, split: str, batch_size: int, max_frames: int, num_threads: int = 2
) -> FrameFeeds:
    """Up to `max_frames` frames of `split`, in manifest order, as feeds of `batch_size` frames."""
    from pfactory.prepare.loader import make_loader

    loader = make_loader(
        prepared_dir, split, batch_size=batch_size, shuffle=False, augment=None, seed=0,
        device="cpu", num_threads=num_threads, backend="torch",
    )  # fmt: skip
    out = FrameFeeds()
    for batch in loader:
        left = max_frames - out.num_frames
        if left <= 0:
            break
        keep = min(left, len(batch.frame_ids))
        out.feeds.append(batch_to_feed(batch, keep))
        out.frame_ids.append([str(f) for f in batch.frame_ids[:keep]])
    if not out.feeds:
        from pfactory.prepare.errors import SchemaError  # a ValueError: bad input data, one line at the CLI

        raise SchemaError(
            f"{prepared_dir}: split {split!r} has no frames (optimize.parity.split / int8.calibration_split): "
            "prepare with a larger prepare.val_fraction, or point the split elsewhere"
        )
    return out


def rebatch(frames: FrameFeeds, batch_size: int, max_frames: int) -> FrameFeeds | None:
    """The first `max_frames` frames of single-frame `frames` as feeds of `batch_size` frames, exactly what
    `load_feeds(..., batch_size, max_frames)` reads from the same split (points zero-padded to the batch's
    largest count, as the loader pads), without reading or decoding the frames again; None when `frames`
    is not one frame per feed or holds fewer than `max_frames` frames (then read them with `load_feeds`)."""
    if any(len(ids) != 1 for ids in frames.frame_ids) or frames.num_frames < max_frames or batch_size < 1:
        return None
    out = FrameFeeds()
    for start in range(0, max_frames, batch_size):
        group = frames.feeds[start : min(start + batch_size, max_frames)]
        num_points = np.concatenate([f["num_points"] for f in group])  # [B]
        p = max(1, int(num_points.max()))
        points = np.zeros((len(group), p, 4), dtype=np.float32)  # [B, P, 4]
        for i, f in enumerate(group):
            n = min(p, f["points"].shape[1])
            points[i, :n] = f["points"][0, :n]
        feed = {"points": points, "num_points": num_points}
        feed.update({k: np.concatenate([f[k] for f in group]) for k in ("images", "proj")})
        out.feeds.append(feed)
        out.frame_ids.append([ids[0] for ids in frames.frame_ids[start : start + len(group)]])
    return out
