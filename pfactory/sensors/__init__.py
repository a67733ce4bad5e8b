"""Sensor data layer: the `Frame` model and readers/writers for KITTI, nuScenes and synthetic scenes.

`open_dataset(path)` detects the layout of a raw dataset directory and returns a reader
(`reader.DatasetReader`) whose `frame_ids()` and `read(frame_id)` give `Frame`s in the common
lidar-frame convention. Bottom up: `errors` (DatasetError), `io` (point files, images), `frame`,
`reader` (the contract: every layout fact), `checks` (shared strict checks), `kitti` / `nuscenes` (one
reader each, with its own strict inspection), `datasets` (`open_dataset`: readers by name from the entry-point
group `pfactory.datasets`, plugins included; docs/DATASETS.md), `digest` (a dataset's content hash),
`validate` (`factory data check`), `show` (renders), `geometry` (rigid transforms, boxes, projections).
The synthetic source is a stage of its own: `pfactory.synth`.

Nothing is imported here (loading params must not load the readers): import from the module,
e.g. `from pfactory.sensors.datasets import open_dataset`.
"""
