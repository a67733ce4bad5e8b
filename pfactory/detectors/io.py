"""Saving and loading a trained detector of any architecture: `model.pt` (state dict) + `model_config.json`.

In/out of the train stage's directory (`paths.model`):
    model.pt           the weights: a plain state dict, loadable with `torch.load(weights_only=True)`
    model_config.json  `{"format", "arch": name, "plugin": record or null, "model": the detector's params,
                       "image_size": [W, H], "classes", "pc_range", "cameras"}`
`load_model(dir)` rebuilds the exact network from the config through the registry (what optimize/evaluate
call). Format 1-2 configs (before architectures had names) are the default architecture's.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from pfactory.detectors.contract import DATA_KEYS, DataSpec
from pfactory.detectors.params import DEFAULT_ARCH  # records from before architectures had names
from pfactory.runtime.failures import EXIT_USAGE, UserError
from pfactory.storage import artifacts as af
from pfactory.storage.fsutil import atomic_write_bytes, atomic_write_json, read_json_object

CONFIG_FORMAT = 3
# Format 1 configs predate these ModelParams fields; they mean the network of that time.
_FORMAT1_MODEL = {"bev_stem": "conv3x3", "head_kernel": 3, "heading": "sincos"}
WEIGHTS = af.WEIGHTS
CONFIG = af.MODEL_CONFIG


def save_bytes(obj: Any) -> bytes:
    """`torch.save(obj)` into memory (then written atomically by the caller)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save_model(
    out: str | Path, model: Any, arch: str, plugin: dict[str, Any] | None, extra: dict[str, Any] | None = None
) -> dict[str, Path]:
    """Write `model.pt` and `model_config.json` atomically into `out` for a detector of architecture `arch`
    (`plugin`: its record when it comes from an installed distribution); returns their paths."""
    out = Path(out)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    weights = atomic_write_bytes(out / WEIGHTS, save_bytes(state), clean_stale=True)
    spec: DataSpec = model.spec
    config = {
        "format": CONFIG_FORMAT,
        "arch": arch,
        "plugin": plugin,
        "model": model.params.model_dump(mode="json"),
        "image_size": list(spec.image_size),
        "classes": list(spec.classes),
        "pc_range": list(spec.pc_range),
        "cameras": list(spec.cameras),
        **(extra or {}),
    }
    cfg = atomic_write_json(out / CONFIG, config)
    return {"weights": weights, "config": cfg}


class CheckpointError(UserError, ValueError):
    """A weights/checkpoint file that cannot be loaded as a plain state dict: names the file and why."""

    exit_code = EXIT_USAGE


def load_state(path: str | Path, map_location: str | torch.device = "cpu") -> Any:
    """`torch.load(path, weights_only=True)`, with one-line errors naming the file (CheckpointError).

    Nothing is ever unpickled beyond tensors and plain containers: a file holding other objects (a pickle
    planted under a model file's name, a checkpoint from another tool) is refused, and so is a truncated one.
    """
    import pickle

    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, expected a PyTorch weights file")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        detail = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else text
        detail = " ".join(detail.split())[:200]
        raise CheckpointError(
            f"{path}: refused: not a plain state dict of tensors ({detail}); pfactory loads weights only "
            "and never executes code from a model file"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        detail = " ".join(str(e).split())[:200]
        raise CheckpointError(
            f"{path}: not a readable PyTorch file, truncated or corrupt ({detail})"
        ) from None


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """`model_config.json` of a trained-model directory, format-checked."""
    model_dir = Path(model_dir)
    path = model_dir / CONFIG
    if not model_dir.is_dir():
        what = "missing" if not model_dir.exists() else "not a directory"
        raise FileNotFoundError(
            f"{model_dir}: {what}; expected a trained-model directory (run `factory train`)"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no model config; not a trained-model directory (run `factory train`)"
        )
    config = read_json_object(path, CheckpointError, "JSON model config")
    if int(config.get("format", 0)) > CONFIG_FORMAT:
        raise ValueError(
            f"{path}: model config format {config['format']} is newer than this pfactory ({CONFIG_FORMAT})"
        )
    if int(config.get("format", 0)) < 2 and isinstance(config.get("model"), dict):
        config["model"] = {**_FORMAT1_MODEL, **config["model"]}
    if int(config.get("format", 0)) < 3 and isinstance(config.get("model"), dict):  # the default architecture
        config["arch"], config["plugin"] = DEFAULT_ARCH, None
        config["pc_range"] = config["model"].get("pc_range")  # ModelParams always held it; checked below
        config.setdefault("classes", config["model"].get("classes"))
    for key, kind in (("arch", str), ("model", dict), ("image_size", list), ("classes", list), ("pc_range", list)):
        if not isinstance(config.get(key), kind):
            raise CheckpointError(
                f"{path}: field {key!r} is {type(config.get(key)).__name__}, expected a {kind.__name__} "
                "(not a model config this pfactory wrote; run `factory train`)"
            )
    return config


def data_spec(config: dict[str, Any]) -> DataSpec:
    """The `DataSpec` a `model_config.json` was trained for."""
    return DataSpec(
        tuple(config["classes"]), tuple(float(v) for v in config["pc_range"]),  # type: ignore[arg-type]
        (int(config["image_size"][0]), int(config["image_size"][1])), tuple(config.get("cameras") or ()),
    )  # fmt: skip


def build_from_config(config: dict[str, Any]) -> Any:
    """The (untrained) detector a `model_config.json` describes, built through the registry."""
    from pfactory.detectors import registry

    _warn_other_plugin(config)
    params = {k: v for k, v in dict(config["model"]).items() if k not in DATA_KEYS}
    return registry.build(config["arch"], params, data_spec(config))


def _warn_other_plugin(config: dict[str, Any]) -> None:
    """One stderr line when the model was trained with another version of its plugin than the installed."""
    import sys

    from pfactory.config import plugins

    was = config.get("plugin")
    if not was:
        return
    try:
        now = plugins.info(plugins.MODELS, config["arch"]).record()
    except plugins.PluginError:
        return  # build() says it in one line
    if now.get("files_sha256") != was.get("files_sha256"):
        print(f"model: trained with {was.get('name')} {was.get('source')} (files {str(was.get('files_sha256'))[:12]}); "
              f"installed is {now['source']} (files {now['files_sha256'][:12]})", file=sys.stderr)  # fmt: skip


def load_model(model_dir: str | Path, map_location: str | torch.device = "cpu") -> tuple[Any, dict]:
    """Rebuild the detector of `model_dir` and load its weights (`weights_only=True`); eval mode."""
    config = read_config(model_dir)
    model = build_from_config(config)
    state = load_state(Path(model_dir) / WEIGHTS, map_location)
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as e:
        detail = " ".join(str(e).split())[:200]
        raise CheckpointError(
            f"{Path(model_dir) / WEIGHTS}: weights that do not fit the model of {CONFIG} ({detail})"
        ) from None
    return model.to(map_location).eval(), config
