"""Test support for kernels (used by tests/kernels and benchmarks; imports torch only, never triton).

    enable_triton_interpreter() -> None     call at the top of a test module, before anything imports
                                            the Triton kernels: on a machine without CUDA it sets
                                            TRITON_INTERPRET=1 so they are built for the CPU interpreter
    triton_cpu_skip_reason() -> str | None  why Triton-on-CPU tests cannot run here (None if they can)
    triton_device_params() -> list          pytest params "cpu" (interpreter) and "cuda" (marked gpu),
                                            each skipped with its reason where it cannot run

Why not a conftest or a subprocess: `triton.jit` reads TRITON_INTERPRET when a kernel is *defined*,
and kernels/_*_triton.py are imported lazily at the first Triton launch, so setting the variable at
collection time (module top) is early enough and keeps the tests in-process (fast, debuggable).
`kernels._dispatch.triton_module` raises a clear error if the order was wrong anyway.
"""

from __future__ import annotations

import os

import torch

from kernels._dispatch import interpreter_requested, triton_available


def enable_triton_interpreter() -> None:
    """Ask for Triton's CPU interpreter when there is no GPU (an explicit TRITON_INTERPRET wins)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_cpu_skip_reason() -> str | None:
    if not triton_available():
        return "triton is not importable (CPU-only install): the reference path is the only backend"
    if not interpreter_requested():
        return "TRITON_INTERPRET != 1, so Triton kernels cannot run on CPU tensors in this process"
    return None


def triton_device_params() -> list:
    """pytest params "cpu" (Triton interpreter, skipped with the reason if unavailable) and "cuda"
    (real Triton, marked `gpu`, skipped without CUDA) for Triton-vs-reference tests."""
    import pytest  # test-only dependency, imported here so `kernels` itself never needs it

    cpu_reason = triton_cpu_skip_reason()
    cuda_ok = torch.cuda.is_available() and triton_available() and not interpreter_requested()
    return [
        pytest.param("cpu", marks=pytest.mark.skipif(cpu_reason is not None, reason=cpu_reason or "")),
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not cuda_ok, reason="needs CUDA and triton (no interpreter)"),
            ],
        ),
    ]
