"""Train-stage loader over prepared shards: DALI pipeline (default) and a PyTorch reference.

```
loader = make_loader("artifacts/prepared", "train", batch_size=4, shuffle=True,
                     augment=AugmentParams(), seed=0, device="auto")
loader.set_epoch(epoch); loader.skip_batches(k)   # exact resume: same batches, same transforms
for batch in loader:  # Batch, tensors on the GPU when CUDA is present (DALI)
    batch.images      # [B, C, 3, H, W] float32 (normalized; C = manifest "cameras")
    batch.proj        # [B, C, 3, 4] float32, reference frame (augmented) -> image pixels
    batch.cam_valid   # [B, C] bool (False: the frame has no such camera; image/proj are 0)
    batch.points      # [B, Pmax, 4] float32, zero padded;  batch.num_points [B] int64
    batch.boxes       # [B, Mmax, 7] float32, zero padded;  batch.num_boxes [B] int64
    batch.labels      # [B, Mmax] int64: class index, -1 = not a training class or padding
    batch.aug         # [B, 4, 4] float32, the transform A applied to each frame
    batch.frame_ids   # list[str]
```
Order: rows of the split in manifest order, or with `shuffle` a block shuffle (row groups in
random order, rows shuffled within windows of `shuffle_window` row groups) so a batch reads a
few row groups instead of one per frame; deterministic in (seed, epoch).

DALI pipeline: a parallel batch `external_source` (`BatchSource`, in `workers` processes)
reads rows and draws each frame's transform (`pfactory.prepare.augment`), then DALI applies it
with three `fn.coord_transform`s -- points `[N, 4]` by `A` (intensity untouched), boxes
`[M, 7]` by one 7x7 affine map, projection rows `[3C, 4]` by `A^-T` (i.e. `P' = P A^-1`) --
casts images to float32 and pads points/boxes/labels to the batch maximum (`fn.pad`: DALI's
iterators refuse ragged outputs). On a GPU every op after the source runs on the device.
`TorchLoader` does the same with plain PyTorch ops from the same `BatchSource` samples: the
reference the DALI loader is tested against (tests/prepare/test_loader.py).

On CUDA the DALI pipeline is used only once it has verified itself on this machine (self-check
`dali.gpu_loader`, kernels/selfcheck.py: `check_gpu_loader`, a batch of a small prepared shard written for
the check, DALI on the GPU vs `TorchLoader` on the CPU, same frames and transforms); a failed check says
so in one warning line and `make_loader` returns the `TorchLoader` (batches moved to the GPU) instead.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pfactory.prepare.augment import AugmentParams
from pfactory.prepare.shards import (
    MANIFEST,
    SCHEMA_VERSION,
    PreparedFrame,
    SplitWriter,
    arrow_schema,
    open_shard,
)
from pfactory.prepare.source import BatchSource, Sample


@dataclass
class Batch:
    """One batch (see the module docstring for shapes)."""

    images: torch.Tensor
    proj: torch.Tensor
    cam_valid: torch.Tensor
    points: torch.Tensor
    num_points: torch.Tensor
    boxes: torch.Tensor
    labels: torch.Tensor
    num_boxes: torch.Tensor
    aug: torch.Tensor
    frame_ids: list[str]

    def to(self, device: str | torch.device) -> Batch:
        moved = {k: v.to(device) for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}
        return Batch(**moved, frame_ids=self.frame_ids)


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class _LoaderBase:
    """Epoch bookkeeping shared by both loaders: set_epoch / skip_batches / len."""

    def __init__(self, source: BatchSource, device: str):
        self.source = source
        self.device = _resolve_device(device)
        self.epoch = 0
        self._skip = 0
        self._frame_ids: list[str] | None = None

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration produces (transforms and order depend on it)."""
        self.epoch = int(epoch)

    def skip_batches(self, k: int) -> None:
        """Start the next iteration at batch `k` of the epoch (exact resume)."""
        self._skip = int(k)

    def __len__(self) -> int:
        return len(self.source)

    def frame_id(self, row: int) -> str:
        if self._frame_ids is None:
            ids: list[str] = []
            for path, rg, _, _ in self.source.groups:
                ids += open_shard(path).read_row_group(rg, columns=["frame_id"]).column(0).to_pylist()
            self._frame_ids = ids
        return self._frame_ids[row]


class TorchLoader(_LoaderBase):
    """The PyTorch reference: same samples and transforms, augmentation by plain tensor ops."""

    def __iter__(self) -> Iterator[Batch]:
        epoch, it = self.epoch, self._skip
        self._skip = 0
        while True:
            samples = self.source.samples(epoch, it)
            if not samples:
                break
            yield collate(samples, self.device)
            it += 1
        self.epoch = epoch + 1


def collate(samples: list[Sample], device: str = "cpu") -> Batch:
    """Augment (torch ops) and pad a list of samples into a Batch -- the reference semantics."""
    pts, bxs, lbs, projs, augs = [], [], [], [], []
    for s in samples:
        A = torch.from_numpy(s.transform.matrix)  # [4, 4] float64
        p = torch.from_numpy(s.points).double()  # [N, 4]
        pts.append(torch.cat([p[:, :3] @ A[:3, :3].T, p[:, 3:]], 1).float())
        b = torch.from_numpy(s.boxes).double().reshape(-1, 7)  # [M, 7]
        f = -1.0 if s.transform.flip else 1.0
        bxs.append(
            torch.cat(
                [b[:, :3] @ A[:3, :3].T, b[:, 3:6] * s.transform.scale, f * b[:, 6:] + s.transform.rotation],
                1,
            ).float()
        )
        lbs.append(torch.from_numpy(s.labels).long())
        projs.append((torch.from_numpy(s.proj).double() @ torch.linalg.inv(A)).float())  # [C, 3, 4]
        augs.append(A.float())
    n_pts = torch.tensor([len(p) for p in pts], dtype=torch.int64)
    n_box = torch.tensor([len(b) for b in bxs], dtype=torch.int64)
    pad = torch.nn.utils.rnn.pad_sequence
    batch = Batch(
        images=torch.from_numpy(np.stack([s.images for s in samples])).float(),
        proj=torch.stack(projs),
        cam_valid=torch.from_numpy(np.stack([s.cam_valid for s in samples])),
        points=pad(pts, batch_first=True) if max(n_pts) > 0 else torch.zeros(len(samples), 0, 4),
        num_points=n_pts,
        boxes=pad(bxs, batch_first=True) if max(n_box) > 0 else torch.zeros(len(samples), 0, 7),
        labels=pad(lbs, batch_first=True, padding_value=-1)
        if max(n_box) > 0
        else torch.zeros(len(samples), 0, dtype=torch.int64),
        num_boxes=n_box,
        aug=torch.stack(augs),
        frame_ids=[s.frame_id for s in samples],
    )
    return batch.to(device) if device != "cpu" else batch


def _plain_pickling_of_dali_worker_signals() -> None:
    """Let DALI's parallel workers report StopIteration/RuntimeError to the parent again.

    `tblib.pickling_support.install()` (run by `import distributed`, i.e. by Dask) registers a copyreg
    reducer for every exception class. Forked DALI workers inherit it and pickle their end-of-epoch
    StopIteration through tblib, and DALI's parent-side unpickler (which only admits the plain builtins)
    refuses it: the loader dies after the first epoch of any process that imported Dask. Dropping the
    reducer of these two classes restores the builtin pickling; Dask keeps tblib for every other class.
    """
    import copyreg

    for cls in (StopIteration, RuntimeError):
        reducer = copyreg.dispatch_table.get(cls)
        if reducer is not None and getattr(reducer, "__module__", "").startswith("tblib"):
            del copyreg.dispatch_table[cls]


class DaliLoader(_LoaderBase):
    """DALI pipeline over the shards (see the module docstring); GPU-resident on CUDA."""

    def __init__(self, source: BatchSource, device: str, num_threads: int = 2, workers: int = 2):
        super().__init__(source, device)
        self.num_threads = num_threads
        self.workers = workers
        self._pipe = None
        self._pipe_next: tuple[int, int] | None = None  # (epoch, iteration) the pipe yields next

    def _build(self, epoch: int, skip: int):
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline

        _plain_pickling_of_dali_worker_signals()
        gpu = self.device.startswith("cuda")
        src = BatchSource.__new__(BatchSource)
        src.__dict__.update(self.source.__getstate__())
        src.epoch_base, src.skip = epoch, skip
        pipe = Pipeline(
            batch_size=self.source.batch_size,
            num_threads=self.num_threads,
            device_id=(torch.device(self.device).index or torch.cuda.current_device()) if gpu else None,
            py_num_workers=self.workers,
            # fork starts a worker in ~0.6 s against ~3 s for spawn (which re-imports everything),
            # but a process that has initialised CUDA must not fork: spawn then.
            py_start_method="spawn" if gpu or torch.cuda.is_initialized() else "fork",
            prefetch_queue_depth=2,
        )
        F, I32, I64, U8 = types.FLOAT, types.INT32, types.INT64, types.UINT8
        with pipe:
            images, proj, valid, points, boxes, labels, M_pts, M_ctr, M_rest, T_rest, M_proj, row = (
                fn.external_source(
                    src,
                    num_outputs=12,
                    batch=True,
                    batch_info=True,
                    parallel=True,
                    prefetch_queue_depth=2,
                    dtype=[types.FLOAT16, F, U8, F, F, I32, F, F, F, F, F, I64],
                    ndim=[4, 2, 1, 2, 2, 1, 2, 2, 2, 1, 2, 1],
                )
            )
            n_pts, n_box = points.shape(), boxes.shape()
            if gpu:
                images, proj, points, boxes, labels = (x.gpu() for x in (images, proj, points, boxes, labels))
            images = fn.cast(images, dtype=F)
            points = fn.coord_transform(points, M=M_pts)  # [N, 4]: xyz by A, intensity kept
            boxes = fn.cat(  # [M, 7]
                fn.coord_transform(boxes[:, 0:3], M=M_ctr),  # centre by A
                fn.coord_transform(boxes[:, 3:7], M=M_rest, T=T_rest),  # size * s, f yaw + theta
                axis=1,
            )
            proj = fn.coord_transform(proj, M=M_proj)  # [3C, 4] rows: P' = P A^-1
            points = fn.pad(points, axes=[0], fill_value=0.0)
            boxes = fn.pad(boxes, axes=[0], fill_value=0.0)
            labels = fn.pad(labels, axes=[0], fill_value=-1)
            pipe.set_outputs(images, proj, valid, points, n_pts, boxes, labels, n_box, M_pts, row)
        pipe.build()
        return pipe

    def __iter__(self) -> Iterator[Batch]:
        epoch, skip = self.epoch, self._skip
        self._skip = 0
        if self._pipe is None or self._pipe_next != (epoch, skip):
            self._pipe = None  # drop the old pipeline (and its workers) first
            self._pipe = self._build(epoch, skip)
        self._pipe_next = None  # mid-epoch: an abandoned iteration forces a rebuild
        C = len(self.source.cameras)
        while True:
            try:
                outs = self._pipe.run()
            except StopIteration:
                break
            images, proj, valid, points, n_pts, boxes, labels, n_box, M_pts, row = (
                _to_torch(o, self.device) for o in outs
            )
            B = images.shape[0]
            # fn.pad of a batch of empty samples yields [B, 0, 0]: restore the row width.
            points = points.reshape(B, int(n_pts[:, 0].max()), 4)
            boxes = boxes.reshape(B, int(n_box[:, 0].max()), 7)
            labels = labels.reshape(B, boxes.shape[1])
            aug = M_pts.clone()
            aug[:, 3, 3] = 1.0
            yield Batch(
                images=images,
                proj=proj.reshape(B, C, 3, 4),
                cam_valid=valid.bool().reshape(B, C),
                points=points,
                num_points=n_pts[:, 0].long(),
                boxes=boxes,
                labels=labels.long(),
                num_boxes=n_box[:, 0].long(),
                aug=aug,
                frame_ids=[self.frame_id(int(r)) for r in row[:, 0].tolist()],
            )
        self._pipe.reset()
        self.epoch = epoch + 1
        self._pipe_next = (self.epoch, 0)


def _to_torch(tl: Any, device: str) -> torch.Tensor:
    """A dense DALI TensorList (CPU or GPU) -> a torch tensor on `device` (one copy)."""
    from nvidia.dali.backend import TensorListGPU

    if isinstance(tl, TensorListGPU):
        from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

        t = tl.as_tensor()
        out = torch.empty(t.shape(), dtype=to_torch_type[t.dtype], device=device)
        feed_ndarray(t, out, cuda_stream=torch.cuda.current_stream(out.device))
        return out
    t = torch.from_numpy(np.array(tl.as_tensor()))
    return t.to(device) if device != "cpu" else t


def make_loader(
    prepared_dir: str | Path,
    split: str,
    batch_size: int,
    shuffle: bool = False,
    augment: AugmentParams | None = None,
    seed: int = 0,
    device: str = "auto",
    num_threads: int = 2,
    workers: int = 2,
    drop_last: bool = False,
    shuffle_window: int = 4,
    backend: str = "dali",
) -> DaliLoader | TorchLoader:
    """A loader over `split` of a prepared directory (see the module docstring).

    `backend="torch"` gives the PyTorch reference (`TorchLoader`), same batches and transforms. The DALI
    pipeline on CUDA only once it has verified itself here (`gpu_loader_trusted`): else the reference.
    """
    source = BatchSource(
        prepared_dir, split, batch_size, shuffle, augment, seed, 0, 0, drop_last, shuffle_window
    )
    if backend == "torch":
        return TorchLoader(source, device)
    if backend != "dali":
        raise ValueError(f"backend must be 'dali' or 'torch', got {backend!r}")
    if not gpu_loader_trusted(_resolve_device(device)):
        return TorchLoader(source, device)
    return DaliLoader(source, device, num_threads, workers)


# ----------------------------------------------------------------------------------------------
# the self-check of the DALI GPU loader (kernels/selfcheck.py)

GPU_LOADER = "dali.gpu_loader"
BATCH_ATOL = {"proj": 1e-4, "points": 2e-5, "boxes": 2e-5}
"""Per field, max |DALI - reference| allowed: DALI's coord_transform computes in float32, the reference in
float64 then rounds (points and boxes ~1 ulp of their magnitude, projections with entries ~1e3 to 3e-5);
every other field exactly equal."""
BATCH_FIELDS = ("images", "proj", "cam_valid", "points", "num_points", "boxes", "labels", "num_boxes", "aug")
CHECK_IMAGE = (3, 8, 12)  # [3, H, W] of the check shard's images
_CHECK: Any = None


def gpu_loader_trusted(device: str) -> bool:
    """Whether the DALI loader may run on `device`: always on a device type the `dali.gpu_loader` check does
    not cover (the CPU: DALI's CPU pipeline is tested against the reference in the suite); on CUDA once the
    check has verified (`kernels.selfcheck.trusted`: run on first use, recorded, a failure said once)."""
    from kernels import selfcheck

    register_selfcheck()
    dev = torch.device(device)
    if dev.type not in selfcheck.checks()[GPU_LOADER].device_types:
        return True
    return selfcheck.trusted(GPU_LOADER, dev)


def register_selfcheck() -> None:
    """Register the DALI GPU loader's check (`factory doctor` calls it; so does the first use); a check
    registered under its name by someone else (a test's planted one) is left in place."""
    from kernels import selfcheck

    if GPU_LOADER not in selfcheck.checks():
        selfcheck.register(gpu_loader_check())


def gpu_loader_check() -> Any:
    """The `kernels.selfcheck.Check` of the DALI GPU loader (`check_gpu_loader` on CUDA devices; its
    fingerprint hashes this module, the sample source, the augmentation and DALI's version)."""
    global _CHECK
    from kernels import selfcheck

    if _CHECK is None:
        from pfactory.prepare import augment, source

        files = [__file__, source.__file__, augment.__file__]
        _CHECK = selfcheck.Check(
            GPU_LOADER,
            check_gpu_loader,
            lambda: selfcheck.sources_hash(files, _dali_version()),
            ("cuda",),
            "a DALI GPU batch of a small shard vs the PyTorch loader's on the CPU, augmented",
        )
    return _CHECK


def _dali_version() -> str:
    from pfactory.prepare.camera import _dali_version as version

    return version()


def check_frames(frames: int = 6, seed: int = 0) -> list[PreparedFrame]:
    """Seeded prepared frames for the loader check: 2 cameras (one frame without the second), 10-60 points
    in a 40 m square, 0-3 boxes (one frame without any), float16 images of CHECK_IMAGE."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(frames):
        cams = ["CAM_A", "CAM_B"] if i != 2 else ["CAM_A"]
        c, n, m = len(cams), int(rng.integers(10, 60)), 0 if i == 3 else int(rng.integers(1, 4))
        pts = np.c_[rng.uniform(-20, 20, (n, 2)), rng.uniform(-2, 1, (n, 1)), rng.uniform(0, 1, (n, 1))]
        boxes = np.c_[rng.uniform(-15, 15, (m, 2)), rng.uniform(-1.5, 0, (m, 1)), rng.uniform(0.5, 4, (m, 3)),
                      rng.uniform(-np.pi, np.pi, (m, 1))]  # fmt: skip
        labels = rng.integers(0, 2, m).astype(np.int16)
        proj = np.concatenate([rng.uniform(-50, 50, (c, 3, 3)), rng.uniform(-5, 5, (c, 3, 1))], axis=2)
        out.append(
            PreparedFrame(
                f"check-{i:02d}", "train", "selfcheck", "0" * 64, np.eye(4), pts.astype(np.float32), n, cams,
                [rng.standard_normal(CHECK_IMAGE).astype(np.float16) for _ in range(c)], proj, np.ones((c, 3, 3)),
                np.tile(np.eye(4), (c, 1, 1)), np.full((c, 2), 24, np.int32), np.full((c, 2), 12, np.int32),
                np.full((c, 2), 0.5), boxes.astype(np.float32), labels,
                [("Car", "Pedestrian")[k] for k in labels], np.zeros(m, np.int8), np.ones(m, np.int32),
            )
        )  # fmt: skip
    return out


def write_prepared(root: Path, frames: list[PreparedFrame]) -> Path:
    """A prepared directory (train split, one shard, two row groups) holding `frames`: the check's data."""
    writer = SplitWriter(root, "train", arrow_schema(CHECK_IMAGE), max_frames=len(frames), row_group_frames=3)
    for f in frames:
        writer.add(f)
    shards = writer.close()
    manifest = {
        "schema_version": SCHEMA_VERSION, "passed": True, "image": {"shape": list(CHECK_IMAGE)},
        "cameras": ["CAM_A", "CAM_B"], "classes": ["Car", "Pedestrian"],
        "splits": {"train": {"frames": len(frames), "shards": [{"file": s.file} for s in shards]}},
    }  # fmt: skip
    (root / MANIFEST).write_text(json.dumps(manifest))
    return root


def check_batch(root: Path, device: str, backend: str) -> Batch:
    """The first batch (4 frames, shuffled, augmented, seed 0) of the check directory `root`, by the DALI
    loader on `device` (`backend` "dali") or the PyTorch reference: no gate (the check is what gates)."""
    source = BatchSource(root, "train", 4, True, AugmentParams(), 0, 0, 0, False, 4)
    loader = DaliLoader(source, device, 1, 1) if backend == "dali" else TorchLoader(source, device)
    return next(iter(loader))


def compare_batches(got: Batch, want: Batch) -> dict[str, float]:
    """figures[field] = max |got - want| of every Batch field (`BATCH_ATOL`, else 0); raises
    `selfcheck.Mismatch` on the first field over its tolerance, a dtype or a frame order that differs."""
    from kernels import selfcheck

    figures: dict[str, float] = {}
    if got.frame_ids != want.frame_ids:
        raise selfcheck.Mismatch(f"frame ids {got.frame_ids} != {want.frame_ids}", figures)
    for name in BATCH_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if a.dtype != b.dtype:
            raise selfcheck.Mismatch(f"{name}: dtype {a.dtype} != {b.dtype}", figures)
        selfcheck.compare(figures, name, a, b, BATCH_ATOL.get(name, 0.0))
    return figures


def check_gpu_loader(device: Any) -> dict[str, float]:
    """The DALI loader on `device` vs the PyTorch loader on the CPU: the first batch of a small prepared
    shard (`check_frames`, written to a temporary folder), every field within `BATCH_ATOL`."""
    from kernels import selfcheck
    from pfactory.prepare.camera import dali_available

    dev = torch.device(device)
    if not dali_available():
        raise selfcheck.Skip("NVIDIA DALI is not installed")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise selfcheck.Skip("no CUDA device")
    with tempfile.TemporaryDirectory(prefix="pfk-loader-check-") as tmp:
        root = write_prepared(Path(tmp), check_frames())
        return compare_batches(check_batch(root, str(dev), "dali"), check_batch(root, "cpu", "torch"))
