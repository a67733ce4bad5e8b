"""The prepared data as the training loop sees it: the manifest summary, the shard loader (DALI
or its PyTorch reference), batches of an epoch with exact resume, and each DDP process's share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pfactory.detectors.contract import DataSpec
from pfactory.prepare.params import PrepareParams
from pfactory.storage import artifacts as af
from pfactory.storage.fsutil import sha256_file
from pfactory.train.params import TrainParams
from pfactory.train.runtime import Runtime


@dataclass
class DataInfo:
    """What the loop needs to know about the prepared data."""

    classes: list[str]
    cameras: list[str]
    image_size: tuple[int, int]  # (W, H) of the model-input images
    train_frames: int
    val_frames: int
    fingerprint: str  # sha256 of manifest.json: a resumed run must see the same data
    pc_range: list[float] | None = None  # the prepare stage's crop (manifest params), lidar frame, m

    def spec(self) -> DataSpec:
        """What the detector is built for (`pfactory.detectors.contract.DataSpec`); a manifest without a
        recorded crop means prepare's default range."""
        pc_range = self.pc_range if self.pc_range is not None else PrepareParams().pc_range
        return DataSpec(tuple(self.classes), tuple(float(v) for v in pc_range),  # type: ignore[arg-type]
                        (int(self.image_size[0]), int(self.image_size[1])), tuple(self.cameras))  # fmt: skip


LoaderFactory = Callable[..., Any]
"""`(data, split, batch_size, shuffle, augment, seed, device, num_threads) -> loader` with `len()`,
`set_epoch(e)`, `skip_batches(k)` and iteration yielding batches (`pfactory.prepare.loader.Batch` or dicts)."""


def data_info(data: Path) -> DataInfo:
    """Read the prepared manifest (refuses a newer schema with the prepare stage's message)."""
    from pfactory.prepare.shards import open_prepared

    ds = open_prepared(data)
    _, h, w = ds.image_shape
    return DataInfo(
        classes=ds.classes,
        cameras=ds.cameras,
        image_size=(w, h),
        train_frames=ds.num_frames("train"),
        val_frames=ds.num_frames("val") if "val" in ds.manifest["splits"] else 0,
        fingerprint=sha256_file(Path(data) / af.PREPARED_MANIFEST),
        pc_range=ds.manifest.get("params", {}).get("pc_range"),
    )


def make_loader_factory(tp: TrainParams) -> LoaderFactory:
    """The shard loader of `train.loader` (DALI or its PyTorch reference: the same batches)."""

    def factory(data: Path, split: str, batch_size: int, shuffle: bool, augment: Any, seed: int,
                device: torch.device, num_threads: int) -> Any:  # fmt: skip
        from pfactory.prepare.loader import make_loader

        backend = tp.loader if tp.loader != "auto" else ("dali" if device.type == "cuda" else "torch")
        return make_loader(
            data, split, batch_size=batch_size, shuffle=shuffle, augment=augment, seed=seed, device=device.type,
            num_threads=num_threads, workers=tp.loader_workers, backend=backend,
        )  # fmt: skip

    return factory


def epoch_batches(loader: Any, epoch: int, skip: int) -> Iterator[dict[str, Any]]:
    """Batches of `epoch` as dicts, the first `skip` left out without loading them (exact resume)."""
    loader.set_epoch(epoch)
    loader.skip_batches(skip)
    for batch in loader:
        yield batch if isinstance(batch, dict) else dict(vars(batch))  # pfactory.prepare.loader.Batch -> dict


def rank_slice(batch: dict[str, Any], rt: Runtime) -> dict[str, Any]:
    """This process's contiguous share of the global batch (every process loads the same batch)."""
    if not rt.distributed:
        return batch
    b = len(batch["frame_ids"])
    lo, hi = b * rt.rank // rt.world_size, b * (rt.rank + 1) // rt.world_size
    return {k: v[lo:hi] for k, v in batch.items()}


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
