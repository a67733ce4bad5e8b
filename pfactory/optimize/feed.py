"""`Feed`: the named input arrays of one inference call (ONNX Runtime, TensorRT, the calibration, latency
and sensitivity loops): `{input name: array}`, the names of `pfactory.optimize.export.INPUT_NAMES`."""

from __future__ import annotations

import numpy as np

Feed = dict[str, np.ndarray]
