"""The `model` section of params.yaml: which architecture, and each architecture's own section by its name.

    model:
      arch: painted_pillars          # `factory models` lists the installed ones
      painted_pillars:               # that architecture's hyper-parameters (its schema's defaults if absent)
        pillar_size_m: 0.4
      plugin: null                   # pinned by the factory for an installed plugin (see below)

Each architecture's hyper-parameters live under `model.<name>`, validated with that architecture's own schema
(unknown keys refused, naming the key) when it is selected; a section of an architecture that is not selected
is kept as written (it must name an installed architecture). They are one DVC param (`model`), so DVC's
run-cache key covers whatever architecture a stage builds.

`plugin`: for an architecture from an installed distribution, its record (name, target, distribution,
version, sha256 of its files: `pfactory.config.plugins.PluginInfo.record`). `factory run` writes it into each run's
params.yaml, so the run-cache never restores a model built by another version of the plugin; a stage whose
params pin a record that differs from the installed plugin refuses to run (exit 2, one line). Built-in
architectures need no record: their code is a DVC dependency of the stages (dvc.yaml).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, model_validator

from pfactory.config.section import Section
from pfactory.detectors.contract import DATA_KEYS

DEFAULT_ARCH = "painted_pillars"
_OWN = ("arch", "plugin")


class ModelSection(Section):
    """`model:` (module docstring)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False)

    arch: str = DEFAULT_ARCH
    """The architecture, by its registry name (entry-point group `pfactory.models`; `factory models`)."""
    plugin: dict[str, Any] | None = None
    """The selected plugin's record (distribution, version, files sha256); filled by the factory."""

    @model_validator(mode="after")
    def _sections_are_mappings(self) -> ModelSection:
        for name, value in self.__pydantic_extra__.items():
            if name in DATA_KEYS:
                raise ValueError(
                    f"model.{name} is not set here: it is prepare.{name} (a fact of the prepared data; a "
                    "detector is built for its manifest's)"
                )
            if not isinstance(value, dict | Section):
                raise ValueError(f"model.{name} must be the section of architecture {name!r} (a mapping)")
        return self

    def section(self, name: str | None = None) -> Any:
        """The validated section of `name` (default: the selected architecture); call `resolve` first."""
        name = name or self.arch
        value = self.__pydantic_extra__.get(name)
        if not isinstance(value, Section) and name == self.arch:
            resolve(self, "params")  # built in code (`Params()`), not read from a file: resolve now
            value = self.__pydantic_extra__.get(name)
        if not isinstance(value, Section):
            raise KeyError(f"model.{name}: not the selected architecture ({self.arch}), so not validated")
        return value

    def after_validation(self, source: str, pin: bool = False) -> None:
        """`pfactory.config.params_file.validate`'s hook: `resolve` this section."""
        resolve(self, source, pin)

    @property
    def selected(self) -> Any:
        """The selected architecture's validated section."""
        return self.section(self.arch)


def resolve(section: ModelSection, source: str, pin: bool = False) -> ModelSection:
    """Validate `section` against the installed architectures, in place: every `model.<name>` must name one;
    the selected one's section is validated with its schema (defaults when absent; `classes` / `pc_range`
    are refused: they are the prepared data's). `pin`: record the installed plugin (`plugin`); else a
    recorded plugin must match the installed one. ParamsError / PluginError (exit 2) naming the key."""
    from pydantic import ValidationError

    from pfactory.config import plugins
    from pfactory.config.params_file import ParamsError, _format_validation_error
    from pfactory.detectors import registry

    extra = section.__pydantic_extra__  # a dict with extra="allow": the architectures' sections, written into
    installed = plugins.entries(plugins.MODELS)
    if section.arch not in installed:
        known = ", ".join(installed) or "none"
        raise ParamsError(
            f"{source}: model.arch: no architecture named {section.arch!r} is installed (installed: {known}; "
            "`factory models` lists them with where they come from)"
        )
    for name in extra:
        if name not in installed:
            raise ParamsError(
                f"{source}: model.{name}: unknown key (not arch/plugin, and no installed architecture of that "
                f"name; installed: {', '.join(installed)})"
            )
    arch, info = registry.architecture(section.arch)
    raw = extra.get(section.arch) or {}
    if isinstance(raw, Section):
        raw = raw.model_dump(mode="json")
    for key in DATA_KEYS:
        if key in raw:
            home = f"prepare.{key}"
            raise ParamsError(
                f"{source}: model.{section.arch}.{key} is not set here: it is {home} (a fact of the prepared "
                "data; the model takes it from the manifest)"
            )
    try:
        extra[section.arch] = arch.params.model_validate(raw)
    except ValidationError as e:
        text = _format_validation_error(e, source)
        raise ParamsError(text.replace(f"{source}: ", f"{source}: model.{section.arch}.")) from None
    installed_record = None if info.builtin else info.record()
    if pin:
        section.plugin = installed_record
    elif section.plugin is not None and section.plugin != installed_record:
        was = section.plugin
        now = installed_record or {"source": "built-in"}
        raise plugins.PluginError(
            f"{source}: model.plugin pins {was.get('name')} {was.get('source')} (files "
            f"{str(was.get('files_sha256'))[:12]}), but the installed {info.label} is "
            f"{now.get('source')} (files {str(now.get('files_sha256', ''))[:12]}): another version of the "
            "plugin; run it again with `factory run` (it pins the installed one) or set model.plugin: null"
        )
    elif installed_record is not None:
        section.plugin = installed_record  # a stage run by hand: record what ran
    return section


def dump(section: ModelSection) -> dict[str, Any]:
    """What params.yaml holds for `model`: arch, plugin, and each architecture's section."""
    out: dict[str, Any] = {"arch": section.arch}
    for name, value in section.__pydantic_extra__.items():
        out[name] = value.model_dump(mode="json") if isinstance(value, Section) else value
    out["plugin"] = section.plugin
    return out
