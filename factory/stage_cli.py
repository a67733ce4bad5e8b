"""`factory <stage>` for every stage with a command line: Typer commands built from the stage's own
declaration (`tasks/<stage>.py` `COMMAND`, `tasks._command`), the one `python -m tasks.<stage>` is built from
too, calling the same `tasks._stage.run_stage`.

Imports only Typer, the standard library and the task modules, which import nothing heavy at import time
(`factory --help` answers in well under a second).
"""

from __future__ import annotations

import enum
import inspect
from pathlib import Path
from typing import Annotated, Any

import typer

import tasks.evaluate
import tasks.optimize
import tasks.prepare
import tasks.promote
import tasks.train
from tasks._command import Command, Option

# The stages `factory` has a command for (synth is `factory data synth`, with its own options).
STAGE_COMMANDS: tuple[Command, ...] = tuple(
    m.COMMAND for m in (tasks.prepare, tasks.train, tasks.optimize, tasks.evaluate, tasks.promote)
)


def _annotation(stage: str, o: Option) -> Any:
    """`Annotated[type, typer.Option/Argument(...)]` for one declared option."""
    if o.positional:
        return Annotated[str | None, typer.Argument(help=o.help, show_default=False, metavar=o.name.upper())]
    if o.kind is bool:
        names = o.flags if not o.default else (f"{o.flags[0]}/--no-{o.flags[0].removeprefix('--')}",)
        return Annotated[bool, typer.Option(*names, help=o.help)]
    kind: Any = o.kind
    if o.choices:  # Typer shows and checks an Enum's values
        kind = enum.Enum(f"{stage}_{o.name}", {c: c for c in o.choices}, type=str)
    return Annotated[kind | None, typer.Option(*o.flags, help=o.help, show_default=o.default is not None)]


# `-S/--set-param` and `--params`: every stage takes them, and the other `factory` commands too (factory/cli.py).
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set-param", "-S", help="Override a parameter, DVC syntax: -S section.key=value (repeatable)."),
]
ParamsOpt = Annotated[
    Path | None,
    typer.Option(
        "--params",
        help="The params file. Default: the project's params.yaml (the project is found from the current "
        "folder upward, like git and DVC find theirs); its paths are relative to the project.",
    ),
]


def _common() -> list[inspect.Parameter]:
    """`-S/--set-param` and `--params`, which every stage takes."""
    kw = inspect.Parameter.KEYWORD_ONLY
    return [inspect.Parameter("set_param", kw, default=None, annotation=SetOpt),
            inspect.Parameter("params_file", kw, default=None, annotation=ParamsOpt)]  # fmt: skip


def stage_command(command: Command) -> Any:
    """The Typer callback of `factory <stage>`: its signature is the stage's declared options + the common ones;
    it runs `command.body` through `run_stage` exactly as `python -m tasks.<stage>` does."""
    kw = inspect.Parameter.KEYWORD_ONLY
    parameters = [inspect.Parameter(o.name, kw, default=o.default, annotation=_annotation(command.stage, o))
                  for o in command.options]  # fmt: skip
    parameters += _common()

    def callback(**values: Any) -> None:
        from tasks._stage import run_stage

        options = {o.name: _plain(values[o.name]) for o in command.options}
        run_stage(command, values["params_file"], values["set_param"], **options)

    callback.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    callback.__annotations__ = {p.name: p.annotation for p in parameters}
    callback.__name__ = f"{command.stage}_cmd"
    callback.__doc__ = command.help
    return callback


def _plain(value: Any) -> Any:
    """A choice's Enum member -> its string (what argparse gives the stage body)."""
    return value.value if isinstance(value, enum.Enum) else value


def register(app: typer.Typer) -> None:
    """Add `factory prepare | train | optimize | evaluate | promote` to `app`."""
    for command in STAGE_COMMANDS:
        app.command(command.stage)(stage_command(command))
