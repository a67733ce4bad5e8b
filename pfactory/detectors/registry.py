"""Architectures by name: `model.arch` -> an `Architecture`, through the entry-point group `pfactory.models`.

Built-in architectures are entry points of this project (pyproject.toml), installed ones of their own
distribution; both are found the same way and imported only when selected (`pfactory.config.plugins`). A plugin that
fails to import, or whose object or built detector breaks the contract, is one `PluginError` line naming the
plugin, its distribution and what is wrong (exit 2), and never affects the other architectures.

In:  a name. Out: `architecture(name)` -> (Architecture, PluginInfo); `build(name, params, spec)` -> a
checked detector; `listing()` -> one row per installed architecture for `factory models` (loading each to
report its state, never raising).
"""

from __future__ import annotations

from typing import Any

from pfactory.config import plugins
from pfactory.detectors.contract import (
    Architecture,
    ContractError,
    DataSpec,
    check_architecture,
    check_detector,
)


def architecture(name: str) -> tuple[Architecture, plugins.PluginInfo]:
    """The architecture `name`, contract-checked; PluginError (one line, exit 2) otherwise."""
    obj, info = plugins.load(plugins.MODELS, name)
    try:
        return check_architecture(obj), info
    except ContractError as e:
        raise plugins.PluginError(f"{info.label} does not satisfy the detector contract: {e}") from None


def build(name: str, params: Any, spec: DataSpec) -> Any:
    """A detector of architecture `name` for `params` (its section, validated) and `spec`; contract-checked.
    An exception the plugin's build raises is its own (a bug of the plugin shows its traceback)."""
    arch, info = architecture(name)
    if not isinstance(params, arch.params):
        params = arch.params.model_validate(params if isinstance(params, dict) else params.model_dump())
    model = arch.build(params, spec)
    try:
        check_detector(model)
    except ContractError as e:
        raise plugins.PluginError(f"{info.label} does not satisfy the detector contract: {e}") from None
    return model


def listing() -> list[plugins.Row]:
    """Every installed architecture, loaded to check it; a broken one is listed with its error."""
    rows = []
    for name, info in plugins.entries(plugins.MODELS).items():
        try:
            arch, _ = architecture(name)
            rows.append(plugins.Row(name, info.target, info.source, "ok", arch.description.split("\n")[0]))
        except plugins.PluginError as e:
            rows.append(plugins.Row(name, info.target, info.source, str(e)))
    return rows
