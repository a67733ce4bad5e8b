"""The reader protocol every dataset layout implements (`KittiDataset`, `NuScenesDataset`).

A reader opens one raw dataset root and turns each of its frames into a `Frame` (lidar frame,
N cameras, boxes); `open_dataset` (`datasets.py`) picks the reader whose `detect` accepts a
root. The same reader also knows how to check its own files strictly (`inspect`): every problem
of a frame with file, field and expectation, which `validate.py` runs over a whole dataset.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from pfactory.sensors.errors import DatasetError
from pfactory.sensors.frame import Frame

if TYPE_CHECKING:
    from pfactory.sensors.checks import FrameCheck, Problem


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
    """One raw dataset root of one layout. Subclasses set `layout` and `root`."""

    layout: ClassVar[str]  # "kitti" | "nuscenes": the name in reports and `Frame.source`
    root: Path

    @classmethod
    @abstractmethod
    def detect(cls, root: Path) -> DatasetReader | None:
        """A reader for `root` when it holds this layout, else None (no error: others may match)."""

    @abstractmethod
    def frame_ids(self) -> list[str]:
        """Ids of the frames the reader can read, in a stable order."""

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
