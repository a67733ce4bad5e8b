"""`open_dataset`: the one registry of dataset layouts. A root is offered to each reader in turn."""

from __future__ import annotations

from pathlib import Path

from pfactory.sensors.errors import DatasetError
from pfactory.sensors.kitti import KittiDataset
from pfactory.sensors.nuscenes import NuScenesDataset
from pfactory.sensors.reader import DatasetReader

# Tried in order; a new layout is a `DatasetReader` subclass added here.
READERS: tuple[type[DatasetReader], ...] = (KittiDataset, NuScenesDataset)


def open_dataset(root: str | Path, strict: bool = True) -> DatasetReader:
    """Open a raw dataset directory, detecting its layout.

    KITTI object layout: `root/training/{velodyne,image_2,calib,label_2}` (or those folders
    directly under `root`). nuScenes layout: `root/samples/` plus a `v1.0-*` table folder.
    Returns a `KittiDataset` or `NuScenesDataset`; raises DatasetError naming what is missing.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(root, "dataset root", "an existing directory")
    for reader in READERS:
        dataset = reader.detect(root)
        if dataset is not None:
            return dataset
    raise DatasetError(
        root,
        "layout",
        "a KITTI object layout (training/velodyne, image_2, calib, label_2) "
        "or a nuScenes layout (samples/ and a v1.0-* table folder)",
    )
