"""Reading prepared shards for training: `BatchSource`, shared by both loaders (no torch import).

`BatchSource` maps `(epoch, iteration)` to the frames of one batch and each frame's augmentation
(see `pfactory.prepare.loader` for the order and the transforms). It is what DALI's parallel
`external_source` runs in its worker processes, so this module imports only NumPy, PyArrow and
the shard/augment modules: a worker starts in well under a second.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from pfactory.prepare.augment import AugmentParams, GlobalTransform, sample_transform
from pfactory.prepare.shards import fixed_rows, image_rows, open_prepared, open_shard, prim_rows

COLUMNS = ["frame_id", "points", "cam_names", "cam_image", "cam_P", "boxes", "labels"]


@dataclass
class Sample:
    """One frame as the source reads it, before augmentation (camera slots in manifest order)."""

    row: int
    frame_id: str
    images: np.ndarray  # [C, 3, H, W] float16
    proj: np.ndarray  # [C, 3, 4] float32
    cam_valid: np.ndarray  # [C] bool
    points: np.ndarray  # [N, 4] float32
    boxes: np.ndarray  # [M, 7] float32
    labels: np.ndarray  # [M] int32
    transform: GlobalTransform


class BatchSource:
    """Stateless batch reader over one split: `(epoch, iteration) -> samples`.

    Picklable (DALI sends it to its worker processes); each process opens the shards lazily
    and keeps an LRU cache of decoded row groups. Also DALI's parallel `external_source`
    callback: `__call__(BatchInfo)` returns the per-output lists.
    """

    def __init__(
        self,
        root: str | Path,
        split: str,
        batch_size: int,
        shuffle: bool,
        augment: AugmentParams | None,
        seed: int,
        epoch_base: int = 0,
        skip: int = 0,
        drop_last: bool = False,
        shuffle_window: int = 4,
    ):
        ds = open_prepared(root)
        self.root = str(root)
        self.split = split
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.augment = augment
        self.seed = seed
        self.epoch_base = epoch_base
        self.skip = skip
        self.drop_last = drop_last
        self.shuffle_window = max(1, shuffle_window)
        self.cameras = ds.cameras
        self.image_shape = ds.image_shape
        # (path, row group, first global row, rows) for every row group of the split.
        self.groups: list[tuple[str, int, int, int]] = []
        start = 0
        for path in ds.shard_paths(split):
            md = open_shard(path).metadata
            for rg in range(md.num_row_groups):
                n = md.row_group(rg).num_rows
                self.groups.append((str(path), rg, start, n))
                start += n
        self.num_rows = start
        self._starts = [grp[2] for grp in self.groups]
        self._cache: collections.OrderedDict[tuple[str, int], dict[str, Any]] = collections.OrderedDict()
        self._files: dict[str, pq.ParquetFile] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = collections.OrderedDict()
        state["_files"] = {}
        return state

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> np.ndarray:
        """Global row indices of `epoch` in iteration order `[num_rows]` int64."""
        if not self.shuffle:
            return np.arange(self.num_rows, dtype=np.int64)
        rng = np.random.default_rng([self.seed, epoch, 0x5EED])
        perm = rng.permutation(len(self.groups))
        out = []
        for w in range(0, len(perm), self.shuffle_window):
            rows = np.concatenate(
                [
                    np.arange(self.groups[g][2], self.groups[g][2] + self.groups[g][3])
                    for g in perm[w : w + self.shuffle_window]
                ]
            )
            out.append(rng.permutation(rows))
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)

    def rows_of(self, epoch: int, iteration: int) -> np.ndarray:
        """Rows of batch `iteration` of `epoch` (empty past the end)."""
        rows = self.order(epoch)[iteration * self.batch_size : (iteration + 1) * self.batch_size]
        if self.drop_last and len(rows) < self.batch_size:
            return rows[:0]
        return rows

    def _group(self, key: tuple[str, int]) -> dict[str, Any]:
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        path, rg = key
        pf = self._files.get(path)
        if pf is None:
            pf = self._files[path] = open_shard(path)
        t = pf.read_row_group(rg, columns=COLUMNS)
        decoded = {
            "frame_id": t.column("frame_id").to_pylist(),
            "points": fixed_rows(t.column("points"), 4, np.float32),
            "cam_names": t.column("cam_names").to_pylist(),
            "cam_image": image_rows(t.column("cam_image"), self.image_shape),
            "cam_P": fixed_rows(t.column("cam_P"), 12, np.float64),
            "boxes": fixed_rows(t.column("boxes"), 7, np.float32),
            "labels": prim_rows(t.column("labels"), np.int32),
        }
        self._cache[key] = decoded
        while len(self._cache) > self.shuffle_window + 1:
            self._cache.popitem(last=False)
        return decoded

    def sample(self, row: int, epoch: int) -> Sample:
        """One frame of the split with its transform for `epoch`."""
        g = bisect.bisect_right(self._starts, row) - 1  # the row group holding `row`
        path, rg, start, _ = self.groups[g]
        d = self._group((path, rg))
        i = row - start
        C = len(self.cameras)
        images = np.zeros((C, *self.image_shape), dtype=np.float16)
        proj = np.zeros((C, 3, 4), dtype=np.float32)
        valid = np.zeros(C, dtype=bool)
        for k, name in enumerate(d["cam_names"][i]):
            c = self.cameras.index(name)
            images[c] = d["cam_image"][i][k]
            proj[c] = d["cam_P"][i][k].reshape(3, 4)
            valid[c] = True
        return Sample(
            row=int(row),
            frame_id=d["frame_id"][i],
            images=images,
            proj=proj,
            cam_valid=valid,
            points=np.array(d["points"][i]),  # copies: samples outlive the row-group cache
            boxes=np.array(d["boxes"][i]),
            labels=d["labels"][i].astype(np.int32),
            transform=sample_transform(self.augment, self.seed, epoch, int(row)),
        )

    def samples(self, epoch: int, iteration: int) -> list[Sample]:
        return [self.sample(int(r), epoch) for r in self.rows_of(epoch, iteration)]

    def __call__(self, batch_info: Any) -> tuple[list[np.ndarray], ...]:
        """DALI callback: BatchInfo(iteration, epoch_idx) -> one list per pipeline input."""
        epoch = self.epoch_base + batch_info.epoch_idx
        iteration = batch_info.iteration + (self.skip if batch_info.epoch_idx == 0 else 0)
        samples = self.samples(epoch, iteration)
        if not samples:
            raise StopIteration
        out: tuple[list[np.ndarray], ...] = tuple([] for _ in range(12))
        for s in samples:
            A = s.transform.matrix
            M_pts = np.eye(4, dtype=np.float32)
            M_pts[:3, :3] = A[:3, :3]  # intensity (4th column) passes through
            # coord_transform handles up to 6 dimensions: the 7x7 box map goes in two blocks,
            # centre (x, y, z) by A and (l, w, h, yaw) by diag(s, s, s, f) + (0, 0, 0, theta).
            M_box, T_box = s.transform.box_matrix
            M_proj = np.linalg.inv(A).T  # P rows r -> A^-T r, i.e. P' = P A^-1
            for lst, arr in zip(
                out,
                (
                    s.images,
                    s.proj.reshape(-1, 4),
                    s.cam_valid.astype(np.uint8),
                    s.points,
                    s.boxes,
                    s.labels,
                    M_pts,
                    M_box[:3, :3].astype(np.float32),
                    M_box[3:, 3:].astype(np.float32),
                    T_box[3:].astype(np.float32),
                    M_proj.astype(np.float32),
                    np.array([s.row], dtype=np.int64),
                ),
            ):
                lst.append(np.ascontiguousarray(arr))
        return out
