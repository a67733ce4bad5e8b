"""AOTInductor: the detector compiled ahead of time to a `.pt2` package (a shared library + weights) that
runs without the Python model code: a second CPU backend beside ONNX Runtime.

In:  the PyTorch detector (`forward_export(points, num_points, images, proj)`), an output path.
Out: `aoti/model.fp32.pt2` (`torch._inductor.aoti_compile_and_package`), loaded by `AotiRunner` with
     `torch._inductor.aoti_load_package` (torch only: no pfactory model module, no custom op).
I/O: the ONNX graph's (`pfactory.optimize.runtime` docstring); `points` and the batch are dynamic.

The graph is traced by `torch.export` on the model's export path (`export_path()`: the branches the ONNX
exporter takes, `torch.onnx.is_in_onnx_export()` true), so the pillar scatter is `aten.scatter_reduce`
and the painting `grid_sample`, the same decomposition `model.onnx` holds, and no `pfk::` custom op (a
Python custom op would need this package at load time). `check_graph` refuses a graph that still has one.

Threads: Inductor's CPU kernels take their OpenMP thread count from `torch.get_num_threads()` when the
package is compiled and when it runs; the stage compiles and times at `optimize.intra_op_threads`.
Inductor's compile cache lives in `cache_dir` (inside the project: `<optimized>.aoti-cache/`), so a
rebuild of the same graph (another seed's weights) reuses the compiled kernels.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.optimize.errors import ArtifactError
from pfactory.optimize.runner import Outputs, Runner

AOTI_DIR = "aoti"
BACKEND = "aoti"


@contextlib.contextmanager
def export_path() -> Iterator[None]:
    """`torch.onnx.is_in_onnx_export()` is true inside: the model takes its export branches (pure aten,
    module docstring). The flag is the one `torch.onnx.export(dynamo=True)` sets while it traces."""
    from torch.onnx._internal.exporter import _flags

    old = _flags._is_onnx_exporting
    _flags._is_onnx_exporting = True
    try:
        yield
    finally:
        _flags._is_onnx_exporting = old


def check_graph(exported: Any) -> list[str]:
    """The call targets of `exported` (an ExportedProgram) that are not aten/prims ops; raises
    `ArtifactError` on a custom op (it would need Python code at load time)."""
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    custom = sorted(t for t in targets if t.startswith("pfk.") or "pfk::" in t)
    if custom:
        raise ArtifactError(f"AOTInductor graph holds custom ops {custom}: the package would need pfactory")
    return sorted(targets)


def build_aoti(
    model: Any,
    dst: str | Path,
    *,
    cameras: int,
    export_points: int = 4096,
    dynamic_batch: bool = True,
    threads: int | None = None,
    cache_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Export `model.forward_export` with `torch.export` (export path) and compile it to the package `dst`.

    Returns {"export_s", "compile_s", "ops": number of distinct aten ops, "dynamic_batch", "threads",
    "torch_version"}. `threads`: OpenMP threads baked into the kernels (None: torch's current count).
    """
    import torch
    from torch.export import Dim

    from pfactory.optimize.export import ExportWrapper, deploy_args, example_inputs

    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if cache_dir is not None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir).resolve()))
    if threads:
        torch.set_num_threads(int(threads))
    wrapper = ExportWrapper(model).eval()
    batch = Dim("batch", min=1, max=1024) if dynamic_batch else None
    points = Dim("points", min=2, max=1 << 24)
    dyn = {
        "points": {0: batch, 1: points} if batch is not None else {1: points},
        "num_points": {0: batch} if batch is not None else None,
        "images": {0: batch} if batch is not None else None,
        "proj": {0: batch} if batch is not None else None,
    }
    dyn = {k: v for k, v in dyn.items() if k in wrapper.inputs}
    t0 = time.perf_counter()
    # Example batch 2 when dynamic: torch.export specializes dims of size 1.
    args = deploy_args(model, example_inputs(model, 2 if dynamic_batch else 1, export_points, cameras))
    with torch.no_grad(), export_path():
        exported = torch.export.export(wrapper, args, dynamic_shapes=dyn, strict=False)
    ops = check_graph(exported)
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tmp = dst.with_name(f".tmp.{dst.name}")  # the packager insists on a .pt2 suffix
    with torch.no_grad():
        torch._inductor.aoti_compile_and_package(
            exported, package_path=str(tmp),
            inductor_configs={"aot_inductor.metadata": {"pfactory.inputs": ",".join(wrapper.inputs)}},
        )  # fmt: skip
    os.replace(tmp, dst)
    return {
        "export_s": round(export_s, 3),
        "compile_s": round(time.perf_counter() - t0, 3),
        "ops": len(ops),
        "dynamic_batch": dynamic_batch,
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }


class AotiRunner(Runner):
    """An AOTInductor package (`.pt2`) on the CPU; `threads`: torch's intra-op (OpenMP) thread count."""

    backend = BACKEND

    def __init__(self, path: str | Path, precision: str = "fp32", threads: int | None = None) -> None:
        import torch

        self.path = Path(path)
        self.precision = precision
        self.threads = int(threads) if threads else None
        if self.threads:
            torch.set_num_threads(self.threads)
        self.model = torch._inductor.aoti_load_package(str(self.path))
        # The package's own inputs, in order (a prefix of INPUT_NAMES: lidar-only graphs take two).
        from pfactory.optimize.export import INPUT_NAMES

        names = getattr(self.model, "get_metadata", lambda: {})().get("pfactory.inputs")
        self.input_names = tuple(names.split(",")) if names else INPUT_NAMES

    def run(self, feed: dict[str, np.ndarray]) -> Outputs:
        import torch

        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # process-wide: another runner may have changed it
        with torch.inference_mode():
            boxes, scores, labels = self.model(*(torch.from_numpy(feed[k]) for k in self.input_names))
        return {
            "boxes": boxes.float().numpy(),
            "scores": scores.float().numpy(),
            "labels": labels.long().numpy(),
        }
