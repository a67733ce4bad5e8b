"""How a stage declares its command line, once, for both of its entries.

Each `tasks/<stage>.py` declares `COMMAND = Command(stage, help, options, body, sections)`. Both entries are
built from it: `python -m tasks.<stage>` (argparse, `tasks._stage.stage_main`; what dvc.yaml runs) and
`factory <stage>` (Typer, `factory/stage_cli.py`); after parsing, both call `tasks._stage.run_stage(COMMAND,
...)` with the same values, so an option, its help and its default exist once and the two cannot drift.
Every stage also takes `-S/--set-param section.key=value` (repeatable) and `--params FILE` (default: the
project's params.yaml, `pfactory.runtime.project.params_path`).

`factory --help` must answer in well under a second, so a task module imports only the standard library and
this module at import time; what its stage needs (pydantic, numpy, torch: 0.48 s for the old `tasks.train`,
measured 2026-12-03) is imported inside `body`, `run` and `sections`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DASK_HELP = "Run on Dask: local:N (a LocalCluster) or a scheduler address tcp://host:8786. Default: {key}."


@dataclass(frozen=True)
class Option:
    """One option of a stage. `name` is the Python name (`no_track` -> `--no-track`); `kind` is `str`, `Path`,
    `int`, `float` or `bool` (a flag; with `default=True` it is `--name/--no-name`). `default=None` means "from
    params.yaml" (the help says which key). `flag` replaces the derived `--name`; `positional`: an optional
    argument instead of an option. `choices`: the accepted values of a `str` option."""

    name: str
    help: str
    kind: type = str
    default: Any = None
    flag: str | None = None
    positional: bool = False
    choices: tuple[str, ...] | None = None

    @property
    def flags(self) -> tuple[str, ...]:
        """The option's names on the command line (empty for a positional argument)."""
        if self.positional:
            return ()
        return (self.flag or "--" + self.name.replace("_", "-"),)


@dataclass(frozen=True)
class Command:
    """A stage's command line and what runs it.

    `stage`: its name in dvc.yaml. `help`: the command's help (first line: the summary `--help` lists).
    `options`: its own options. `body(params, options) -> metrics | None`: the stage's work, given the validated
    params and a namespace of the options' values. `sections() -> {name: model}`: the params sections it reads
    besides `paths` (imported only when it runs)."""

    stage: str
    help: str
    options: tuple[Option, ...]
    body: Callable[[Any, Any], dict | None]
    sections: Callable[[], Mapping[str, type]]
