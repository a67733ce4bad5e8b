"""Optimized inference: ONNX export of the whole detector, ONNX Runtime / TensorRT backends, parity, latency.

Modules (each imports its heavy dependencies itself, so `import pfactory.optimize` stays cheap):
- `params`     `OptimizeParams` (the `optimize:` section of params.yaml)
- `export`     detector -> `model.onnx` (scatter + decode inside the graph), checks
- `graph_rewrite` exact rewrites for ORT's CPU kernels (1-D row scatter, size-1 sums, dead nodes)
- `ort_backend` ONNX Runtime: graph-optimized FP32 model, INT8 QDQ static quantization, sessions
- `tensorrt_backend` TensorRT FP16/INT8 engines (GPU machines only), calibrator, engine metadata
- `calibration` prepared frames -> numpy feeds (calibration and held-out frames)
- `parity`     candidate vs PyTorch outputs -> report + gate
- `latency`    interleaved timing -> p50/p95/p99, throughput, ratios
- `manifest`   `backend.json`: what was built, with sha256, shapes, versions
- `runtime`    `load_runner(optimized_dir)` / `TorchRunner(model_dir)`: one call signature for every backend
Stage: tasks/optimize.py. Docs: docs/OPTIMIZE.md.
"""

from pfactory.optimize.errors import ArtifactError, BackendUnavailable, OptimizeError, ParityError
from pfactory.optimize.params import OptimizeParams

__all__ = ["ArtifactError", "BackendUnavailable", "OptimizeError", "OptimizeParams", "ParityError"]
