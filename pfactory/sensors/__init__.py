"""Sensor data layer: the `Frame` model and readers/writers for KITTI, nuScenes and synthetic scenes.

`open_dataset(path)` detects the layout of a raw dataset directory and returns a reader
whose `frame_ids()` and `read(frame_id)` give `Frame`s in the common lidar-frame convention.
"""

from pfactory.sensors.frame import Boxes3D, CameraView, DatasetError, Frame, open_dataset

__all__ = ["Boxes3D", "CameraView", "DatasetError", "Frame", "open_dataset"]
