"""The runner contract every backend implements (PyTorch, ONNX Runtime, TensorRT): one call signature,
numpy in, numpy out (the input/output layout is in `runtime.py`'s docstring). A module of its own so
the backends (`runtime.py`, `tensorrt_backend.py`) both build on it without importing each other.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from pfactory.optimize.export import INPUT_NAMES, OUTPUT_NAMES

Outputs = dict[str, np.ndarray]
_DTYPES = {"points": np.float32, "num_points": np.int64, "images": np.float32, "proj": np.float32}


def as_feed(points: Any, num_points: Any, images: Any, proj: Any) -> dict[str, np.ndarray]:
    """The four inputs as contiguous numpy arrays of the graph's dtypes (torch tensors accepted)."""
    feed = {}
    for name, value in zip(INPUT_NAMES, (points, num_points, images, proj)):
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().cpu().numpy()
        feed[name] = np.ascontiguousarray(value, dtype=_DTYPES[name])
    b = feed["points"].shape[0]
    for name in INPUT_NAMES[1:]:
        if feed[name].shape[0] != b:
            raise ValueError(f"{name} has batch {feed[name].shape[0]}, points has {b}")
    return feed


def valid_detections(out: Outputs, threshold: float) -> list[Outputs]:
    """Per frame, the detections with score >= `threshold` (> 0, so padding entries never pass)."""
    if threshold <= 0:
        raise ValueError("threshold must be > 0: score-0 entries are padding, not detections")
    frames = []
    for b in range(out["scores"].shape[0]):
        keep = out["scores"][b] >= threshold
        frames.append({k: out[k][b][keep] for k in OUTPUT_NAMES})
    return frames


class Runner(abc.ABC):
    """Base: `runner(points, num_points, images, proj) -> {"boxes", "scores", "labels"}` (module docstring)."""

    backend: str = ""
    precision: str = ""
    device: str = "cpu"

    def __call__(self, points: Any, num_points: Any, images: Any, proj: Any) -> Outputs:
        return self.run(as_feed(points, num_points, images, proj))

    @abc.abstractmethod
    def run(self, feed: dict[str, np.ndarray]) -> Outputs:
        """One forward pass on a prepared feed (`as_feed`) -> outputs."""

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.precision}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, device={self.device})"


def split_run(run_fixed: Any, feed: dict[str, np.ndarray], fixed_batch: int) -> Outputs:
    """Run a graph exported with a fixed batch on any batch: chunks of `fixed_batch`, the last one padded
    by repeating its final frame (outputs of the repeats dropped)."""
    b = feed["points"].shape[0]
    outs: list[Outputs] = []
    for start in range(0, b, fixed_batch):
        chunk = {k: v[start : start + fixed_batch] for k, v in feed.items()}
        n = chunk["points"].shape[0]
        if n < fixed_batch:
            chunk = {
                k: np.concatenate([v, np.repeat(v[-1:], fixed_batch - n, axis=0)]) for k, v in chunk.items()
            }
        out = run_fixed(chunk)
        outs.append({k: v[:n] for k, v in out.items()})
    return {k: np.concatenate([o[k] for o in outs]) for k in OUTPUT_NAMES}
