"""Typed pipeline parameters: `params.yaml` (one section per stage, plus `model` and `paths`) and overrides.

Each section is declared beside the code that owns it and named like its stage; this module only
assembles them:

    paths     pfactory/config/paths.py       PathsParams
    synth     pfactory/synth/params.py       SynthParams
    prepare   pfactory/prepare/params.py     PrepareParams
    model     pfactory/detectors/params.py   ModelSection (arch + each architecture's own section, by name)
    train     pfactory/train/params.py       TrainParams
    optimize  pfactory/optimize/params.py    OptimizeParams
    evaluate  pfactory/evaluate/params.py    EvaluateParams
    promote   pfactory/promote/params.py     PromoteParams
    gc        here                           GcParams (factory gc's policy after a run; no stage reads it)

Every value has one home, one section: a value several stages use is declared in its home and read by the
others through a view (`pfactory.config.section.SectionView`): the detection score threshold is
`evaluate.score_threshold` (`pfactory.metrics.cut`), which train's validation and optimize's parity read. The training classes
and point-cloud range live in `prepare` only: a detector is built for the prepared data's (its manifest).
Setting one of them in a second place to another value is an error that names the one home.

A stage reads only its own sections (`pfactory.config.params_file.load_sections`); the whole file is for the
flow and the CLI. `load_params(path, overrides)` reads the YAML, applies DVC-style overrides
(`-S section.key=value`, value parsed as YAML, optional `params.yaml:` prefix) and validates
it against `Params`. Unknown keys and bad values are refused with a message that names the
key and what was expected. The defaults of `Params` are the embedded defaults: a missing
`params.yaml` gives the same pipeline as the shipped one (a test keeps the two equal).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from pfactory.config.params_file import (  # noqa: F401  (re-exported: the params API of the CLI, flow and tests)
    ParamsError,
    Sections,
    anchored,
    apply_overrides,
    parse_override,
    read_params,
    read_yaml_file,
    validate,
)
from pfactory.config.paths import PathsParams
from pfactory.config.section import Section
from pfactory.detectors.params import ModelSection, dump
from pfactory.evaluate.params import EvaluateParams
from pfactory.optimize.params import OptimizeParams
from pfactory.prepare.params import PrepareParams
from pfactory.promote.params import PromoteParams
from pfactory.synth.params import SynthParams
from pfactory.train.params import TrainParams


class GcParams(Section):
    """Retention after a `factory run` (`factory gc`'s policy, pfactory/storage/retention.py; docs/OPERATIONS.md
    "Disk, a team's cache and retention"). Both None (the default): a run deletes nothing. No stage reads this section."""

    keep_last: int | None = Field(default=None, ge=1)
    """After a successful run, keep this many newest run workspaces (plus everything a registered model or
    the champion needs) and collect the rest, as `factory gc --keep-last N --yes` does."""
    keep_days: float | None = Field(default=None, gt=0)
    """... and keep every run younger than this many days."""


class Params(Sections):
    """The whole `params.yaml`."""

    paths: PathsParams = Field(default_factory=PathsParams)
    synth: SynthParams = Field(default_factory=SynthParams)
    prepare: PrepareParams = Field(default_factory=PrepareParams)
    model: ModelSection = Field(default_factory=ModelSection)
    train: TrainParams = Field(default_factory=TrainParams)
    optimize: OptimizeParams = Field(default_factory=OptimizeParams)
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    promote: PromoteParams = Field(default_factory=PromoteParams)
    gc: GcParams = Field(default_factory=GcParams)

    def to_file_dict(self) -> dict[str, Any]:
        """What `params.yaml` holds: every section (the model's as `pfactory.detectors.params.dump` writes it)."""
        raw = self.model_dump(mode="json")
        raw["model"] = dump(self.model)
        return raw


def load_params(path: str | Path | None = "params.yaml", overrides: list[str] | None = None) -> Params:
    """Read, override and validate `params.yaml`; a missing file means the embedded defaults."""
    raw, source = read_params(path, overrides)
    # The whole file is the flow's and the CLI's: the installed plugin of `model.arch` is recorded (pinned);
    # a stage verifies that record against what is installed (pfactory.detectors.params).
    return validate(Params, raw, source, pin=True)


def params_to_yaml(params: Params) -> str:
    """The resolved params as YAML, as `params.yaml` holds them (what a run workspace gets and `factory
    params` shows)."""
    return yaml.safe_dump(params.to_file_dict(), sort_keys=False)
