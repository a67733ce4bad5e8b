"""One kind's boxes of an evaluation as columns, read back from the Parquet parts the driver already wrote.

The driver keeps no detections while the units land (`evaluation._run_models` writes each unit's boxes to
`report/.parts/` and keeps its frame ids and timings); scoring reads them back here, one kind at a time:

    boxes = SplitBoxes.read(parts, "optimized", frame_ids)     # every frame, sorted by id, its rows by rank
    gt_flat, pred_flat = flat_pair(gt_boxes, boxes, classes)   # what `flatten_frames` makes of the frames
    frames = boxes.frames()                                    # FrameDetections, built one at a time

In:  a `predictions.PartWriter` whose parts hold a kind's rows (`predictions.SCHEMA`), the evaluated frame
     ids (frames without a box have no row), the evaluated classes.
Out: `SplitBoxes`: float64 boxes `[N, 7]`, int32 name codes and float64 scores in (frame id, rank) order;
     its `FlatBoxes` equal `matching.flatten_frames` of the same frames sorted by id, array for array
     (the devkit's tie rule depends on that order); `FrameList`, a sequence of `FrameDetections` views.
The float64 values round-trip exactly through Parquet, so the KPIs are those of the worker's frames.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from pfactory.metrics.detection import FrameDetections
from pfactory.metrics.matching import FlatBoxes, flat_rows

BOX_COLUMNS = ("x", "y", "z", "l", "w", "h", "yaw")


@dataclass
class SplitBoxes:
    """A kind's boxes of the evaluated frames (module docstring): frame `i` owns rows `starts[i]:starts[i+1]`."""

    frame_ids: list[str]  # [F] sorted; every evaluated frame, with or without boxes
    starts: np.ndarray  # [F + 1] int64 row offsets
    boxes: np.ndarray  # [N, 7] float64
    codes: np.ndarray  # [N] int32 index into vocab
    vocab: np.ndarray  # [V] str: the names that occur
    scores: np.ndarray | None  # [N] float64; None for ground truth

    @property
    def counts(self) -> np.ndarray:
        """`[F]` boxes per frame."""
        return np.diff(self.starts)

    @classmethod
    def read(cls, parts: Any, kind: str, frame_ids: Sequence[str]) -> SplitBoxes:
        """The rows of `kind` in `parts` (a `PartWriter`) for the frames `frame_ids` (sorted here).

        Raises RuntimeError when a row names a frame not in `frame_ids` or a frame's ranks are not
        0, 1, ..., n-1 (a part written twice or cut short)."""
        ids = sorted(frame_ids)
        pos = {f: i for i, f in enumerate(ids)}
        vocab: dict[str, int] = {}
        frame, rank, boxes, codes, scores = [], [], [], [], []
        for table in parts.tables(kind):
            fid = table.column("frame_id").combine_chunks().dictionary_encode()
            try:
                fmap = np.array([pos[f] for f in fid.dictionary.to_pylist()], dtype=np.int64)
            except KeyError as e:
                raise RuntimeError(
                    f"evaluate: {kind} rows of frame {e.args[0]!r}, not an evaluated frame"
                ) from None
            frame.append(fmap[fid.indices.to_numpy(zero_copy_only=False)])
            rank.append(table.column("rank").to_numpy().astype(np.int64))
            name = table.column("name").combine_chunks().dictionary_encode()
            nmap = np.array([vocab.setdefault(n, len(vocab)) for n in name.dictionary.to_pylist()], np.int32)
            codes.append(nmap[name.indices.to_numpy(zero_copy_only=False)])
            boxes.append(
                np.column_stack([table.column(k).to_numpy() for k in BOX_COLUMNS]).astype(np.float64)
            )
            if kind != "ground_truth":
                scores.append(table.column("score").to_numpy().astype(np.float64))
        frame_a = np.concatenate(frame) if frame else np.zeros(0, np.int64)
        rank_a = np.concatenate(rank) if rank else np.zeros(0, np.int64)
        order = np.lexsort((rank_a, frame_a))  # frames by id, each frame's rows by rank
        counts = np.bincount(frame_a, minlength=len(ids))
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        expected = np.arange(len(frame_a), dtype=np.int64) - np.repeat(starts[:-1], counts)
        if not np.array_equal(rank_a[order], expected):
            raise RuntimeError(f"evaluate: the {kind} parts hold a frame whose ranks are not 0..n-1")
        return cls(
            ids,
            starts,
            np.concatenate(boxes)[order] if boxes else np.zeros((0, 7)),
            np.concatenate(codes)[order] if codes else np.zeros(0, np.int32),
            np.array(list(vocab), dtype=str),
            (np.concatenate(scores)[order] if scores else np.zeros(0)) if kind != "ground_truth" else None,
        )

    def flat(self, classes: Sequence[str], frame_index: dict[str, int]) -> FlatBoxes:
        """`matching.flatten_frames(self.frames(), classes, ...)`: the boxes of `classes`, frames numbered by
        `frame_index` (extended with the frames it lacks, in id order), scores zero for ground truth."""
        index = dict(frame_index)
        fmap = np.array([index.setdefault(f, len(index)) for f in self.frame_ids], dtype=np.int64)
        lookup = np.array([list(classes).index(v) if v in classes else -1 for v in self.vocab], np.int64)
        counts = self.counts
        cls = lookup[self.codes] if len(self.codes) else np.zeros(0, np.int64)
        score = self.scores if self.scores is not None else np.zeros(len(self.codes))
        return flat_rows(np.repeat(fmap, counts), cls, self.boxes, score, counts, index)

    def frame(self, i: int) -> FrameDetections:
        """Frame `i` as a `FrameDetections` (boxes and scores are views of the columns)."""
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        scores = self.scores[a:b] if self.scores is not None else None
        return FrameDetections.checked(
            self.frame_ids[i], self.boxes[a:b], self.vocab[self.codes[a:b]], scores
        )

    def frames(self) -> FrameList:
        """Every frame, sorted by id, as a sequence of `FrameDetections` built when read."""
        return FrameList(self)


class FrameList(Sequence[FrameDetections]):
    """The frames of a `SplitBoxes` as a read-only sequence; each item is built when it is read."""

    def __init__(self, boxes: SplitBoxes) -> None:
        self.boxes = boxes

    def __len__(self) -> int:
        return len(self.boxes.frame_ids)

    @overload
    def __getitem__(self, i: int) -> FrameDetections: ...

    @overload
    def __getitem__(self, i: slice) -> list[FrameDetections]: ...

    def __getitem__(self, i: int | slice) -> FrameDetections | list[FrameDetections]:
        if isinstance(i, slice):
            return [self.boxes.frame(j) for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.boxes.frame(i % len(self))

    def __iter__(self) -> Iterator[FrameDetections]:
        return (self.boxes.frame(i) for i in range(len(self)))


def flat_pair(gt: SplitBoxes, pred: SplitBoxes, classes: Sequence[str]) -> tuple[FlatBoxes, FlatBoxes]:
    """`(gt, pred)` flattened as `detection.evaluate_detections` flattens the frames sorted by id: ground-truth
    frames numbered first, then frames with predictions only."""
    g = gt.flat(classes, {})
    return g, pred.flat(classes, g.frame_index)
