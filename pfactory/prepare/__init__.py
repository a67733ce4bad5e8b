"""Training data: raw frames -> Parquet shards (the `prepare` stage) -> batches (the train loader).

- `prepare.prepare_dataset`: streams a raw KITTI/nuScenes dataset through the camera path
  (`camera`: DALI decode, resize, pad, normalize, CHW) and the lidar path (`lidar`: reference
  transform, ROI crop, ego removal, voxel down-sampling, box filtering and class mapping) into
  shards (`shards`: schema, writer, reader), with `manifest.json` and `rejected.jsonl`.
- `loader.make_loader`: a DALI pipeline over the shards (parallel `external_source`) with the
  global augmentations (`augment`) applied to points, boxes and camera projections by one shared
  transform per frame; `loader.TorchLoader` is the plain PyTorch reference it is tested against.

Format, choices and measurements: docs/DATA.md.
"""
