"""The common frame model every reader produces and every stage consumes.

A `Frame` holds one lidar sweep and the camera images taken with it:
- `points [N, 4]` float32 `(x, y, z, intensity)` in the lidar frame (x forward, y left, z up,
  metres; intensity in [0, 1] — nuScenes' 0..255 is divided by 255 on read);
- `cameras`: one `CameraView` per camera (KITTI: 1, nuScenes: up to 6), each with its image
  file, intrinsics `K [3, 3]`, `T_cam_from_lidar [4, 4]` and image size;
- `boxes`: `Boxes3D` — `[M, 7]` `(x, y, z, l, w, h, yaw)` in the lidar frame with the dataset's
  own class names (mapping to training classes happens in prepare, from params).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pfactory.sensors.errors import DatasetError
from pfactory.sensors.io import decode_image

__all__ = ["Boxes3D", "CameraView", "DatasetError", "Frame"]


@dataclass
class CameraView:
    """One camera of a frame.

    `K [3, 3]` intrinsics; `T_cam_from_lidar [4, 4]` maps lidar-frame points into this camera's
    frame (x right, y down, z forward); `image_size` is `(width, height)` in pixels.
    """

    name: str
    image_path: Path
    K: np.ndarray
    T_cam_from_lidar: np.ndarray
    image_size: tuple[int, int]

    def read_bytes(self) -> bytes:
        """The encoded image file (PNG/JPEG) as stored."""
        return Path(self.image_path).read_bytes()

    def load_image(self) -> np.ndarray:
        """Decoded RGB image `[H, W, 3]` uint8; raises DatasetError if it does not decode."""
        return decode_image(self.read_bytes(), self.image_path)

    @property
    def P(self) -> np.ndarray:
        """3x4 projection of homogeneous lidar points to homogeneous pixels: `K @ T[:3]`."""
        return self.K @ self.T_cam_from_lidar[:3]


@dataclass
class Boxes3D:
    """3D boxes of one frame, in the lidar frame.

    `boxes [M, 7]` float64 `(x, y, z, l, w, h, yaw)`; `names [M]` dataset class names;
    `difficulty [M]` int8 (KITTI 0 easy / 1 moderate / 2 hard, -1 unknown or beyond);
    `num_points [M]` int32 lidar points inside (-1 when not computed); KITTI extras when the
    source has them: `truncation [M]`, `occlusion [M]`, `box2d [M, 4]` (x1, y1, x2, y2 in camera 0).
    """

    boxes: np.ndarray
    names: list[str]
    difficulty: np.ndarray
    truncation: np.ndarray | None = None
    occlusion: np.ndarray | None = None
    box2d: np.ndarray | None = None
    # 2D regions that must not be scored (KITTI DontCare), [D, 4] in camera 0.
    dontcare_2d: np.ndarray = field(default_factory=lambda: np.zeros((0, 4)))

    def __post_init__(self) -> None:
        self.boxes = np.asarray(self.boxes, dtype=np.float64).reshape(-1, 7)
        m = len(self.boxes)
        if len(self.names) != m or len(self.difficulty) != m:
            raise ValueError(
                f"Boxes3D: {m} boxes but {len(self.names)} names, {len(self.difficulty)} difficulties"
            )

    def __len__(self) -> int:
        return len(self.boxes)

    @classmethod
    def empty(cls) -> Boxes3D:
        return cls(np.zeros((0, 7)), [], np.zeros(0, dtype=np.int8))


@dataclass
class Frame:
    """One annotated sensor frame (see the module docstring for frames and units)."""

    frame_id: str
    points: np.ndarray  # [N, 4] float32 (x, y, z, intensity), lidar frame
    cameras: list[CameraView]
    boxes: Boxes3D
    lidar_path: Path | None = None
    source: str = "unknown"  # "kitti" | "nuscenes"

    def camera(self, name: str) -> CameraView:
        for cam in self.cameras:
            if cam.name == name:
                return cam
        raise KeyError(f"frame {self.frame_id} has no camera {name!r}; has {[c.name for c in self.cameras]}")
