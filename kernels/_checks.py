"""Input validation shared by the public kernel functions: readable `ValueError`s before any launch.

In: tensors and the facts they must satisfy. Out: nothing, or a `ValueError` naming the op, the
argument, what was expected and what came in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def describe(t: torch.Tensor) -> str:
    """`float32[300000, 64] on cpu` — dtype, shape and device, for error messages."""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


def require(condition: bool, op: str, message: str | Callable[[], str]) -> None:
    """Raise `ValueError("<op>: <message>")` unless `condition`. A message that shows shapes is passed
    as a zero-argument callable: it is only formatted on failure, so `torch.compile` with dynamic
    shapes never formats a symbolic size (an f-string over a SymInt is a graph break)."""
    if not condition:
        raise ValueError(f"{op}: {message() if callable(message) else message}")


def require_tensor(
    t: object,
    op: str,
    name: str,
    *,
    dtypes: tuple[torch.dtype, ...],
    ndim: int | None = None,
) -> None:
    """`t` is a tensor of one of `dtypes` with `ndim` dimensions."""
    require(isinstance(t, torch.Tensor), op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    wanted = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    require(t.dtype in dtypes, op, lambda: f"{name} must have dtype in ({wanted}), got {describe(t)}")
    if ndim is not None:
        require(t.dim() == ndim, op, lambda: f"{name} must have {ndim} dimension(s), got {describe(t)}")


def require_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    require(
        len(devices) == 1,
        op,
        "all tensors must be on one device, got " + ", ".join(f"{k}: {v.device}" for k, v in tensors.items()),
    )


def require_range(t: torch.Tensor, op: str, name: str, low: int, high: int) -> None:
    """Every value of integer tensor `t` lies in [low, high). Costs one device sync (eager only)."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    require(low <= lo and hi < high, op, f"{name} values must lie in [{low}, {high}), got min {lo}, max {hi}")
