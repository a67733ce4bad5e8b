"""The reader contract every dataset layout implements (`KittiDataset`, `NuScenesDataset`, plugins).

A reader opens one raw dataset root and turns each of its frames into a `Frame` (lidar frame,
N cameras, boxes); `open_dataset` (`datasets.py`) offers a root to every reader registered in the
entry-point group `pfactory.datasets` and takes the first whose `detect` accepts it. The same reader
also knows how to check its own files strictly (`inspect`): every problem of a frame with file, field
and expectation, which `validate.py` runs over a whole dataset.

Every fact of a layout lives here, so that nothing outside the reader modules compares layout names
(DESIGN.md §5b; a test scans for it): its files per frame (`frame_files`, `shared_files`: the prepared
manifest's content hash), its reference frame (`reference_transform`), its units (`intensity_range`),
how it is listed on object storage (`list_remote`), how it is replicated for benchmarks (`replicate`) and
the writer of the benchmark's own result files (`results_writer`). docs/DATASETS.md describes the contract.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from pfactory.sensors.errors import DatasetError
from pfactory.sensors.frame import Frame

if TYPE_CHECKING:
    from pfactory.sensors.checks import FrameCheck, Problem


class RemoteStore(Protocol):
    """An object-store prefix as the reader hooks see it (`pfactory.prepare.rawdata` adapts its `Location`).
    Paths are relative to the dataset root, `/`-separated; "" is the root."""

    url: str

    def top(self) -> list[str]:
        """Names (files and folders) directly under the root."""
        ...

    def is_dir(self, rel: str) -> bool:
        """Whether `rel` is a folder with objects under it."""
        ...

    def names(self, rel: str) -> list[str]:
        """Names of the files directly under folder `rel`."""
        ...

    def download(self, rels: list[str], dest: Path) -> None:
        """Copy the files `rels` to `dest / rel` (folders created)."""
        ...


@dataclass
class RemoteListing:
    """What the prepare driver learns by listing a dataset on object storage (`DatasetReader.list_remote`).

    A worker builds a local copy of a unit in a scratch folder: the `dirs` (created even when empty), the
    `shared` files (downloaded once per worker process and run; a reader is then opened once over them and
    each unit's files come and go beside it) and the unit's own files (`unit_files(ids)`); with no shared
    files, each unit gets a fresh copy and a fresh reader. The readers and checks then run on that copy
    exactly as on a local dataset."""

    frame_ids: list[str]  # every frame id the checks see, in the local reader's order
    dirs: list[str]  # folders of a local copy, relative to the root
    unit_files: Callable[[list[str]], list[str]]  # frame ids -> the files (relative) a unit downloads
    shared: list[str] = field(default_factory=list)  # files every unit needs besides its own (tables)
    reader: DatasetReader | None = None  # the driver's reader over a local copy of `shared` (or None)
    scratch: Path | None = None  # the driver's local copy, removed by `RawSource.close`


class ResultWriter(Protocol):
    """The benchmark's own result files of an evaluation (`DatasetReader.results_writer` names its class).

    `writer = cls(dataset, prepared, split)` -- the open raw dataset, the prepared directory (its manifest,
    shards) and the evaluated split's name -- is built before the evaluation's work starts (a wrong raw
    dataset fails early: raise `DatasetError` or a `UserError`); `writer.write(out, preds)` then writes
    the files inside the evaluation's build folder `out` for the optimized model's detections `preds`
    (`pfactory.metrics.detection.FrameDetections` in the prepared reference frame) and returns kpis.json
    entries (the files' names, counts, the benchmark's own metric when it has one)."""

    def write(self, out: Path, preds: list[Any]) -> dict[str, Any]: ...


def check_frame_id(frame_id: object, root: Path) -> None:
    """DatasetError unless `frame_id` is a plain name (no `/`, `\\`, NUL, not empty, `.` or `..`)."""
    if (
        not isinstance(frame_id, str)
        or not frame_id
        or frame_id in (".", "..")
        or any(c in frame_id for c in ("/", "\\", "\x00"))
    ):
        raise DatasetError(
            root, "frame id", f"a frame name without path separators or '..', got {str(frame_id)[:80]!r}"
        )


class DatasetReader(ABC):
    """One raw dataset root of one layout. Subclasses set `layout`, `describe` and `root`."""

    layout: ClassVar[str]  # the layout's name (its entry point's): in reports, manifests and `Frame.source`
    title: ClassVar[str] = ""  # the layout's name as messages spell it ("KITTI"); default: `layout`
    # What a root of this layout holds, one line: the "no layout matched" error lists every reader's.
    describe: ClassVar[str] = ""
    # Units: the range intensities are stored in (KITTI reflectance [0, 1], nuScenes 0..255).
    intensity_range: ClassVar[tuple[float, float]] = (0.0, 255.0)
    # "module:attr" of the benchmark's result-file writer (`ResultWriter`), or None when the layout has
    # none. A name, not an import: the writer (pfactory.evaluate, a plugin's module) sits above the readers.
    results_writer: ClassVar[str | None] = None
    root: Path

    @classmethod
    @abstractmethod
    def detect(cls, root: Path) -> DatasetReader | None:
        """A reader for `root` when it holds this layout, else None (no error: others may match)."""

    @abstractmethod
    def frame_ids(self) -> list[str]:
        """Ids of the frames the reader can read, in a stable order."""

    @abstractmethod
    def frame_files(self, frame_id: str) -> list[tuple[str, Path]]:
        """The raw files one frame is made of, those that exist: `(name in the dataset, path)`. The name is
        the path as the layout spells it (KITTI `velodyne/000001.bin`), so the prepared manifest's content
        hash does not depend on where the dataset lives or on symlinks."""

    def shared_files(self) -> list[tuple[str, Path]]:
        """Files every frame depends on (nuScenes: the JSON tables) as `(name, path)`; [] when each frame
        is self-contained. Part of the content hash."""
        return []

    def reference_transform(self, frame_id: str) -> np.ndarray:
        """`T_ref_from_lidar [4, 4]` of the prepared reference frame `ego_axes` for one frame: the identity
        when the lidar's axes are already the vehicle's (KITTI), the lidar's mounting rotation otherwise
        (nuScenes). `reference_frame: lidar` never calls it (the identity)."""
        return np.eye(4)

    def replicate(self, out: Path, n: int, samples: list[str] | None = None) -> Path:
        """A dataset of this layout under `out` with `n` frames cloned round-robin from `samples` (default:
        all), sharing the files (symlinks): large datasets for benchmarks. Not every layout can."""
        raise NotImplementedError(f"the {self.layout} reader cannot replicate a dataset")

    @classmethod
    def list_remote(cls, store: RemoteStore, scratch: Path) -> RemoteListing | None:
        """The listing of a dataset of this layout on object storage, or None when `store` does not hold
        this layout or the reader cannot read object storage. `scratch`: an empty local folder the driver
        may fill with shared files (then `RemoteListing.scratch`)."""
        return None

    @classmethod
    def result_writer(cls) -> Callable[..., ResultWriter] | None:
        """The class named by `results_writer`, imported now; None when the layout has none."""
        if not cls.results_writer:
            return None
        module, _, attr = cls.results_writer.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
        return obj

    def read(self, frame_id: str, with_labels: bool = True) -> Frame:
        """Read one frame into the lidar-frame convention; DatasetError (with its frame id) on any problem.

        A frame id is a name, never a path: one with a path separator, `..` or NUL is refused (no read
        outside the dataset root through an id such as `../../etc/passwd`)."""
        check_frame_id(frame_id, self.root)
        try:
            return self._read(frame_id, with_labels)
        except DatasetError as e:
            e.frame_id = frame_id
            raise

    @abstractmethod
    def _read(self, frame_id: str, with_labels: bool) -> Frame: ...

    # --- strict validation --------------------------------------------------------------------

    def check_ids(self) -> list[str]:
        """Frame ids to check: `frame_ids()` plus any the reader would not see (KITTI: `000001.PNG`)."""
        return list(self.frame_ids())

    def dataset_problems(self) -> list[Problem]:
        """Problems of the dataset as a whole, not of one frame (nuScenes: orphan duplicate tokens)."""
        return []

    @abstractmethod
    def inspect(self, frame_id: str, min_points: int, keep_images: bool, decode: bool = True) -> FrameCheck:
        """Every problem of one frame, and the read frame when there is none (`validate.inspect_frame`)."""
