"""Lineage of a run: the code's commit, the package versions and the device it ran on (DESIGN.md §9).

`lineage_tags(root)` -> `{"git.commit", "git.dirty", "device", "version.<package>"}`: the tags every stage's
MLflow run carries (`pfactory.tracking.runs.stage_run`). Nothing here imports MLflow or torch (a process that
has not imported torch gets its device tag without it).
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

LINEAGE_PACKAGES = (
    "torch",
    "triton",
    "nvidia-dali-cuda120",
    "onnx",
    "onnxruntime",
    "numpy",
    "pyarrow",
    "mlflow",
    "prefect",
    "dvc",
    "dask",
    "distributed",
)


def git_info(root: str | Path) -> dict[str, Any]:
    """`{"commit": sha or None, "dirty": bool or None}` of the repo at `root`."""

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": commit.strip() if commit else None,
        "dirty": bool(status.strip()) if status is not None else None,
    }


def package_versions(names: tuple[str, ...] = LINEAGE_PACKAGES) -> dict[str, str]:
    # Imported here: ~30 ms (email, zipfile), and every `factory` command imports this module (project_root).
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def device_info() -> str:
    """A short description of the compute device (GPU name, or the CPU and its core count).

    Asks torch only where the process has imported it already (a training stage): a stage or the flow that
    does not use torch is not made to import it (~1.5 s) for a tag. Elsewhere the GPU is the NVIDIA driver's
    first one (`/proc/driver/nvidia/gpus/*/information`) when the installed torch is a CUDA build."""
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.get_device_name(0)}"
    else:
        gpu = _nvidia_gpu()
        if gpu and _cuda_torch():
            return f"cuda:{gpu}"
    return f"cpu:{platform.machine()}x{os.cpu_count()}"


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # the NVIDIA driver's per-GPU folders (Linux)


def _nvidia_gpu(gpus: Path = NVIDIA_GPUS) -> str | None:
    """The model name of the NVIDIA driver's first GPU (`<gpus>/<bus id>/information`, line `Model:`), else
    None."""
    for info in sorted(gpus.glob("*/information")):
        with contextlib.suppress(OSError):
            for line in info.read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "Model" and value.strip():
                    return value.strip()
    return None


def _cuda_torch() -> bool:
    """Whether the installed torch is a CUDA build (its version has no `+cpu` local part)."""
    from importlib import metadata

    try:
        return _has("torch") and "+cpu" not in metadata.version("torch")
    except metadata.PackageNotFoundError:
        return False


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def lineage_tags(root: Path) -> dict[str, str]:
    g = git_info(root)
    tags = {
        "git.commit": str(g["commit"]),
        "git.dirty": str(g["dirty"]),
        "device": device_info(),
        **{f"version.{k}": v for k, v in package_versions().items()},
    }
    return tags
