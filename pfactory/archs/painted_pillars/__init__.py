"""The default detector (DESIGN.md §5): camera-painted pillars, multi-scale BEV backbone, center head.

- `params`: `ModelParams` (`params.model`) and `TrainParams` (`params.train`); imported by
  `flows.params`, so this package's `__init__` imports nothing heavy (no torch).
- `detector`: the network (`build_model`, `PaintedPillarDetector.forward` / `.forward_export`); its blocks
  in `layers`, `painting` and `pillars`; `variants`: the conversions for torch.compile and the ONNX export.
- `targets`, `loss`, `decode`: center-head targets, focal + L1 loss, peak decoding.
- `inference`: batched prediction -> `FrameDetections` and the KPIs; `io`: `model.pt` + `model_config.json`.
Training lives in `pfactory/train/` (the stage: `tasks/train.py`); docs/MODEL.md has the design, the measurements and the presets.
"""
