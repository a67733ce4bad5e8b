"""Plugins by name: Python entry points, resolved lazily (DESIGN.md §5b).

Two groups: `pfactory.models` (detector architectures, `pfactory.detectors`) and `pfactory.datasets` (raw
dataset layouts, `pfactory.sensors.datasets`). Built-in ones are entry points of this project's own
distribution (pyproject.toml), installed ones of theirs: the factory lists both the same way and imports
one only when it is chosen, so a broken plugin breaks nothing but runs that select it (the failure mode of
import-time registries: open-mmlab/mmdetection3d#2183). Nothing is registered by an import side effect.

In:  a group and a name (`model.arch`, a dataset layout).
Out: `PluginInfo` (name, `module:attr`, where it comes from: `built-in` or the distribution's name and
     version) without importing anything; `load(...)` -> the object and its info, or one `PluginError`
     line naming the plugin, its package and what is wrong (exit 2); `files_hash(info)`: a sha256 over
     the plugin's files, so lineage and DVC's run-cache key change when its code does.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pfactory.runtime.failures import EXIT_USAGE, UserError

MODELS = "pfactory.models"
DATASETS = "pfactory.datasets"
PROJECT_DIST = "perception-factory"  # pyproject.toml's [project] name: entry points of it are built-in
_KIND = {MODELS: "model", DATASETS: "dataset"}


class PluginError(UserError, ValueError):
    """A plugin that is not installed, fails to import or breaks its contract: one line naming it."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class PluginInfo:
    """One entry point of a plugin group, as found (nothing imported)."""

    group: str
    name: str
    target: str  # "module:attr"
    dist: str | None  # the distribution that declares it
    version: str | None

    @property
    def builtin(self) -> bool:
        return self.dist == PROJECT_DIST

    @property
    def source(self) -> str:
        """`built-in`, or `<distribution> <version>`."""
        if self.builtin:
            return "built-in"
        return f"{self.dist or '?'} {self.version or '?'}"

    @property
    def label(self) -> str:
        """How messages name it: `model plugin 'x' (dist 1.0, module:attr)`."""
        kind = _KIND.get(self.group, self.group)
        return f"{kind} plugin {self.name!r} ({self.source}, {self.target})"

    def record(self) -> dict[str, Any]:
        """What lineage records (MLflow params, model_config.json, the model card): with the files hash."""
        return {
            "name": self.name,
            "target": self.target,
            "source": self.source,
            "dist": self.dist,
            "version": self.version,
            "files_sha256": files_hash(self),
        }


@dataclass(frozen=True)
class Row:
    """One line of a plugin listing (`factory models`, `factory datasets`)."""

    name: str
    target: str
    source: str
    status: str  # "ok" or the one-line error
    description: str = ""


def format_rows(rows: list[Row], group: str) -> list[str]:
    """The listing as aligned text lines: name, `module:attr`, source; a broken plugin's error, and the other
    distributions that declare the same name (the one used is `entries`')."""
    dup = duplicates(group)
    width = max([len(r.name) for r in rows] + [4])
    twidth = max([len(r.target) for r in rows] + [6])
    lines = []
    for r in rows:
        state = "" if r.status == "ok" else f"  BROKEN: {r.status}"
        also = f"  (also declared by: {', '.join(dup[r.name])})" if r.name in dup else ""
        lines.append(f"{r.name:<{width}}  {r.target:<{twidth}}  {r.source}{state}{also}")
    return lines


def entries(group: str) -> dict[str, PluginInfo]:
    """Every entry point of `group` by name (sorted), read from installed metadata; nothing is imported.
    Two distributions declaring one name: the built-in wins; between two others, the first found (a
    duplicate is reported by `factory models`, `duplicates(group)`)."""
    found: dict[str, PluginInfo] = {}
    for ep in metadata.entry_points(group=group):
        dist = getattr(ep, "dist", None)
        info = PluginInfo(group, ep.name, ep.value, dist.name if dist else None, dist.version if dist else None)
        if ep.name not in found or (info.builtin and not found[ep.name].builtin):
            found[ep.name] = info
    return dict(sorted(found.items()))


def duplicates(group: str) -> dict[str, list[str]]:
    """Names declared by more than one distribution: name -> the sources (the one used is `entries`')."""
    seen: dict[str, list[str]] = {}
    for ep in metadata.entry_points(group=group):
        dist = getattr(ep, "dist", None)
        seen.setdefault(ep.name, []).append(f"{dist.name} {dist.version}" if dist else "?")
    return {k: v for k, v in seen.items() if len(v) > 1}


def info(group: str, name: str) -> PluginInfo:
    """The entry point `name` of `group`; PluginError listing what is installed when there is none."""
    found = entries(group)
    if name not in found:
        kind = _KIND.get(group, group)
        known = ", ".join(found) or "none"
        raise PluginError(
            f"no {kind} plugin named {name!r} is installed (entry-point group {group}; installed: {known}); "
            f"`factory {'models' if group == MODELS else 'datasets'}` lists them"
        )
    return found[name]


def load(group: str, name: str) -> tuple[Any, PluginInfo]:
    """Import the object the entry point `name` of `group` names; PluginError (one line) when it fails."""
    pi = info(group, name)
    module, _, attr = pi.target.partition(":")
    try:
        obj: Any = importlib.import_module(module.strip())
        for part in attr.strip().split(".") if attr.strip() else []:
            obj = getattr(obj, part)
    except Exception as e:  # whatever the plugin's import raises: one line, never a traceback
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise PluginError(f"{pi.label} cannot be loaded: {detail}") from None
    return obj, pi


def _plugin_files(pi: PluginInfo) -> dict[str, Path]:
    """The files that make the plugin's code, by a name relative to where they are installed: its
    distribution's files (RECORD), minus bytecode and install metadata; for an editable install (RECORD holds
    only the hook), also the .py files of the folder its top-level module really comes from."""
    files: dict[str, Path] = {}
    dist = metadata.distribution(pi.dist) if pi.dist else None
    for f in (dist.files or []) if dist is not None else []:
        name = str(f)
        if name.endswith((".pyc", "RECORD", "INSTALLER", "REQUESTED")) or "__pycache__" in name:
            continue
        path = Path(str(f.locate()))
        if path.is_file():
            files[name] = path
    spec = importlib.util.find_spec(pi.target.partition(":")[0].strip().split(".")[0])
    if spec is not None and spec.origin and Path(spec.origin) not in files.values():
        origin = Path(spec.origin)
        folder = origin.parent if origin.name == "__init__.py" else origin
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else [folder]:
            files[path.relative_to(folder.parent).as_posix()] = path
    return files


def files_hash(pi: PluginInfo) -> str:
    """sha256 over the plugin's files (relative name + bytes, sorted by name): changes whenever its code does,
    a rename included."""
    h = hashlib.sha256()
    for name, path in sorted(_plugin_files(pi).items()):
        h.update(name.encode() + b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()

