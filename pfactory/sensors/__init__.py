"""Sensor data layer: the `Frame` model and readers/writers for KITTI, nuScenes and synthetic scenes.

`open_dataset(path)` detects the layout of a raw dataset directory and returns a reader
(`reader.DatasetReader`) whose `frame_ids()` and `read(frame_id)` give `Frame`s in the common
lidar-frame convention. Bottom up: `errors` (DatasetError), `io` (point files, images), `frame`,
`reader` (the protocol), `checks` (shared strict checks), `kitti` / `nuscenes` (one reader each,
with its own strict inspection), `datasets` (`open_dataset`), `validate` (`factory data check`),
`show` (renders), `synth/` (the synthetic source).
"""

from pfactory.sensors.datasets import open_dataset
from pfactory.sensors.errors import DatasetError
from pfactory.sensors.frame import Boxes3D, CameraView, Frame

__all__ = ["Boxes3D", "CameraView", "DatasetError", "Frame", "open_dataset"]
