"""One call signature for every way of running the detector: PyTorch checkpoint, ONNX Runtime, TensorRT.

    runner = load_runner(Path("artifacts/optimized"))            # backend.json's primary artifact
    runner = TorchRunner(Path("artifacts/model"))                 # the PyTorch reference
    out = runner(points, num_points, images, proj)

In (numpy; other dtypes are converted):
    points     [B, P, 4] float32  padded lidar points (x, y, z, intensity), lidar frame, metres
    num_points [B]       int64    valid rows per frame (rows >= num_points[b] are ignored)
    images     [B, N, 3, H, W] float32 normalized images (N, H, W as the model was built)
    proj       [B, N, 3, 4] float32 lidar -> model-input image pixels
Out: {"boxes": [B, K, 7] float32 (x, y, z, l, w, h, yaw), "scores": [B, K] float32, "labels": [B, K] int64}.
K is fixed (`max_detections`), sorted by descending score; score 0 = padding entry (fewer than K
peaks), its box/label meaningless. Keep `scores >= threshold` (threshold > 0): `valid_detections`.

`load_runner` picks the artifact from `backend.json` (backend "auto": TensorRT when the directory has
an engine, `tensorrt` imports and CUDA is present; else the primary's CPU backend, ONNX Runtime or
AOTInductor) after checking the sha256 of
every file backend.json lists (a replaced `model.onnx` or artifact is refused).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pfactory.optimize.errors import ArtifactError, BackendUnavailable
from pfactory.optimize.export import OUTPUT_NAMES
from pfactory.optimize.manifest import find_artifact, read_manifest, verify_directory
from pfactory.optimize.runner import Outputs, Runner, as_feed, split_run, valid_detections

__all__ = ["OrtRunner", "Outputs", "Runner", "TorchRunner", "as_feed", "auto_backend", "load_runner",
           "open_runner", "resolve_backend", "tensorrt_usable", "valid_detections"]  # fmt: skip


class OrtRunner(Runner):
    """An ONNX model in an ONNX Runtime session (CPU, or CUDA EP when installed and `device` asks for it)."""

    backend = "onnxruntime"

    def __init__(
        self,
        path: str | Path,
        precision: str = "fp32",
        device: str = "cpu",
        intra_op_threads: int | None = None,
        spin: bool = True,
        inter_op_threads: int | None = None,
    ) -> None:
        """`inter_op_threads` > 1: ORT's parallel executor (measurements only, slower here: see
        `ort_backend.session_options`); the default None keeps the sequential executor.

        An INT8 model that does not declare itself saturation-free on x86 (8-bit weights: an artifact
        built with `int8.reduce_range: false` or before the format was recorded) gets ORT's exact U8U8
        mode, so it computes the same on CPUs without VNNI (`self.exact_u8s8`)."""
        from pfactory.optimize.ort_backend import make_session, needs_exact_u8s8

        self.path = Path(path)
        self.precision = precision
        self.session = make_session(self.path, device, intra_op_threads, spin, inter_op_threads)
        self.exact_u8s8 = precision == "int8" and needs_exact_u8s8(self.session)
        if self.exact_u8s8:
            self.session = make_session(
                self.path, device, intra_op_threads, spin, inter_op_threads, exact_u8s8=True
            )
        self.device = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        self.input_names = [i.name for i in self.session.get_inputs()]
        batch_dim = self.session.get_inputs()[0].shape[0]
        # A graph exported with a fixed batch (export fallback) declares an int here.
        self.fixed_batch = batch_dim if isinstance(batch_dim, int) else None

    def _run_graph(self, feed: dict[str, np.ndarray]) -> Outputs:
        # The graph's own inputs (a lidar-only architecture declares only points and num_points).
        feed = {k: feed[k] for k in self.input_names}
        out = self.session.run(list(OUTPUT_NAMES), feed)
        return dict(zip(OUTPUT_NAMES, out))

    def run(self, feed: dict[str, np.ndarray]) -> Outputs:
        if self.fixed_batch is not None and feed["points"].shape[0] != self.fixed_batch:
            return split_run(self._run_graph, feed, self.fixed_batch)
        return self._run_graph(feed)


class TorchRunner(Runner):
    """The PyTorch model (eager), from a trained-model directory (`model.pt` + `model_config.json`) or a module."""

    backend = "pytorch"
    precision = "eager"

    def __init__(self, model: Any, device: str = "cpu", intra_op_threads: int | None = None) -> None:
        import torch

        if isinstance(model, (str, Path)):
            from pfactory.detectors.io import load_model

            model, _config = load_model(model, map_location="cpu")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if intra_op_threads:
            # Process-wide in PyTorch: the latency comparison sets ORT to the same count.
            torch.set_num_threads(int(intra_op_threads))
        self.device = device
        self.model = model.to(device).eval()

    def run(self, feed: dict[str, np.ndarray]) -> Outputs:
        import torch

        with torch.inference_mode():
            t = [torch.from_numpy(feed[k]).to(self.device) for k in self.model.deploy_inputs]
            boxes, scores, labels = self.model.forward_export(*t)
        return {
            "boxes": boxes.float().cpu().numpy(),
            "scores": scores.float().cpu().numpy(),
            "labels": labels.long().cpu().numpy(),
        }


def tensorrt_usable() -> bool:
    """True when `tensorrt` imports and a CUDA device is visible (what backend "auto" needs)."""
    try:
        import tensorrt  # noqa: F401
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


CPU_BACKENDS = ("onnxruntime", "aoti")


def resolve_backend(backend: str, device: str = "auto") -> str:
    """ "auto" -> "tensorrt" when usable and `device` is not "cpu", else "onnxruntime" (the optimize stage then
    also weighs the other CPU artifacts, `optimize.backend`); checks explicit asks."""
    if backend == "auto":
        return "tensorrt" if device != "cpu" and tensorrt_usable() else "onnxruntime"
    if backend == "aoti":
        return backend
    if backend == "tensorrt" and not tensorrt_usable():
        raise BackendUnavailable(
            "backend 'tensorrt' needs `import tensorrt` and a CUDA GPU (pip install '.[tensorrt]' on a GPU "
            "machine); use backend 'onnxruntime' or 'auto' here"
        )
    if backend not in ("onnxruntime", "tensorrt"):
        raise ValueError(f"unknown backend {backend!r} (auto | onnxruntime | tensorrt | aoti)")
    return backend


def auto_backend(manifest: dict[str, Any], device: str = "cpu") -> str:
    """What backend "auto" serves from an optimized directory: TensorRT when it holds an engine, TensorRT + CUDA
    are usable and `device` is not "cpu"; else the primary's backend when it is a CPU one (ONNX Runtime or
    AOTInductor: the stage picked the fastest), else ONNX Runtime."""
    built = {a["backend"] for a in manifest["artifacts"]}
    if "tensorrt" in built and device != "cpu" and tensorrt_usable():
        return "tensorrt"
    primary = (manifest.get("primary") or {}).get("backend")
    return primary if primary in CPU_BACKENDS and primary in built else "onnxruntime"


def load_runner(
    optimized_dir: Path,
    backend: str = "auto",
    precision: str | None = None,
    device: str = "cpu",
    intra_op_threads: int | None = None,
    verify: bool = True,
) -> Runner:
    """A runner for an artifact of `optimized_dir` (see the module docstring).

    backend "auto" = `auto_backend` (TensorRT on a GPU machine with an engine, else the primary's CPU backend). precision None = the manifest's primary precision for that
    backend. `verify` checks every file of the directory (the artifact, `model.onnx`, the evidence) against
    backend.json's sha256 before loading (`manifest.verify_directory`): a replaced file is refused.
    """
    optimized_dir = Path(optimized_dir)
    manifest = read_manifest(optimized_dir)
    if backend == "auto":
        backend = auto_backend(manifest, device)
    artifact = find_artifact(manifest, backend, precision)
    path = optimized_dir / artifact["file"]
    if verify:
        verify_directory(optimized_dir, manifest)
    elif not path.is_file():
        raise ArtifactError(f"{path}: listed in backend.json but missing")
    trt_device = "cuda" if device in ("auto", "cpu") else device
    return open_runner(path, backend, artifact["precision"], device, intra_op_threads, trt_device=trt_device)


def open_runner(
    path: Path,
    backend: str,
    precision: str,
    device: str = "cpu",
    threads: int | None = None,
    spin: bool = True,
    trt_device: str = "cuda",
) -> Runner:
    """The runner of one artifact file: ONNX Runtime (`device`, `threads` intra-op, `spin`), an AOTInductor
    package (CPU, `threads`) or a TensorRT engine (on `trt_device`) once its self-check has verified it on
    this machine, else ONNX Runtime FP32 beside it (`tensorrt_backend.open_engine`, one warning line). No
    manifest or hash check: `load_runner` does those for a directory."""
    if backend == "onnxruntime":
        return OrtRunner(path, precision, device, threads, spin=spin)
    if backend == "tensorrt":
        from pfactory.optimize.tensorrt_backend import open_engine

        def fallback(onnx: Path) -> Runner:
            return OrtRunner(onnx, "fp32", device, threads, spin=spin)

        return open_engine(path, precision, trt_device, fallback)
    if backend == "aoti":
        from pfactory.optimize.aoti_backend import AotiRunner

        return AotiRunner(path, precision, threads)
    raise ValueError(f"unknown backend {backend!r}")
