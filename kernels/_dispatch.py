"""Backend choice for the `pfk::*` custom ops: Triton or the PyTorch reference.

In: a tensor (the op's first input). Out: `use_triton(tensor) -> bool`.

Rules (docs/KERNELS.md, "Dispatch"):
- CUDA tensor and Triton importable -> Triton.
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
import os
import threading
from collections.abc import Iterator
from types import ModuleType

import torch

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


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the op on `tensor`'s device runs the Triton kernel (True) or the reference (False)."""
    if tensor.is_cuda:
        return triton_available()
    if tensor.device.type == "cpu" and triton_forced() and interpreter_requested():
        return triton_available()
    return False


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
