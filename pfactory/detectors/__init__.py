"""The detector contract and the architectures by name (DESIGN.md §5b, docs/MODELS.md).

- `contract`: what an architecture provides (`Architecture`, `DataSpec`, `Detections`, `LossContext`) and
  what a built detector must offer (`check_detector`). The trainer, export, INT8 sensitivity, parity,
  evaluate, the report and promotion know only this.
- `registry`: `model.arch` -> an `Architecture`, through the entry-point group `pfactory.models`, lazily.
- `params`: the `model` section of params.yaml (`arch`, each architecture's own section by its name).
- `io`: `model.pt` + `model_config.json` for any architecture.
This package's `__init__` imports nothing heavy (no torch): `flows.params` imports `params`.
"""
