"""Saving and loading a trained detector: `model.pt` (state dict) + `model_config.json`.

In/out of the train stage's directory (`paths.model`):
    model.pt           the weights: a plain state dict, loadable with `torch.load(weights_only=True)`
    model_config.json  `{"format", "model": ModelParams, "image_size": [W, H], "classes", "cameras"}`
`load_model(dir)` rebuilds the exact network from the config (what optimize/evaluate call).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch

from pfactory import artifacts as af
from pfactory.fsutil import atomic_write_bytes, atomic_write_json
from pfactory.model.detector import PaintedPillarDetector, build_model
from pfactory.model.params import ModelParams

CONFIG_FORMAT = 1
WEIGHTS = af.WEIGHTS
CONFIG = af.MODEL_CONFIG


def save_bytes(obj: Any) -> bytes:
    """`torch.save(obj)` into memory (then written atomically by the caller)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save_model(
    out: str | Path,
    model: PaintedPillarDetector,
    image_size: tuple[int, int],
    cameras: list[str] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write `model.pt` and `model_config.json` atomically into `out`; returns their paths."""
    out = Path(out)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    weights = atomic_write_bytes(out / WEIGHTS, save_bytes(state))
    config = {
        "format": CONFIG_FORMAT,
        "model": model.params.model_dump(mode="json"),
        "image_size": list(image_size),
        "classes": list(model.params.classes),
        "cameras": list(cameras or []),
        **(extra or {}),
    }
    cfg = atomic_write_json(out / CONFIG, config)
    return {"weights": weights, "config": cfg}


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """`model_config.json` of a trained-model directory, format-checked."""
    path = Path(model_dir) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no model config; not a trained-model directory (run `factory train`)"
        )
    config = json.loads(path.read_text())
    if int(config.get("format", 0)) > CONFIG_FORMAT:
        raise ValueError(
            f"{path}: model config format {config['format']} is newer than this pfactory ({CONFIG_FORMAT})"
        )
    return config


def load_model(
    model_dir: str | Path, map_location: str | torch.device = "cpu"
) -> tuple[PaintedPillarDetector, dict]:
    """Rebuild the detector of `model_dir` and load its weights (`weights_only=True`); eval mode."""
    config = read_config(model_dir)
    params = ModelParams.model_validate(config["model"])
    model = build_model(params, tuple(config["image_size"]))
    state = torch.load(Path(model_dir) / WEIGHTS, map_location=map_location, weights_only=True)
    model.load_state_dict(state)
    return model.to(map_location).eval(), config
