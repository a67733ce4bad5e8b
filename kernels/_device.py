"""The launch device of a Triton kernel: its own module, so the Triton kernels (`_*_triton.py`) and the
dispatcher that imports them by name (`_dispatch.triton_module`) do not import each other."""

from __future__ import annotations

import contextlib

import torch


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the *current* CUDA device: make it the tensors' device for the launch."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
