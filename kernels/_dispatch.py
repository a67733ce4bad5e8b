"""Backend choice for the `pfk::*` custom ops: Triton or the PyTorch reference.

In: a tensor (the op's first input) and the op's self-check path. Out: `use_triton(tensor, path) -> bool`.

Rules (docs/KERNELS.md, "Dispatch"):
- CUDA tensor and Triton importable -> Triton, once its self-check (`path`, e.g. "triton.focal_loss":
  kernels/selfcheck.py) has verified it on this device; a failed check -> the reference, said in one line.
- CPU tensor -> the reference, unless Triton is *forced* (env `PFK_FORCE_TRITON=1` or the
  `force_triton()` context manager) AND the Triton interpreter is on (`TRITON_INTERPRET=1`), which is
  how the CPU test-suite runs the Triton kernels (numpy-emulated, slow, small shapes only).
- Triton not installed -> the reference, everywhere.

Triton is never imported by `import kernels`: `triton_available()` imports it on first use only.
The interpreter flag is read by `triton.jit` when a kernel is *defined*, so `TRITON_INTERPRET=1` must
be in the environment before the first `kernels._*_triton` module is imported (they are imported
lazily, at the first Triton launch); `triton_module()` checks that and says so if it is not.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from kernels import selfcheck

_FORCE = threading.local()


@functools.cache
def triton_available() -> bool:
    """True when `import triton` works (imported on the first call only)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_requested() -> bool:
    """True when the environment asks Triton for its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_forced() -> bool:
    """True inside `force_triton()` or with env `PFK_FORCE_TRITON=1`."""
    return getattr(_FORCE, "on", False) or os.environ.get("PFK_FORCE_TRITON") == "1"


@contextlib.contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Run the Triton path on CPU tensors (needs `TRITON_INTERPRET=1` set before Triton's kernels load).

    Thread-local, so a test forcing Triton does not leak into other threads.
    """
    previous = getattr(_FORCE, "on", False)
    _FORCE.on = enabled
    try:
        yield
    finally:
        _FORCE.on = previous


def use_triton(tensor: torch.Tensor, path: str | None = None) -> bool:
    """Whether the op on `tensor`'s device runs the Triton kernel (True) or the reference (False). With
    `path` (the op's self-check, e.g. "triton.focal_loss"), only once that check has verified the kernel
    on this device (`kernels.selfcheck.trusted`: the first call runs it, later ones read its verdict)."""
    cpu_interpreted = tensor.device.type == "cpu" and triton_forced() and interpreter_requested()
    if not (tensor.is_cuda or cpu_interpreted) or not triton_available():
        return False
    return path is None or selfcheck.trusted(path, tensor.device)


def triton_for_check(name: str, device: torch.device) -> ModuleType:
    """`kernels.<name>` for a self-check on `device`, or `selfcheck.Skip` saying why Triton cannot run
    there (not installed; a CPU without the interpreter; the interpreter asked for on a GPU)."""
    if not triton_available():
        raise selfcheck.Skip("Triton is not installed: the reference runs")
    if device.type == "cpu" and not interpreter_requested():
        raise selfcheck.Skip(
            "no GPU here and Triton's CPU interpreter is off (TRITON_INTERPRET=1): the reference runs"
        )
    if device.type == "cuda" and interpreter_requested():
        raise selfcheck.Skip("TRITON_INTERPRET=1 builds the kernels for the CPU interpreter, not this GPU")
    return triton_module(name)


def triton_source(name: str) -> Path:
    """The file of `kernels.<name>` that a launch runs (the imported module's, else the one an import finds):
    what a Triton path's self-check fingerprints."""
    module = sys.modules.get(f"kernels.{name}")
    origin = getattr(module, "__file__", None) if module is not None else None
    if origin is None:
        spec = importlib.util.find_spec(f"kernels.{name}")
        origin = spec.origin if spec is not None else None
    if origin is None:
        raise FileNotFoundError(f"kernels.{name}")
    return Path(origin)


def triton_module(name: str) -> ModuleType:
    """Import `kernels.<name>` (a module of `@triton.jit` kernels), checking the interpreter state.

    A kernel module imported without `TRITON_INTERPRET=1` holds compiled-GPU kernels; launching those
    on CPU tensors fails with an opaque driver error, so say what happened instead.
    """
    module = importlib.import_module(f"kernels.{name}")
    if interpreter_requested() and not getattr(module, "INTERPRETED", False):
        raise RuntimeError(
            f"kernels.{name} was imported before TRITON_INTERPRET=1 was set, so its kernels were built for "
            "the GPU; set TRITON_INTERPRET=1 before anything imports the Triton kernels "
            "(see docs/KERNELS.md, 'Running Triton on CPU')"
        )
    return module


def checks_enabled() -> bool:
    """False while tracing for torch.compile or ONNX export: value checks there would need `.item()`."""
    return not (torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export())
