"""Traced export graphs ("templates") kept between exports, so a second export of the same architecture
costs the ONNX optimizer pass instead of a whole trace.

The exporter's work splits into tracing (torch.export, decompositions, translation to ONNX: ~85 % of an
export of the default detector) and the ONNX optimizer pass (constant folding, fusions). The traced graph
depends on the code, the model's configuration and the export arguments, not on the weights: the weights
are the unoptimized graph's initializers, named by the export wrapper's state-dict keys. A template is that
unoptimized graph. `pfactory.optimize.export.export_onnx` always builds `model.onnx` from a template file
(torch's own `ONNXProgram.apply_weights`, then `optimize`), whether it was traced just now or found here, so
a hit and a miss write the same bytes.

Key (`template_key`): sha256 of the versions of torch, onnx, onnxscript and onnx-ir; the source of the code
that can shape the trace (`pfactory/archs/painted_pillars`, `kernels`, `pfactory/optimize/export.py` and the file of every
module class in the wrapper); the module tree (names and classes); the state-dict schema (names, shapes,
dtypes); the model's params and image size; and the export arguments (cameras, opset, dynamic batch asked,
example point count). Any code edit is a new key.

Where: `$PFACTORY_EXPORT_CACHE_DIR` (`pfactory.runtime.project.configure_environment`: the project's
`artifacts/.state/onnx-export`, shared by its runs; `off` turns the cache off; unset: off). An entry is
`<key>.onnx` + `<key>.json` (what the trace found: the dynamic batch, or the reason it fell back to batch 1),
each written atomically; the newest `KEEP` entries stay. A template whose graph gives other outputs than the
PyTorch model on a hit (a constant the trace derived from the weights, which `apply_weights` cannot replace)
fails the FP32 parity check there and is traced anew (`export_onnx`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from pfactory.storage.fsutil import atomic_write_bytes, atomic_write_json

CACHE_ENV = "PFACTORY_EXPORT_CACHE_DIR"
OFF = "off"
KEEP = 8  # entries kept (a few MB each for the default detector): the newest by modification time
_PACKAGES = ("torch", "onnx", "onnxscript", "onnx-ir")
_REPO = Path(__file__).resolve().parents[2]
_SOURCE_DIRS = (_REPO / "pfactory" / "model", _REPO / "kernels")
_SOURCE_FILES = (_REPO / "pfactory" / "inference" / "export.py",)


def cache_dir() -> Path | None:
    """The template folder from `$PFACTORY_EXPORT_CACHE_DIR` (None: unset or `off`)."""
    value = os.environ.get(CACHE_ENV, "").strip()
    return None if value in ("", OFF) else Path(value)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _source_files(wrapper: nn.Module) -> list[Path]:
    files = {p for d in _SOURCE_DIRS for p in d.rglob("*.py")} | set(_SOURCE_FILES)
    files |= {Path(f) for m in wrapper.modules() if (f := inspect.getsourcefile(type(m)))}
    return sorted(p.resolve() for p in files if p.is_file())


def template_key(
    wrapper: nn.Module,
    model: nn.Module,
    *,
    cameras: int,
    opset: int,
    dynamic_batch: bool,
    export_points: int,
) -> str:
    """The cache key of the traced graph of `wrapper` (the export wrapper of `model`): see the module
    docstring. 64 hex digits."""
    h = hashlib.sha256()

    def add(label: str, value: Any) -> None:
        h.update(f"{label}={json.dumps(value, sort_keys=True, default=str)}\n".encode())

    add("versions", {p: _version(p) for p in _PACKAGES})
    for path in _source_files(wrapper):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    add("modules", [(n, f"{type(m).__module__}.{type(m).__qualname__}") for n, m in wrapper.named_modules()])
    add("state", [(k, list(v.shape), str(v.dtype)) for k, v in wrapper.state_dict().items()])
    params = getattr(model, "params", None)
    add("params", params.model_dump(mode="json") if hasattr(params, "model_dump") else repr(params))
    add("image_size", list(getattr(model, "image_size", ())))
    add(
        "export",
        {"cameras": cameras, "opset": opset, "dynamic_batch": dynamic_batch, "points": export_points},
    )
    return h.hexdigest()


def lookup(folder: Path, key: str) -> tuple[Path, dict[str, Any]] | None:
    """(template path, trace facts) of `key` in `folder`, or None. A hit is touched (kept by `prune`)."""
    onnx_file, facts_file = folder / f"{key}.onnx", folder / f"{key}.json"
    try:
        facts = json.loads(facts_file.read_text())
        if not onnx_file.is_file():
            return None
        os.utime(onnx_file)
    except (OSError, ValueError):
        return None
    return onnx_file, facts


def store(folder: Path, key: str, template: Path, facts: dict[str, Any]) -> None:
    """Copy `template` and write `facts` as the entry `key` (atomically: the graph first, its facts last, so
    an entry with facts always has its graph), then `prune`."""
    atomic_write_bytes(folder / f"{key}.onnx", template.read_bytes())
    atomic_write_json(folder / f"{key}.json", facts)
    prune(folder)


def forget(folder: Path, key: str) -> None:
    """Remove the entry `key` (a template that failed its parity check)."""
    for suffix in (".json", ".onnx"):
        (folder / f"{key}{suffix}").unlink(missing_ok=True)


def prune(folder: Path, keep: int = KEEP) -> list[Path]:
    """Remove all but the `keep` most recently used entries; returns the removed graphs."""
    graphs = sorted(folder.glob("*.onnx"), key=lambda p: p.stat().st_mtime, reverse=True)
    removed = graphs[keep:]
    for graph in removed:
        forget(folder, graph.stem)
    return removed
